"""The fused cell's convolutions in forms a compiler can fuse: the same function as `F.conv2d`,
summed in another order.

`dbsn.nets.fused_cell` stacks the convolutions of a node's n out-edges into one layer each: a
depthwise 3×3 (dilation 1 or 2) with n·C groups and a 1×1 with n groups. `F.conv2d` (``"conv"``,
the default) runs them through the convolution library, several kernels per grouped convolution,
which a compiler calls as they are. The same arithmetic as tensor operations, which it fuses:
``conv_1x1="bmm"``, the 1×1 as a batched matmul W_g X_bg per (example, group); ``"mulsum"``, a
multiply and a sum over the C_in input channels; ``depthwise="stencil"``, the 3×3 as 9 shifted
multiply-adds on the zero-padded input (padding = dilation).

Under autocast the forms take their operands in autocast's dtype, as `F.conv2d` does, accumulate
in float32 at least and keep the input's memory layout; each equals `F.conv2d` in float64 to
round-off, outputs and every gradient (tests/nets/test_conv_forms.py). Which is fastest is the
bench's to say (docs/performance.md). `StackedConv2d` is the fused cell's `nn.Conv2d` with a
``form`` its forward dispatches on (the weight keeps its state-dict key, so checkpoints and
`unfuse` do not see the form); `set_conv_forms` is the one way to set the forms, and checks that
each layer can take its own. A Bayesian twin (`dbsn.bayes.BayesConv2d`) keeps its layer's form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.nets.ops import memory_format

__all__ = [
    "AUTO_FORMS",
    "CONV_1X1_FORMS",
    "DEPTHWISE_FORMS",
    "StackedConv2d",
    "convolve",
    "depthwise_stencil",
    "grouped_1x1",
    "resolved_form",
    "set_conv_forms",
]

#: the forms of a grouped 1×1 convolution and of a depthwise 3×3 ("conv": `F.conv2d`)
CONV_1X1_FORMS = ("conv", "bmm", "mulsum", "auto")
DEPTHWISE_FORMS = ("conv", "stencil", "auto")
#: "auto": the form measured fastest where the layer runs, by (kind, device type); any other pair
#: computes with F.conv2d. On an H200 the paper's bf16 graphed step took 164.7 ms with the 1×1s as
#: a batched matmul against 192.6 ms with cuDNN's grouped convolutions, and the depthwise stencil
#: was slower than the native kernel eagerly (docs/performance.md, the GPU window).
AUTO_FORMS = {("1x1", "cuda"): "bmm"}


def grouped_1x1(x: Tensor, weight: Tensor, groups: int, form: str = "bmm") -> Tensor:
    """``F.conv2d(x, weight, groups=groups)`` for a 1×1 ``weight`` (groups·C_out, C_in, 1, 1), as a
    batched matmul (``form="bmm"``) or a multiply and a sum over C_in (``"mulsum"``); the output in
    ``x``'s layout."""
    b, width, h, w = x.shape
    n, c_in, c_out = groups, width // groups, weight.shape[0] // groups
    matrices, dtype = weight.reshape(n, c_out, c_in), x.dtype
    if form == "mulsum":  # products and sums in float32 at least, as a convolution accumulates
        x, matrices = x.to(_accumulation(x)), matrices.to(_accumulation(x))
    if memory_format(x) == torch.channels_last:
        # (b, H, W, n, C_in) in memory: a view as n batches of (b·H·W, C_in) rows, no copy of the input
        rows = x.permute(0, 2, 3, 1).reshape(b * h * w, n, c_in)
        if form == "bmm":
            out = torch.bmm(rows.transpose(0, 1), matrices.transpose(1, 2)).transpose(0, 1)  # (b·H·W, n, C_out)
        else:
            out = (rows.view(b * h * w, n, 1, c_in) * matrices).sum(-1)
        return out.to(dtype).reshape(b, h, w, n * c_out).permute(0, 3, 1, 2)
    if form == "bmm":
        return torch.matmul(matrices, x.reshape(b, n, c_in, h * w)).view(b, n * c_out, h, w)
    out = (x.reshape(b, n, 1, c_in, h, w) * matrices.view(1, n, c_out, c_in, 1, 1)).sum(3)
    return out.to(dtype).view(b, n * c_out, h, w)


def depthwise_stencil(x: Tensor, weight: Tensor, dilation: int = 1) -> Tensor:
    """``F.conv2d(x, weight, padding=dilation, dilation=dilation, groups=C)`` for a depthwise 3×3
    ``weight`` (C, 1, 3, 3), as 9 shifted multiply-adds on the zero-padded input; the output in
    ``x``'s layout."""
    d = dilation
    _, c, h, w = x.shape
    accumulation = _accumulation(x)  # products and sums in float32 at least, as a convolution accumulates
    padded = F.pad(x.to(accumulation), (d, d, d, d))
    taps = weight.to(accumulation).reshape(c, 9).unbind(1)
    out = None
    for k, tap in enumerate(taps):
        i, j = divmod(k, 3)
        shifted = padded[:, :, i * d : i * d + h, j * d : j * d + w]
        tap = tap.view(1, c, 1, 1)
        out = shifted * tap if out is None else torch.addcmul(out, shifted, tap)
    return out.to(x.dtype).contiguous(memory_format=memory_format(x))


