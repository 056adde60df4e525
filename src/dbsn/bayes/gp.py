"""The random-feature Gaussian-process output layer of SNGP (Liu et al., NeurIPS 2020).

SNGP replaces a network's dense output layer by a Gaussian process on its features h, made
finite with random Fourier features (Rahimi & Recht 2007) and given a Laplace posterior:

    φ(h) = cos(W_φ LayerNorm(P h) + b_φ),      logits g(h) = βᵀ φ(h),

P a fixed random projection (Johnson-Lindenstrauss), LayerNorm with learned scale and offset (or,
without it, inputs scaled by 1 / √`kernel_scale`), W_φ, b_φ fixed orthogonal random features (Yu
et al. 2016, χ-distributed column norms, b_φ ~ U(0, 2π), no √(2 / hidden_dim) scaling) and β the
trainable weights (no bias). Initialisers and defaults follow edward2 / uncertainty-baselines
(docs/field.md, "Settings and their sources").

In training mode the layer returns the MAP logits and sums the exact precision of β over the
detached features, P_β = s I + Σ_n φ_n φ_nᵀ (edward2's `gp_cov_discount_factor=-1`);
`reset_precision()` at every epoch's start keeps the final epoch's sum. In eval mode it returns
the mean-field logits g(h) / √(1 + λ var(h)) (Lu et al. 2020), var(h) = φ(h)ᵀ Σ φ(h),
Σ = s P_β⁻¹ (λ < 0: the MAP logits). `precision` and `covariance` are buffers; the covariance is
recomputed (Cholesky, float64) when first needed after the precision changed. Under DDP
`sync_precision(reduce)` sums the processes' parts before prediction.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.precision import float32, full

__all__ = ["RandomFeatureGaussianProcess", "mean_field_logits", "orthogonal_random_features"]


def orthogonal_random_features(
    in_features: int, out_features: int, std: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """Orthogonal random features (Yu et al. 2016; edward2's `OrthogonalRandomFeatures`), as a
    (out_features, in_features) weight: blocks of Haar-orthogonal (in x in) matrices side by side
    (one (in x out) matrix with orthonormal columns when out <= in), each column scaled to the
    norm of an in-dimensional standard Gaussian vector (χ_in), times `std`. Each row has the
    distribution of a N(0, std² I) row; rows within a block are orthogonal."""
    blocks, sampled = [], 0
    while sampled < out_features:
        q, r = torch.linalg.qr(torch.randn(in_features, in_features, generator=generator))
        blocks.append(q * torch.sign(torch.diagonal(r)))  # sign fix: Haar-distributed
        sampled += in_features
    columns = torch.cat(blocks, dim=1)[:, :out_features]  # (in, out)
    norms = torch.randn(in_features, out_features, generator=generator).square().sum(0).sqrt()
    return (std * columns * norms).T.contiguous()


def mean_field_logits(logits: Tensor, variance: Tensor, factor: float) -> Tensor:
    """logits / √(1 + factor · variance) per example (`variance` (b,)); the logits unchanged for
    a negative factor (edward2's `mean_field_logits`)."""
    if factor < 0:
        return logits
    return logits / torch.sqrt(1.0 + factor * variance).unsqueeze(-1).to(logits.dtype)


class RandomFeatureGaussianProcess(nn.Module):
    """SNGP's Gaussian-process output layer (see the module docstring).

    Args:
        in_features: dimension of the network's features h.
        num_classes: C.
        hidden_dim: number of random features (1024).
        input_dim: dimension of the fixed random projection of h (128); None or 0: no projection.
        normalize_input: LayerNorm on the (projected) features (True).
        feature_std: standard deviation of the random features' frequencies (0.05).
        kernel_scale: without input normalisation, h is scaled by 1 / √kernel_scale (2).
        ridge_penalty: s, the precision's ridge and the covariance's scale (1).
        mean_field_factor: λ of the mean-field logits (25); < 0 predicts with the MAP logits.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        hidden_dim: int = 1024,
        input_dim: int | None = 128,
        normalize_input: bool = True,
        feature_std: float = 0.05,
        kernel_scale: float = 2.0,
        ridge_penalty: float = 1.0,
        mean_field_factor: float = 25.0,
    ) -> None:
        super().__init__()
        if hidden_dim < 1:
            raise ValueError(f"hidden_dim (random features) must be >= 1, got {hidden_dim}")
        if not ridge_penalty > 0 or not feature_std > 0 or not kernel_scale > 0:
            raise ValueError(
                f"ridge_penalty, feature_std and kernel_scale must be > 0, got {ridge_penalty}, "
                f"{feature_std}, {kernel_scale}"
            )
        self.in_features, self.num_classes, self.hidden_dim = in_features, num_classes, hidden_dim
        self.ridge_penalty, self.mean_field_factor = float(ridge_penalty), float(mean_field_factor)
        self.kernel_scale = float(kernel_scale)
        dim = input_dim or in_features
        self.register_buffer("projection", 0.05 * torch.randn(dim, in_features) if input_dim else None)
        self.input_norm = nn.LayerNorm(dim, eps=1e-3) if normalize_input else None
        self.register_buffer("feature_weight", orthogonal_random_features(dim, hidden_dim, feature_std))
        self.register_buffer("feature_bias", 2 * math.pi * torch.rand(hidden_dim))
        self.output = nn.Linear(hidden_dim, num_classes, bias=False)
        nn.init.xavier_uniform_(self.output.weight)
        self.register_buffer("precision", self.ridge_penalty * torch.eye(hidden_dim))
        self.register_buffer("covariance", torch.eye(hidden_dim))  # s (s I)⁻¹
        self._gram: Tensor | None = None  # this process's Σ φ φᵀ since the last reset (not saved)
        self._stale = False  # the precision changed since the covariance was computed

    def features(self, h: Tensor) -> Tensor:
        """φ(h), (b, hidden_dim)."""
        if self.projection is not None:
            h = F.linear(h, self.projection)
        if self.input_norm is not None:
            h = self.input_norm(h)
        else:
            h = h / math.sqrt(self.kernel_scale)
        return torch.cos(F.linear(h, self.feature_weight, self.feature_bias))

    def forward(self, h: Tensor) -> Tensor:
        """Training mode: the MAP logits, and the features join the precision. Eval mode: the
        mean-field logits. In float32 under mixed precision (a small layer, and cos of a
        bfloat16 phase up to 2π would be off by 0.02)."""
        with float32():
            phi = self.features(full(h))
            logits = self.output(phi)
            if self.training:
                self.accumulate(phi)
                return logits
            return mean_field_logits(logits, self.predictive_variance(phi), self.mean_field_factor)

    @torch.no_grad()
    def accumulate(self, phi: Tensor) -> None:
        """P_β += Σ φ φᵀ over the rows of `phi` (detached, in float32)."""
        with float32():
            phi = full(phi.detach())
            gram = phi.T @ phi
        self._gram = gram if self._gram is None else self._gram.add_(gram)
        self.precision.add_(gram)
        self._stale = True

    @torch.no_grad()
    def reset_precision(self) -> None:
        """P_β = s I: the start of an epoch whose features the precision will sum."""
        self._gram = None
        self.precision.copy_(self.ridge_penalty * torch.eye(self.hidden_dim, device=self.precision.device))
        self._stale = True

    @torch.no_grad()
    def sync_precision(self, reduce=None) -> None:
        """P_β = s I + `reduce`(this process's Σ φ φᵀ since the reset): with `reduce` a sum over
        processes, every process gets the precision of all their batches (DDP broadcasts one
        process's buffers at each forward, so the buffer alone would hold only that one's)."""
        if self._gram is None or reduce is None:
            return
        total = reduce(self._gram.clone())
        self.precision.copy_(total)
        self.precision.diagonal().add_(self.ridge_penalty)
        self._stale = True

    @torch.no_grad()
    def update_covariance(self) -> None:
        """Σ = s P_β⁻¹ (Cholesky inverse in float64)."""
        with float32():
            chol = torch.linalg.cholesky(self.precision.double())
            self.covariance.copy_(self.ridge_penalty * torch.cholesky_inverse(chol))
        self._stale = False

    def predictive_variance(self, phi: Tensor) -> Tensor:
        """φᵀ Σ φ of each row of `phi`, (b,), in float32 (differentiable in φ: an adversarial
        attack sees the variance too)."""
        if self._stale:
            self.update_covariance()
        with float32():
            phi = full(phi)
            return ((phi @ self.covariance) * phi).sum(-1)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if self._stale:  # a checkpoint holds the covariance of the precision it holds
            self.update_covariance()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._gram, self._stale = None, False  # predict with the covariance the checkpoint holds

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, hidden_dim={self.hidden_dim}, "
            f"ridge_penalty={self.ridge_penalty}, mean_field_factor={self.mean_field_factor}"
        )
