"""Spectral normalisation with a norm bound: the hidden layers of SNGP (Liu et al., NeurIPS 2020).

Every convolution and linear layer computes with W̄ = W · min(1, c / σ̂(W)), c the norm bound
(`bound`) and σ̂(W) the largest singular value of the layer's *linear operator*, by power
iteration with persistent vectors u, v (buffers). A convolution's operator is x ↦ conv(x, W) on
inputs of the size the layer sees (edward2's `SpectralNormalizationConv2D`, Gouk et al. 2021: the
Lipschitz bound, not Miyato et al.'s reshaped kernel); its input size comes from one eval-mode
forward of a zero image of `input_size`. A linear layer is its matrix (Miyato et al. 2018).

`iterations` steps run at every training forward and none in eval mode (a prediction is
deterministic). The first training forward runs `warmup` more, so σ̂ is accurate from the first
step; at the first forward, not at construction, so a network rebuilt from a checkpoint never pays
them (their cost: docs/performance.md). Unlike edward2, which overwrites its kernel with W̄, W̄ is
a parametrisation of W (`torch.nn.utils.parametrize`), the gradient flowing through σ̂ = uᵀ W v as
in PyTorch's `spectral_norm`; forward values are the same (docs/field.md).

`spectral_normalize(net, bound, ...)` applies it to every `nn.Conv2d` and `nn.Linear` of a network
called `net(x, alpha)`, skipping the modules named in `skip` (SNGP's output layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from dbsn.precision import float32

__all__ = ["SpectralNormBound", "spectral_normalize", "spectrally_normalized_layers"]


def _unit(t: Tensor, eps: float = 1e-12) -> Tensor:
    return t / t.norm().clamp_min(eps)


class SpectralNormBound(nn.Module):
    """The parametrisation W ↦ W · min(1, bound / σ̂(W)) of one layer (see the module docstring).

    Args:
        weight: the layer's weight (its initial value starts the power iteration).
        bound: c, the largest spectral norm the layer may have.
        iterations: power-iteration steps at every training forward.
        input_shape: (C, H, W) of the convolution's input; (in_features,) for a linear layer.
        conv: the convolution's stride, padding, dilation and groups; None for a linear layer.
        warmup: power-iteration steps at the first training forward (on the weight it starts from).
    """

    def __init__(
        self,
        weight: Tensor,
        bound: float,
        iterations: int,
        input_shape: tuple[int, ...],
        conv: dict | None = None,
        warmup: int = 50,
    ) -> None:
        super().__init__()
        if not bound > 0:
            raise ValueError(f"the spectral norm bound must be > 0, got {bound}")
        if iterations < 0 or warmup < 0:
            raise ValueError(f"power iterations must be >= 0, got iterations={iterations}, warmup={warmup}")
        self.bound, self.iterations, self.conv, self.warmup = float(bound), int(iterations), conv, int(warmup)
        self.input_shape = (1, *input_shape)
        w = weight.detach().float()
        v = _unit(torch.randn(self.input_shape, device=w.device))
        self.register_buffer("_v", v)
        self.register_buffer("_u", _unit(self.operator(w, v)))
        self._warmed = False  # the warm-up runs at the first training forward, on the training device

    def get_extra_state(self) -> dict:
        """Whether the warm-up ran, in checkpoints: a network rebuilt from one does not warm up again
        (nor count the warm-up in a training step's cost)."""
        return {"warmed": self._warmed}

    def set_extra_state(self, state: dict) -> None:
        self._warmed = bool(state["warmed"])

    def operator(self, w: Tensor, v: Tensor) -> Tensor:
        """W v: the layer's output on v, without bias."""
        if self.conv is None:
            return F.linear(v, w)
        return F.conv2d(v, w, None, **self.conv)

    def adjoint(self, w: Tensor, u: Tensor) -> Tensor:
        """Wᵀ u: the transposed convolution (the matrix's transpose) of u."""
        if self.conv is None:
            return u @ w
        return torch.nn.grad.conv2d_input(self.input_shape, w, u, **self.conv)

    @torch.no_grad()
    def power_iteration(self, w: Tensor, steps: int) -> None:
        """`steps` steps of v ← Wᵀu / |Wᵀu|, u ← Wv / |Wv| on the persistent vectors."""
        for _ in range(steps):
            self._v.copy_(_unit(self.adjoint(w, self._u)))
            self._u.copy_(_unit(self.operator(w, self._v)))

    def sigma(self, weight: Tensor) -> Tensor:
        """σ̂ = uᵀ W v, differentiable in W (u, v held fixed)."""
        u, v = self._u.clone(), self._v.clone()  # the buffers change in place at the next step
        return (u * self.operator(weight, v)).sum()

    def forward(self, weight: Tensor) -> Tensor:
        with float32():
            w = weight.float()
            if self.training:
                self.power_iteration(w.detach(), self.iterations + (0 if self._warmed else self.warmup))
                self._warmed = True
            factor = torch.clamp(self.bound / self.sigma(w), max=1.0)
        return weight * factor.to(weight.dtype)


def _alpha_for(net: nn.Module) -> Tensor:
    """One structure for a dry run: uniform α (1, E, K) (every op of a cell runs); (1, 0, 0)
    for a network without structure."""
    edges, ops = getattr(net, "num_edges", 0), getattr(net, "num_ops", 0)
    return torch.full((1, edges, ops), 1.0 / max(ops, 1))


@torch.no_grad()
def _input_shapes(net: nn.Module, layers: dict[str, nn.Module], input_size: int) -> dict[str, tuple[int, ...]]:
    """The input shape (without batch) each of `layers` sees in one eval-mode forward of a zero
    image of `input_size` x `input_size`."""
    first = next((m for m in net.modules() if isinstance(m, nn.Conv2d)), None)
    if first is None:
        raise ValueError(
            "spectral_normalize needs a network with a convolution (its first one gives the input channels)"
        )
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            shapes.setdefault(name, tuple(args[0].shape[1:]))

        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in layers.items()]
    was_training = net.training
    net.eval()
    try:
        device = next(net.parameters()).device
        x = torch.zeros(1, first.in_channels, input_size, input_size, device=device)
        net(x, _alpha_for(net).to(device))
    finally:
        net.train(was_training)
        for h in handles:
            h.remove()
    missing = [name for name in layers if name not in shapes]
    if missing:
        raise ValueError(
            f"spectral_normalize: {missing} never ran in a forward of a {input_size}x{input_size} image; "
            "a layer must be used by the network to be normalised"
        )
    return shapes


