"""The structure distribution of DBSN: sharpened concrete posterior, uniform prior, KL.

The network structure is one weight vector alpha in the simplex per edge (Eq. 1). Its
variational posterior q(alpha | theta) is the sharpened concrete distribution (Eq. 4, 5),
its prior p(alpha) the same family with uniform logits and beta = 1, and the KL term of
the loss (Eq. 3) is estimated from the reparameterised samples that feed the network.
This module knows nothing of networks: it maps logits to samples, densities and KLs. It
computes in float32 (at least) under mixed precision: autocast is off inside (`dbsn.precision`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.distributions import Distribution, constraints
from torch.distributions.utils import clamp_probs

from dbsn.precision import float32, full

__all__ = ["SharpenedConcrete", "StructureLogits", "kl_estimate", "uniform_prior"]


class SharpenedConcrete(Distribution):
    """Sharpened concrete distribution (Eq. 4 sampling, Eq. 5 density) over the simplex in R^K.

    A sample is alpha = softmax((theta + beta * g) / tau) with g i.i.d. Gumbel(0, 1) (Eq. 4).
    beta = 1 gives the concrete distribution of Maddison et al. (2017); beta < 1 shrinks
    the Gumbel noise and so sharpens the posterior towards softmax(theta / tau). Since
    (theta + beta g) / tau = (theta / beta + g) / (tau / beta), it is the concrete
    distribution with logits theta / beta and temperature tau / beta.

    Args:
        logits: theta, shape (..., K). The batch shape is logits.shape[:-1] (broadcast
            with the shapes of beta and tau), the event shape (K,).
        beta: sharpening factor > 0; a float or a tensor broadcastable to the batch shape
            (e.g. one value per edge).
        tau: temperature > 0; a float or a tensor broadcastable to the batch shape.
    """

    arg_constraints = {
        "logits": constraints.real_vector,
        "beta": constraints.positive,
        "tau": constraints.positive,
    }
    support = constraints.simplex
    has_rsample = True

    def __init__(
        self,
        logits: Tensor,
        beta: float | Tensor = 1.0,
        tau: float | Tensor = 1.0,
        validate_args: bool | None = None,
    ) -> None:
        if logits.dim() < 1:
            raise ValueError("logits must have at least one dimension (the K categories)")
        dtype = torch.promote_types(logits.dtype, torch.float32)  # 16-bit logits: beta and tau stay exact
        # a number becomes a tensor by a fill on the device, not a copy from the host
        beta = beta.to(dtype) if isinstance(beta, Tensor) else torch.full((), beta, dtype=dtype, device=logits.device)
        tau = tau.to(dtype) if isinstance(tau, Tensor) else torch.full((), tau, dtype=dtype, device=logits.device)
        batch_shape = torch.broadcast_shapes(logits.shape[:-1], beta.shape, tau.shape)
        event_shape = logits.shape[-1:]
        self.logits = logits.expand(batch_shape + event_shape)
        self.beta = beta.expand(batch_shape)
        self.tau = tau.expand(batch_shape)
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @property
    def probs(self) -> Tensor:
        """softmax(theta): the class probabilities of the underlying categorical."""
        return torch.softmax(self.logits, dim=-1)

    def rsample(self, sample_shape: torch.Size | tuple[int, ...] = torch.Size()) -> Tensor:
        """Reparameterised sample alpha = softmax((theta + beta * g) / tau) (Eq. 4)."""
        shape = self._extended_shape(torch.Size(sample_shape))
        with float32():
            logits, beta, tau = full(self.logits), full(self.beta), full(self.tau)
            u = clamp_probs(torch.rand(shape, dtype=logits.dtype, device=logits.device))
            gumbel = -torch.log(-torch.log(u))
            scores = (logits + beta.unsqueeze(-1) * gumbel) / tau.unsqueeze(-1)
            return torch.log_softmax(scores, dim=-1).exp()

    def log_prob(self, value: Tensor) -> Tensor:
        """log q(alpha | theta, beta) of Eq. 5, constants included.

        The density is with respect to Lebesgue measure on the first K - 1 coordinates of
        the simplex. Entries of value are clamped to the smallest positive normal number
        before the log, so a weight that underflowed to 0 gives a finite (very low)
        density instead of nan.
        """
        if self._validate_args:
            self._validate_sample(value)
        k = self.event_shape[0]
        with float32():
            value, logits, beta, tau = full(value), full(self.logits), full(self.beta), full(self.tau)
            log_alpha = value.clamp(min=torch.finfo(value.dtype).tiny).log()
            scores = (logits - tau.unsqueeze(-1) * log_alpha) / beta.unsqueeze(-1)
            return (
                math.lgamma(k)
                + (k - 1) * (tau.log() - beta.log())
                - log_alpha.sum(-1)
                + scores.sum(-1)
                - k * scores.logsumexp(-1)
            )


def uniform_prior(
    num_edges: int,
    num_ops: int,
    tau: float | Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> SharpenedConcrete:
    """The prior p(alpha): per edge, a concrete distribution with uniform logits and beta = 1
    (Sec. 2.2), at the posterior's temperature tau as in the research code."""
    logits = torch.zeros(num_edges, num_ops, device=device, dtype=dtype)
    return SharpenedConcrete(logits, beta=1.0, tau=tau)


