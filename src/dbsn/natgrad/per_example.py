"""Per-example gradient statistics of Linear, Conv2d and BatchNorm layers from saved tensors.

A layer's per-example gradient is a function of two tensors backpropagation already computes:
the layer input a_i and the output gradient g_i = dL_i/dz_i, which `LayerCapture` saves with
module hooks. From them: ``per_example_grads`` (one (B, *param.shape) tensor per parameter,
summed over a convolution's output positions, KFC: Grosse & Martens 2016), ``sum_squared_grads``
(the diagonal VOGN needs, Khan et al. 2018; without per-example gradients for one position per
example, Goodfellow 2015, else ``chunk_size`` examples at a time) and ``kfac_factors`` (K-FAC's
A and S, Martens & Grosse 2015, for NEK-FAC). The formulas: docs/methods.md ("Per-example
gradient statistics").

Convention: the caller backpropagates the SUM over examples of the per-example losses, so the
saved output gradient of example i is exactly g_i. With a MEAN over a batch of B the saved
gradients are g_i / B: set ``LayerCapture(..., scale=B)`` (or ``cap.scale = B``, or
``cap.output_grad(layer, scale=B)``) to convert.

BatchNorm: the capture saves the normalised input x̂ computed with the statistics the forward
used, and the per-example gradients treat x̂ as fixed (ignoring the batch statistics' dependence
on every example), as every practical VOGN does; their sum is still the exact batch gradient.
``SyncBatchNorm``'s cross-process statistics are not reproduced: x̂ uses the local batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial, wraps

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from dbsn.precision import float32, full

__all__ = [
    "LayerCapture",
    "kfac_factors",
    "per_example_grads",
    "sum_squared_grads",
]

SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d, _BatchNorm)
"""Layer types whose per-example statistics this module computes."""

_CHUNK_ELEMENTS = 2**24
"""Default memory budget of ``sum_squared_grads``: per-example gradient elements per chunk."""


def _in_float32(statistic):
    """Compute `statistic(layer, inputs, output_grads, ...)` in float32: the saved tensors of a
    mixed-precision forward are bfloat16, and autocast would run its einsums and matrix products
    in bfloat16 too (`dbsn.precision`)."""

    @wraps(statistic)
    def in_float32(layer: nn.Module, inputs: Tensor, output_grads: Tensor, *args, **kwargs):
        with float32():
            return statistic(layer, full(inputs), full(output_grads), *args, **kwargs)

    return in_float32


def _check_layer(layer: nn.Module) -> None:
    if not isinstance(layer, SUPPORTED_LAYERS):
        raise TypeError(
            f"per-example statistics support Linear, Conv2d and BatchNorm layers, got {type(layer).__name__}"
        )


class LayerCapture:
    """Saves the input and the output gradient of Linear / Conv2d (/ BatchNorm) layers.

    ``LayerCapture(model)`` hooks every ``nn.Linear`` and ``nn.Conv2d`` of ``model``;
    ``layers`` gives an explicit list instead (which may also hold BatchNorm layers with
    affine parameters). A forward hook saves each layer's input (detached; for BatchNorm the
    normalised input x̂, see the module docstring) and registers a tensor hook on its output,
    which saves the gradient w.r.t. the output when backpropagation reaches it. Tensor hooks,
    unlike full module backward hooks, allow in-place ops on the output (``ReLU(inplace=True)``)
    and still receive the gradient w.r.t. the layer's own output. Nothing is saved for a
    forward whose output does not require grad (e.g. under ``torch.no_grad()``) or while
    ``enabled`` is False, so capturing costs almost nothing when it is off.

    ``cap.input(layer)`` and ``cap.output_grad(layer)`` return the tensors of the last forward
    and backward; any backward pass through the layer (``loss.backward()`` or
    ``torch.autograd.grad``) overwrites the output gradient, a new forward clears it. A layer
    applied several times in one forward keeps only its last call (``num_calls`` counts the
    calls since the last ``clear()`` so callers can refuse that case).

    Convention: backpropagate the SUM over examples of the per-example losses, so the output
    gradients are per-example gradients; for a mean over B examples set ``scale = B``, which
    ``output_grad`` multiplies in. Use as a context manager (hooks removed on exit) or call
    ``remove()``.
    """

    def __init__(self, model: nn.Module, layers: Iterable[nn.Module] | None = None, scale: float = 1.0) -> None:
        if layers is None:
            layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        self.layers: list[nn.Module] = list(layers)
        for layer in self.layers:
            _check_layer(layer)
        self.enabled = True
        self.scale = float(scale)
        self._inputs: dict[nn.Module, Tensor] = {}
        self._grads: dict[nn.Module, Tensor] = {}
        self._calls: dict[nn.Module, int] = {}
        self._handles = [layer.register_forward_hook(self._forward_hook, with_kwargs=True) for layer in self.layers]

    def _forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        if not (self.enabled and isinstance(output, Tensor) and output.requires_grad):
            return
        x = args[0] if args else kwargs["input"]
        if isinstance(module, _BatchNorm):
            groups = args[1] if len(args) > 1 else kwargs.get("groups", 1)
            x = _normalised_input(module, x, int(groups))
        self._inputs[module] = x.detach()
        self._grads.pop(module, None)
        self._calls[module] = self._calls.get(module, 0) + 1
        output.register_hook(partial(self._save_grad, module))

    def _save_grad(self, module: nn.Module, grad: Tensor) -> None:
        if self.enabled:
            self._grads[module] = grad.detach()

    def has(self, layer: nn.Module) -> bool:
        """Whether both an input and an output gradient of ``layer`` are saved."""
        return layer in self._inputs and layer in self._grads

    def num_calls(self, layer: nn.Module) -> int:
        """Captured forward calls of ``layer`` since the last ``clear()``."""
        return self._calls.get(layer, 0)

    def input(self, layer: nn.Module) -> Tensor:
        """The saved input of the last forward (for BatchNorm: the normalised input x̂)."""
        if layer not in self._inputs:
            raise KeyError(f"no input captured for {layer}: was it called with grad enabled and capturing on?")
        return self._inputs[layer]

    def output_grad(self, layer: nn.Module, scale: float | None = None) -> Tensor:
        """The saved gradient w.r.t. the layer output, times ``scale`` (default ``self.scale``)."""
        if layer not in self._grads:
            raise KeyError(f"no output gradient captured for {layer}: did a backward pass reach it?")
        scale = self.scale if scale is None else float(scale)
        grad = self._grads[layer]
        return grad if scale == 1.0 else grad * scale

    def clear(self) -> None:
        """Drop all saved tensors (and call counts)."""
        self._inputs.clear()
        self._grads.clear()
        self._calls.clear()

    def remove(self) -> None:
        """Remove the hooks and drop the saved tensors."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _normalised_input(bn: _BatchNorm, x: Tensor, groups: int = 1) -> Tensor:
    """x̂ as computed by ``bn``'s forward (channels on dim 1; ``groups`` interleaved groups of rows)."""
    with torch.no_grad(), float32():
        x = full(x)
        if bn.training or bn.running_mean is None:
            xg = x.reshape(x.shape[0] // groups, groups * x.shape[1], *x.shape[2:])
            dims = [0, *range(2, xg.dim())]
            var, mean = torch.var_mean(xg, dim=dims, correction=0, keepdim=True)
            return ((xg - mean) * torch.rsqrt(var + bn.eps)).reshape(x.shape)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - bn.running_mean.view(shape)) * torch.rsqrt(bn.running_var.view(shape) + bn.eps)


