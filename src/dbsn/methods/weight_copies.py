"""16-bit copies of the convolution weights, made once per training step in a few operations.

Under mixed precision autocast casts each convolution's float32 weight to bfloat16 where it runs,
and the backward casts each weight gradient back: two small operations per convolution and step.
`WeightCopies` (`Execution.weight_copies`, off by default) makes the forward casts at the start of
the step as one concatenation and one cast, shows each convolution its view of that buffer as its
``weight`` (an instance attribute that shadows the parameter, removed when the block ends), and
casts back only the gradients that arrive. The float32 weights stay the parameters: the optimisers,
the state dict and the methods' weight decay and KL terms see only them. Applied around the
gradients of `TrainingLoop.step_body`, so a CUDA graph captures it and a compiled region takes the
copies as inputs.

The values are autocast's, so the step is the same bit for bit (tested for DBSN on the fused cell
in every convolution form, both layouts, compiled). A weight a backward does not reach keeps no
gradient, as without. One difference: a weight used twice in one backward (none here) would have
its 16-bit gradients summed before the cast. Copied (`copied_layers`): `nn.Conv2d` (type exactly)
and `dbsn.nets.conv_forms.StackedConv2d` in every form, wrapped ones included; not the Bayesian
twins, whose weight is drawn, nor parametrised layers, whose weight is computed. Each copy keeps
its weight's memory layout. What it should gain, and what a GPU must measure: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dbsn.nets.conv_forms import StackedConv2d

__all__ = ["COPIED_TYPES", "WeightCopies", "copied_layers"]

#: the layer types whose forward hands ``self.weight`` to the convolution as it is
COPIED_TYPES = (nn.Conv2d, StackedConv2d)


def copied_layers(net: nn.Module) -> list[nn.Module]:
    """The layers of `net` whose weights `WeightCopies` copies (see the module docstring): of a type
    in `COPIED_TYPES` exactly, with their parameter at ``weight``."""
    return [
        m
        for m in net.modules()
        if type(m) in COPIED_TYPES
        and isinstance(m._parameters.get("weight"), nn.Parameter)
        and "weight" not in m.__dict__
    ]


class _Copies(torch.autograd.Function):
    """The weights cast to ``dtype`` in one concatenation and one cast, as one view per weight;
    back, the gradients that arrived in one concatenation and one cast, None for a weight that got
    none (so its ``.grad`` stays as it was)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.shapes = [w.shape for w in weights]
        ctx.dtype = weights[0].dtype
        ctx.layouts = [_layout(w) for w in weights]
        flat = torch.cat([_flat(w, last) for w, last in zip(weights, ctx.layouts)]).to(dtype)
        parts = flat.split([w.numel() for w in weights])
        return tuple(_unflat(part, shape, last) for part, shape, last in zip(parts, ctx.shapes, ctx.layouts))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        arrived = [k for k, g in enumerate(grads) if g is not None and ctx.needs_input_grad[k + 1]]
        out: list[Tensor | None] = [None] * len(grads)
        if arrived:
            flat = torch.cat([_flat(grads[k], ctx.layouts[k]) for k in arrived]).to(ctx.dtype)
            for k, part in zip(arrived, flat.split([grads[k].numel() for k in arrived])):
                out[k] = _unflat(part, ctx.shapes[k], ctx.layouts[k])
        return (None, *out)


def _layout(weight: Tensor) -> bool:
    """Whether `weight` is channels-last (True) or contiguous (False); refused in one line otherwise."""
    if weight.is_contiguous():
        return False
    if weight.dim() == 4 and weight.is_contiguous(memory_format=torch.channels_last):
        return True
    raise ValueError(
        f"model.execution.weight_copies: a convolution weight of shape {tuple(weight.shape)} and strides "
        f"{weight.stride()} is neither contiguous nor channels-last; set model.execution.weight_copies=false"
    )


def _flat(t: Tensor, channels_last: bool) -> Tensor:
    """`t`'s elements in the order of its layout's memory (a view of a tensor in that layout)."""
    return (t.permute(0, 2, 3, 1) if channels_last else t).reshape(-1)


def _unflat(part: Tensor, shape: torch.Size, channels_last: bool) -> Tensor:
    """`_flat`'s inverse: a view of `part` as `shape`, in the layout."""
    if not channels_last:
        return part.view(shape)
    o, i, h, w = shape
    return part.view(o, h, w, i).permute(0, 3, 1, 2)


class WeightCopies:
    """The 16-bit copies of `net`'s convolution weights for one step (see the module docstring)."""

    def __init__(self, net: nn.Module) -> None:
        self.convs = copied_layers(net)

    @contextmanager
    def applied(self, dtype: torch.dtype) -> Iterator[int]:
        """Within the block each convolution computes with its weight cast to `dtype` in one shared
        cast made on entry; yields the number of weights copied."""
        convs = [m for m in self.convs if m.weight.dtype != dtype]
        if not convs:
            yield 0
            return
        masters = [m.weight for m in convs]
        if len({w.dtype for w in masters}) > 1:
            raise ValueError(
                "model.execution.weight_copies casts weights of one dtype; this network's convolutions "
                f"have {sorted({str(w.dtype) for w in masters})}: set model.execution.weight_copies=false"
            )
        copies = _Copies.apply(dtype, *masters)
        try:
            for conv, copy in zip(convs, copies):
                conv.__dict__["weight"] = copy
            yield len(convs)
        finally:
            for conv in convs:
                conv.__dict__.pop("weight", None)