def kl_estimate(alpha: Tensor, posterior: SharpenedConcrete, prior: SharpenedConcrete) -> Tensor:
    """One-sample-per-row estimate of KL(q || p) = log q(alpha) - log p(alpha) (Eq. 3, 5).

    Args:
        alpha: samples from the posterior (rsample), shape (n, E, K).
        posterior: q, a distribution with batch shape (E,).
        prior: p, a distribution with batch shape (E,).

    Returns:
        Shape (n,): the estimate for each row, summed over the E edges, since both q and p
        factorise over edges.
    """
    return (posterior.log_prob(alpha) - prior.log_prob(alpha)).sum(-1)


class StructureLogits(nn.Module):
    """theta: one K-logit vector per edge, shared by all cells (init 1e-3 * N(0,1), like DARTS).

    Holds the variational parameters of q(alpha | theta) and builds the sharpened concrete
    posterior (Eq. 4, 5), the uniform prior and the KL estimate from them.
    """

    def __init__(self, num_edges: int, num_ops: int, init_std: float = 1e-3) -> None:
        super().__init__()
        if num_edges < 1 or num_ops < 1:
            raise ValueError(f"need num_edges >= 1 and num_ops >= 1, got {num_edges}, {num_ops}")
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std}")
        self.num_edges, self.num_ops = num_edges, num_ops
        self.theta = nn.Parameter(init_std * torch.randn(num_edges, num_ops))

    def posterior(self, beta: float | Tensor, tau: float | Tensor) -> SharpenedConcrete:
        """q(alpha | theta, beta) at temperature tau.

        Argument validation is off: it runs every training step and would force a device sync.
        """
        return SharpenedConcrete(self.theta, beta=beta, tau=tau, validate_args=False)

    def prior(self, tau: float | Tensor) -> SharpenedConcrete:
        """p(alpha): uniform logits, beta = 1, the same temperature tau."""
        zeros = torch.zeros_like(self.theta)
        return SharpenedConcrete(zeros, beta=1.0, tau=tau, validate_args=False)

    def sample(self, n: int, beta: float | Tensor, tau: float | Tensor) -> Tensor:
        """n reparameterised structure samples, shape (n, E, K)."""
        return self.posterior(beta, tau).rsample((n,))

    def kl(self, alpha: Tensor, beta: float | Tensor, tau: float | Tensor) -> Tensor:
        """KL(q || p) estimate for each of the n samples alpha (n, E, K); shape (n,)."""
        return kl_estimate(alpha, self.posterior(beta, tau), self.prior(tau))

    def probs(self) -> Tensor:
        """softmax(theta), shape (E, K)."""
        return torch.softmax(self.theta, dim=-1)

    def most_likely(self) -> Tensor:
        """Index of the most probable operation on each edge, shape (E,)."""
        return self.theta.argmax(dim=-1)

    def extra_repr(self) -> str:
        return f"num_edges={self.num_edges}, num_ops={self.num_ops}"
