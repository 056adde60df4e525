"""Rank-1 BNN layers (Dusenberry et al., ICML 2020): BatchEnsemble's layers with random factors.

Member m of a BatchEnsemble layer computes with W ∘ s_m r_mᵀ (`dbsn.nets.batch_ensemble`); the
rank-1 BNN puts a posterior on the factors instead: a mixture of M components, component m with
independent entries r_mi ~ q(r_m, softplus(ρ^r_m)) and s_mj ~ q(s_m, softplus(ρ^s_m)), normal or
Cauchy (`dbsn.bayes.rank1.FactorDistribution`), around one shared point-estimate weight W. As
edward2's `Conv2DRank1` / `DenseRank1` with multiplicative factors: the batch holds the
components' rows interleaved (row r is component r mod M), every row draws its own r and s
(reparameterised), the draws are clipped to [−10, 10], and a component's bias is a point
estimate. `r`, `s` are the locations (initialised by `random_sign_init`), `r_rho`, `s_rho` the
raw scales, started at softplus⁻¹(σ₀), σ₀ = sqrt(p / (1 − p)) for the authors' `dropout_rate` p
(jittered by a truncated N(0, 0.1²) for the normal family; uncertainty-baselines'
`make_initializer`; values in docs/methods.md, "Rank-1 BNN").

With scales 0 a layer is the BatchEnsemble layer of its locations. The evaluation's members
(`dbsn.methods.Rank1BNN.fixed_members`) are drawn once: `draw_members` draws one (r, s) per member
for every layer and `holding` makes the layers use them, row i·n + k being member k.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.bayes.rank1 import FactorDistribution
from dbsn.nets.batch_ensemble import _BatchEnsembleLayer, swap_layers

__all__ = ["Rank1Conv2d", "Rank1Linear", "draw_members", "holding", "rank1", "rank1_layers", "scale_parameters"]

#: The range a drawn factor is clipped to (edward2's rank-1 layers).
PERTURBATION = (-10.0, 10.0)


def initial_rho(like: Tensor, family: str, init_stddev: float) -> Tensor:
    """The raw scales ρ (softplus(ρ) = σ) of a factor shaped like `like`, as the authors start
    them for `family` (module docstring)."""
    mean = math.log(math.expm1(init_stddev))  # softplus⁻¹(σ₀)
    rho = torch.full_like(like, mean).detach()
    if family == "normal":
        nn.init.trunc_normal_(rho, mean, 0.1, mean - 0.2, mean + 0.2)
    return rho


class _Rank1Layer(_BatchEnsembleLayer):
    """A BatchEnsemble layer whose factors r (M, in) and s (M, out) are the locations of the
    components' posteriors, with raw scales `r_rho`, `s_rho` of the same shapes."""

    def __init__(
        self,
        layer: nn.Module,
        size: int,
        in_features: int,
        out_features: int,
        distribution: FactorDistribution,
        random_sign_init: float,
        init_stddev: float,
    ) -> None:
        super().__init__(layer, size, in_features, out_features, random_sign_init)
        self.distribution = distribution
        self.r_rho = nn.Parameter(initial_rho(self.r, distribution.family, init_stddev))
        self.s_rho = nn.Parameter(initial_rho(self.s, distribution.family, init_stddev))
        self.members: tuple[Tensor, Tensor, Tensor | None] | None = None  # held draws (r, s, bias) of the rows' members

    def scales(self) -> tuple[Tensor, Tensor]:
        """softplus(ρ) of r and of s: the components' posterior scales."""
        return F.softplus(self.r_rho), F.softplus(self.s_rho)

    def _draw(self, loc: Tensor, scale: Tensor) -> Tensor:
        return self.distribution.draw(loc, scale).clamp(*PERTURBATION)

    def draw(self, components: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """One draw of (r, s) for each member, member k of component components[k], and its bias:
        ((n, in), (n, out), (n, out) or None)."""
        r_scale, s_scale = self.scales()
        bias = None if self.bias is None else self.bias[components]
        r, s = self._draw(self.r[components], r_scale[components]), self._draw(self.s[components], s_scale[components])
        return r, s, bias

    def forward(self, x: Tensor) -> Tensor:
        if self.members is not None:  # held members, row i·n + k: member k's draws
            r, s, bias = (None if p is None else self._rows(p, x) for p in self.members)
        else:  # row r: component r mod M, a draw of its own
            r_scale, s_scale = self.scales()
            r = self._draw(self._rows(self.r, x), self._rows(r_scale, x))
            s = self._draw(self._rows(self.s, x), self._rows(s_scale, x))
            bias = None if self.bias is None else self._rows(self.bias, x)
        y = self.layer(x * r) * s
        return y if bias is None else y + bias


class Rank1Conv2d(_Rank1Layer):
    """`nn.Conv2d` (grouped and depthwise too) with M components of random factors: r scales the
    input channels, s the output channels (edward2's `Conv2DRank1`)."""

    channels_first = True

    def __init__(
        self, conv: nn.Conv2d, size: int, distribution: FactorDistribution, random_sign_init: float, init_stddev: float
    ) -> None:
        super().__init__(conv, size, conv.in_channels, conv.out_channels, distribution, random_sign_init, init_stddev)


class Rank1Linear(_Rank1Layer):
    """`nn.Linear` with M components of random factors (edward2's `DenseRank1`)."""

    channels_first = False  # (b, ..., C)

    def __init__(
        self,
        linear: nn.Linear,
        size: int,
        distribution: FactorDistribution,
        random_sign_init: float,
        init_stddev: float,
    ) -> None:
        super().__init__(
            linear, size, linear.in_features, linear.out_features, distribution, random_sign_init, init_stddev
        )


def rank1(
    net: nn.Module, size: int, distribution: FactorDistribution, random_sign_init: float, init_stddev: float
) -> nn.Module:
    """Make `net` a rank-1 BNN of `size` components in place: every `nn.Conv2d` and `nn.Linear`
    becomes a `Rank1Conv2d` / `Rank1Linear` around it (its weight the shared weight); BatchNorm and
    everything else stays shared. Returns `net`, which then takes batches of whole component
    groups (row r = component r mod `size`)."""
    return swap_layers(
        net,
        lambda conv: Rank1Conv2d(conv, size, distribution, random_sign_init, init_stddev),
        lambda linear: Rank1Linear(linear, size, distribution, random_sign_init, init_stddev),
    )


def rank1_layers(net: nn.Module) -> list[_Rank1Layer]:
    """The rank-1 layers of `net`, in the order of `net.modules()`."""
    return [m for m in net.modules() if isinstance(m, _Rank1Layer)]


def scale_parameters(net: nn.Module) -> list[nn.Parameter]:
    """The raw scales ρ of r and s of every rank-1 layer of `net`."""
    return [p for m in rank1_layers(net) for p in (m.r_rho, m.s_rho)]


@torch.no_grad()
def draw_members(net: nn.Module, n: int) -> dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]]:
    """n members drawn once, member k of component k mod M: every rank-1 layer's draws (`draw`)."""
    layers = rank1_layers(net)
    components = torch.arange(n, device=layers[0].r.device) % layers[0].size
    return {layer: layer.draw(components) for layer in layers}


@contextmanager
def holding(draws: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]], members: slice):
    """The layers of `draws` compute with the members `members` of their held draws (row i·n + k:
    the k-th of them) within the block, with fresh draws per row again after it."""
    for layer, drawn in draws.items():
        layer.members = tuple(None if p is None else p[members] for p in drawn)
    try:
        yield
    finally:
        for layer in draws:
            layer.members = None
