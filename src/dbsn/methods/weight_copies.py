"""16-bit copies of the convolution weights, made once per training step in a few operations.

Under mixed precision autocast casts each convolution's float32 weight to bfloat16 where the
convolution runs, and the backward casts each weight gradient back: two small operations per
convolution and step (in the paper network's step 449 casts each way, one per weight, since each
weight is used once by a grouped T = 4 forward; T separate forwards cast T times where autocast's
cast cache is off, as inside a CUDA-graph capture). `WeightCopies` makes all of them at the start
of the step instead, as one concatenation and one cast, and shows each convolution a view of
that buffer as its ``weight`` for the step; the backward goes through the same two operations
the other way (one concatenation of the 16-bit gradients, one cast) into the float32 weights,
which stay the parameters: the optimisers, the state dict and ``parameters()`` see only them.

The values are autocast's: the copies are the weights rounded once to the autocast dtype, the
gradients the 16-bit weight gradients of the convolutions, cast to float32 and accumulated into
the float32 ``.grad`` as before, so the step is the same bit for bit (tested).

Scope: modules of type exactly ``nn.Conv2d`` (subclasses may read their weight differently)
with NCHW-contiguous weights; every such weight should be used by the step (one that is not
gets a zero gradient instead of none, which changes weight decay's update). The copy is
installed by an instance attribute ``weight`` that shadows the parameter for attribute access
(``nn.Module`` looks parameters up only when ordinary attribute lookup fails) and is removed
when the block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["WeightCopies"]


class WeightCopies:
    """The 16-bit copies of `net`'s convolution weights for one step (see the module docstring)."""

    def __init__(self, net: nn.Module) -> None:
        self.convs = [m for m in net.modules() if type(m) is nn.Conv2d]

    @contextmanager
    def applied(self, dtype: torch.dtype) -> Iterator[int]:
        """Within the block each convolution computes with its weight cast to `dtype` in one shared
        cast made on entry; yields the number of weights copied."""
        convs = [m for m in self.convs if m.weight.dtype != dtype]
        if not convs:
            yield 0
            return
        masters = [m.weight for m in convs]
        if not all(w.is_contiguous() for w in masters):
            raise ValueError(
                "model.execution.weight_copies needs NCHW-contiguous convolution weights; "
                "set model.execution.channels_last=false"
            )
        flat = torch.cat([w.reshape(-1) for w in masters]).to(dtype)
        copies = flat.split([w.numel() for w in masters])
        try:
            for conv, copy, master in zip(convs, copies, masters):
                conv.__dict__["weight"] = copy.view(master.shape)
            yield len(convs)
        finally:
            for conv in convs:
                conv.__dict__.pop("weight", None)