def spectral_normalize(
    net: nn.Module,
    bound: float,
    iterations: int = 1,
    *,
    input_size: int = 32,
    skip: tuple[str, ...] = (),
    warmup: int = 50,
) -> nn.Module:
    """Bound the spectral norm of every `nn.Conv2d` and `nn.Linear` of `net` by `bound`, in place
    (see the module docstring); returns `net`.

    Args:
        net: a network called `net(x, alpha)`.
        bound: c, the norm bound (SNGP on CIFAR: 6).
        iterations: power-iteration steps at each training forward (SNGP: 1).
        input_size: side of the square images the network is trained on (a convolution's
            operator depends on its input's size).
        skip: names of modules (and everything under them) left alone, e.g. ("classifier",).
        warmup: power-iteration steps at the first training forward.
    """
    layers = {
        name: m
        for name, m in net.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear)) and not any(name == s or name.startswith(f"{s}.") for s in skip)
    }
    for name, m in layers.items():
        if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
            raise ValueError(
                f"spectral_normalize: {name} has padding {m.padding!r} ({m.padding_mode}); only numeric zero "
                "padding is supported"
            )
        if parametrize.is_parametrized(m, "weight"):
            raise ValueError(f"spectral_normalize: {name}.weight is parametrised already")
    shapes = _input_shapes(net, layers, input_size)
    for name, m in layers.items():
        conv = (
            dict(stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups)
            if isinstance(m, nn.Conv2d)
            else None
        )
        spec = SpectralNormBound(m.weight, bound, iterations, shapes[name], conv, warmup)
        parametrize.register_parametrization(m, "weight", spec, unsafe=True)  # unsafe: no forward (warm-up) now
    return net


def spectrally_normalized_layers(net: nn.Module) -> dict[str, nn.Module]:
    """The layers of `net` whose weight carries a `SpectralNormBound`, by name."""
    return {
        name: m
        for name, m in net.named_modules()
        if parametrize.is_parametrized(m, "weight")
        and any(isinstance(p, SpectralNormBound) for p in m.parametrizations.weight)
    }