def _conv_patches(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """Unfolded input patches (B, C_in * kh * kw, L), ordered like ``conv.weight``'s last dims."""
    padding = conv.padding
    if isinstance(padding, str) or conv.padding_mode != "zeros":  # 'same' / non-zero padding: pad first
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
        padding = 0
    return F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)


def _grouped(layer: nn.Module, inputs: Tensor, output_grads: Tensor) -> tuple[Tensor, Tensor]:
    """(a, g) of shapes (B, G, d_in, L) and (B, G, d_out, L): dL_i/dW_g = sum_l g a^T."""
    b = inputs.shape[0]
    if isinstance(layer, nn.Linear):
        a = inputs.reshape(b, -1, inputs.shape[-1]).transpose(1, 2).unsqueeze(1)
        g = output_grads.reshape(b, -1, output_grads.shape[-1]).transpose(1, 2).unsqueeze(1)
        return a, g
    if isinstance(layer, nn.Conv2d):
        groups = layer.groups
        a = _conv_patches(layer, inputs)
        a = a.reshape(b, groups, a.shape[1] // groups, a.shape[2])
        g = output_grads.reshape(b, groups, output_grads.shape[1] // groups, -1)
        return a, g
    raise TypeError(f"expected a Linear or Conv2d layer, got {type(layer).__name__}")


@_in_float32
def per_example_grads(layer: nn.Module, inputs: Tensor, output_grads: Tensor) -> list[Tensor]:
    """dL_i/dθ for each example i: [weight, bias (if any)], each (B, *param.shape).

    ``inputs``: what the layer received (Linear: (B, in) or (B, ..., in); Conv2d: (B, C, H, W);
    BatchNorm: the normalised input x̂ saved by :class:`LayerCapture`). ``output_grads``:
    dL_i/d(output), shaped like the output.
    """
    _check_layer(layer)
    b = inputs.shape[0]
    if isinstance(layer, _BatchNorm):
        if not layer.affine:
            raise ValueError("a BatchNorm layer without affine parameters has no gradients")
        g = output_grads.reshape(b, output_grads.shape[1], -1)  # (B, C, positions)
        return [(g * inputs.reshape(g.shape)).sum(-1), g.sum(-1)]
    a, g = _grouped(layer, inputs, output_grads)
    grads = [torch.einsum("bgol,bgil->bgoi", g, a).reshape(b, *layer.weight.shape)]
    if layer.bias is not None:
        grads.append(g.sum(-1).reshape(b, -1))
    return grads


@_in_float32
def sum_squared_grads(
    layer: nn.Module, inputs: Tensor, output_grads: Tensor, chunk_size: int | None = None
) -> list[Tensor]:
    """sum_i (dL_i/dθ)^2 elementwise: [weight, bias (if any)], each shaped like the parameter.

    With one position per example (Linear on (B, in), a conv with a 1x1 output) it is
    (g^2)^T (a^2) per group, from the (B, d) tensors only. Otherwise per-example gradients are
    formed for ``chunk_size`` examples at a time (default: as many as keep about 2^24 elements,
    i.e. chunk_size * weight.numel() <= 2^24) and reduced at once, so the extra memory is
    O(chunk_size * P) rather than O(B * P). BatchNorm's per-example gradients are (B, C), so
    they are formed outright.
    """
    _check_layer(layer)
    if isinstance(layer, _BatchNorm):
        return [grad.square().sum(0) for grad in per_example_grads(layer, inputs, output_grads)]
    a, g = _grouped(layer, inputs, output_grads)
    if a.shape[-1] == 1:
        a2, g2 = a[..., 0].square(), g[..., 0].square()
        sums = [torch.einsum("bgo,bgi->goi", g2, a2).reshape(layer.weight.shape)]
        if layer.bias is not None:
            sums.append(g2.sum(0).reshape(-1))
        return sums
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // layer.weight.numel())
    sums = None
    for start in range(0, inputs.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        squares = [grad.square().sum(0) for grad in per_example_grads(layer, inputs[chunk], output_grads[chunk])]
        sums = squares if sums is None else [s + q for s, q in zip(sums, squares)]
    return sums


@_in_float32
def kfac_factors(layer: nn.Module, inputs: Tensor, output_grads: Tensor) -> tuple[Tensor, Tensor]:
    """Kronecker factors (A, S) of a Linear or Conv2d layer, bias folded into A.

    Let ā_{i,t} be the input at position t of example i (Linear: the row of a (B, ..., in)
    input, T = prod(...) positions; Conv2d: the unfolded input patch of output pixel t,
    T = H'W') with a 1 appended when the layer has a bias (homogeneous coordinate: W̄ = [W b]),
    and g_{i,t} the per-example output gradient there. Both factors are plain means over the
    B * T (example, position) pairs:

        A = 1/(B T) sum_i sum_t ā_{i,t} ā_{i,t}^T,    S = 1/(B T) sum_i sum_t g_{i,t} g_{i,t}^T.

    With W̄ flattened row-major (out, in + 1), KFC's approximation of the per-example Fisher
    E_i[vec(dL_i/dW̄) vec(dL_i/dW̄)^T] is T * (S ⊗ A) (Grosse & Martens 2016: Ω = T A sums over
    positions, Γ = S averages over them; spatially uncorrelated derivatives). For T = 1
    (a Linear layer on (B, in)) it is K-FAC's S ⊗ A. The factor T does not change
    eigenvectors. A grouped conv (``groups = G > 1``) is block diagonal over groups: the
    factors then carry a leading group dimension, A (G, d_in + 1, d_in + 1) with
    d_in = C_in/G * kh * kw and S (G, C_out/G, C_out/G).
    """
    _check_layer(layer)
    a, g = _grouped(layer, inputs, output_grads)  # (B, G, d, T)
    if layer.bias is not None:
        a = torch.cat([a, a.new_ones(a.shape[0], a.shape[1], 1, a.shape[3])], dim=2)
    a = a.permute(1, 0, 3, 2).reshape(a.shape[1], -1, a.shape[2])  # (G, B*T, d_in (+1))
    g = g.permute(1, 0, 3, 2).reshape(g.shape[1], -1, g.shape[2])  # (G, B*T, d_out)
    factor_a = a.transpose(1, 2) @ a / a.shape[1]
    factor_s = g.transpose(1, 2) @ g / g.shape[1]
    if factor_a.shape[0] == 1:
        return factor_a[0], factor_s[0]
    return factor_a, factor_s