def _accumulation(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _kind(conv: nn.Module) -> str | None:
    """ "1x1" for a (grouped) 1×1 convolution, "depthwise" for a depthwise 3×3 with 'same' padding,
    None for any other (neither has a form other than `F.conv2d`)."""
    stride, padding, dilation = (tuple(getattr(conv, key)) for key in ("stride", "padding", "dilation"))
    if stride != (1, 1):
        return None
    if tuple(conv.kernel_size) == (1, 1) and padding == (0, 0):
        return "1x1"
    if (
        tuple(conv.kernel_size) == (3, 3)
        and conv.groups == conv.in_channels == conv.out_channels
        and padding == dilation
        and dilation[0] == dilation[1]
    ):
        return "depthwise"
    return None


def resolved_form(conv: nn.Module, device_type: str) -> str:
    """``conv.form``, with "auto" resolved for a layer running on `device_type` (`AUTO_FORMS`)."""
    form = conv.form
    return AUTO_FORMS.get((_kind(conv), device_type), "conv") if form == "auto" else form


def convolve(conv: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``conv``'s convolution of ``x`` with ``weight`` and ``bias`` in ``conv.form`` (a layer with
    the attributes of an `nn.Conv2d`: zero padding)."""
    form = resolved_form(conv, x.device.type)
    if form == "conv":
        return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    if torch.is_autocast_enabled(x.device.type):  # the operands' dtype that autocast gives F.conv2d
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    out = (
        grouped_1x1(x, weight, conv.groups, form)
        if form in ("bmm", "mulsum")
        else depthwise_stencil(x, weight, conv.dilation[0])
    )
    return out if bias is None else out + bias.view(1, -1, 1, 1)


class StackedConv2d(nn.Conv2d):
    """The convolutions of n edges as one `nn.Conv2d` (``stacked_edges`` = n, which the
    initialisation reads), computed in ``form`` (see the module docstring; "conv" by default).
    ``form_convolve`` is the function that computes a form: a layer that replaces this one (a
    Bayesian twin, `dbsn.bayes.layers.BayesConv2d`) takes it over with ``form``, so that the layers
    below the networks need not import them."""

    form_convolve = staticmethod(convolve)

    def __init__(self, *args, stacked_edges: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        if self.padding_mode != "zeros":
            raise ValueError(f"a stacked convolution pads with zeros, not {self.padding_mode!r}")
        self.stacked_edges = stacked_edges
        self.form = "conv"

    def forward(self, x: Tensor) -> Tensor:
        return convolve(self, x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", stacked_edges={self.stacked_edges}, form={self.form}"


def set_conv_forms(net: nn.Module, conv_1x1: str = "conv", depthwise: str = "conv") -> int:
    """Set the form of every stacked convolution of `net` (the fused cells' layers with
    ``stacked_edges``; a layer that replaced one, e.g. a Bayesian twin, keeps the attributes):
    the 1×1s to `conv_1x1`, the depthwise 3×3s to `depthwise`. Returns how many were set.

    A form other than "conv" is refused in one line where `net` has no stacked convolutions (the
    per-edge cell, a backbone) or where one of them cannot take it (a layer without ``form``),
    rather than recorded and ignored."""
    if conv_1x1 not in CONV_1X1_FORMS:
        raise ValueError(f"model.execution.conv_1x1 must be one of {list(CONV_1X1_FORMS)}, got {conv_1x1!r}")
    if depthwise not in DEPTHWISE_FORMS:
        raise ValueError(f"model.execution.depthwise must be one of {list(DEPTHWISE_FORMS)}, got {depthwise!r}")
    stacked = [m for m in net.modules() if hasattr(m, "stacked_edges") and _kind(m) is not None]
    settings = {"conv_1x1": conv_1x1, "depthwise": depthwise}
    asked = ", ".join(
        f"model.execution.{key}={value}" for key, value in settings.items() if value not in ("conv", "auto")
    )
    if not asked:  # conv, or auto: the fastest form wherever there is a layer that takes one, nothing elsewhere
        for m in stacked:
            if hasattr(m, "form"):
                m.form = conv_1x1 if _kind(m) == "1x1" else depthwise
        return sum(hasattr(m, "form") for m in stacked)
    if not stacked:
        raise ValueError(
            f"{asked}: {type(net).__name__} has no stacked convolutions of a fused cell (model.net.cell="
            "fused on DBSN's cell network) for it to apply to; leave it at conv"
        )
    fixed = sorted({type(m).__name__ for m in stacked if not hasattr(m, "form")})
    if fixed:
        raise ValueError(
            f"{asked}: the fused cell's convolutions here are {', '.join(fixed)} layers, which compute "
            "with F.conv2d only; leave it at conv"
        )
    for m in stacked:
        m.form = conv_1x1 if _kind(m) == "1x1" else depthwise
    return len(stacked)
