"""The distributions of a rank-1 BNN's factors (Dusenberry et al., ICML 2020): each entry of a
factor r or s has a posterior of its own and every entry one prior, of the same family.

- "normal": q = N(loc, scale²), p = N(prior_mean, prior_stddev²); KL(q || p) in closed form
  (edward2's `TrainableNormal` initializer with its `NormalKLDivergence` regularizer);
- "cauchy": q = Cauchy(loc, scale), p = Cauchy(prior_mean, prior_stddev); KL(q || p) estimated
  as edward2's `CauchyKLDivergence` does, log q(z) − log p(z) at one draw z ~ q of every entry,
  reparameterised and drawn afresh at each call (not the forward pass's draws): unbiased, with
  the variance of one draw. (Two Cauchy distributions also have a closed-form KL,
  log(((s_q + s_p)² + (l_q − l_p)²) / (4 s_q s_p)), Chyzak & Nielsen 2019; the tests check the
  estimate against it.)

Sums run over every entry given. Nothing here knows of networks: a layer asks for draws with its
parameters (`dbsn.nets.rank1`), and the method sums the KL (`dbsn.methods.rank1_bnn`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dbsn.bayes.layers import gaussian_kl
from dbsn.precision import float32, full

__all__ = ["FAMILIES", "FactorDistribution", "cauchy_log_prob"]

#: The families of a factor's prior and posterior.
FAMILIES = ("normal", "cauchy")


def cauchy_log_prob(z: Tensor, loc: Tensor | float, scale: Tensor | float) -> Tensor:
    """log of the Cauchy(loc, scale) density at z, elementwise: −log(π s) − log(1 + ((z − l) / s)²)."""
    scale = torch.as_tensor(scale, dtype=z.dtype, device=z.device)
    return -torch.log(math.pi * scale) - torch.log1p(((z - loc) / scale).square())


@dataclass(frozen=True)
class FactorDistribution:
    """The family of a factor's posterior and prior, and the prior's location and scale (the
    authors' CIFAR flags: normal, mean 1, stddev 0.1)."""

    family: str = "normal"
    prior_mean: float = 1.0
    prior_stddev: float = 0.1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"prior must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if not self.prior_stddev > 0:
            raise ValueError(f"prior_stddev must be > 0, got {self.prior_stddev}")

    def draw(self, loc: Tensor, scale: Tensor) -> Tensor:
        """One reparameterised draw of every entry of q(loc, scale): loc + scale · ε, ε standard
        normal or standard Cauchy."""
        noise = torch.randn_like(loc) if self.family == "normal" else torch.empty_like(loc).cauchy_()
        return loc + scale * noise

    def kl(self, loc: Tensor, scale: Tensor) -> Tensor:
        """KL(q || p) summed over the entries, a 0-dim tensor in float32 at least: closed form for
        the normal family, a one-draw Monte Carlo estimate for the Cauchy (module docstring)."""
        with float32():
            loc, scale = full(loc), full(scale)
            if self.family == "normal":
                return gaussian_kl(loc - self.prior_mean, scale, self.prior_stddev)
            z = self.draw(loc, scale)
            return (cauchy_log_prob(z, loc, scale) - cauchy_log_prob(z, self.prior_mean, self.prior_stddev)).sum()
