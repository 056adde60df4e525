"""Candidate operations of the DBSN search space, and the group-aware Sequential.

Every operation maps a node of ``C`` channels to ``C`` channels and ends in the
same non-affine BatchNorm, so the structure weight alpha_k is the only scale on
its output (paper, Appendix B: "BN-ReLU-Conv-BN, first BN affine, second not").

Batches here hold G groups of examples, one per structure sample, *interleaved*
along dim 0: row r belongs to group r mod G (so ``x.repeat_interleave(G, 0)``
puts every example under every structure). In training mode every BatchNorm
normalises each group with its own statistics, so one grouped forward equals G
separate forwards -- what the research code got from one DataParallel replica
per structure. Modules therefore take ``forward(x, groups)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dbsn.nets.batchnorm import GroupBatchNorm2d


def memory_format(t: Tensor) -> torch.memory_format:
    """``torch.channels_last`` for a 4-D tensor laid out that way, else ``torch.contiguous_format``
    (the networks keep their input's layout: see `StructureNet` on channels-last)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def expand_groups(t: Tensor, groups: int) -> Tensor:
    """Rows shared by all groups -> the interleaved grouped layout (row i*G + g = row i), in
    t's memory layout."""
    return t.repeat_interleave(groups, dim=0).contiguous(memory_format=memory_format(t))


class GroupedSequential(nn.Sequential):
    """``nn.Sequential`` that passes ``groups`` on to the children that take it."""

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:  # type: ignore[override]
        for module in self:
            x = module(x, groups) if isinstance(module, _GROUP_AWARE) else module(x)
        return x


class Zero(nn.Module):
    """The ``zero`` operation: no connection. Cells skip it instead of adding zeros."""

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:
        return torch.zeros_like(x)


_GROUP_AWARE = (GroupBatchNorm2d, GroupedSequential, Zero)


def _dw_pw(channels: int, dilation: int = 1) -> list[nn.Module]:
    """Depthwise 3x3 (optionally dilated, same padding) then pointwise 1x1, no bias."""
    return [
        nn.Conv2d(channels, channels, 3, padding=dilation, dilation=dilation, groups=channels, bias=False),
        nn.Conv2d(channels, channels, 1, bias=False),
    ]


def identity(channels: int) -> nn.Module:
    """Identity as in the research code: a non-affine BatchNorm of the input."""
    return GroupBatchNorm2d(channels, affine=False)


def sep_conv_3x3(channels: int) -> nn.Module:
    """BN-ReLU-SepConv3x3 twice, ending in a non-affine BN."""
    return GroupedSequential(
        GroupBatchNorm2d(channels),
        nn.ReLU(),
        *_dw_pw(channels),
        GroupBatchNorm2d(channels),
        nn.ReLU(),
        *_dw_pw(channels),
        GroupBatchNorm2d(channels, affine=False),
    )


def dil_conv_3x3(channels: int) -> nn.Module:
    """BN-ReLU-dilated (2) SepConv3x3, ending in a non-affine BN."""
    return GroupedSequential(
        GroupBatchNorm2d(channels),
        nn.ReLU(),
        *_dw_pw(channels, dilation=2),
        GroupBatchNorm2d(channels, affine=False),
    )


# The search space: op name -> constructor (channels) -> module. A config's op
# list picks from these; its order defines the index k in alpha[..., k].
OPS: dict[str, Callable[[int], nn.Module]] = {
    "zero": lambda channels: Zero(),
    "identity": identity,
    "sep_conv_3x3": sep_conv_3x3,
    "dil_conv_3x3": dil_conv_3x3,
}


def research_init_(module: nn.Module) -> None:
    """The research code's initialisation, in place: He (fan-out) normal for every convolution
    (transposed ones too) with zero bias, BatchNorm to identity, zero Linear bias (Linear
    weights keep PyTorch's default). A convolution that stacks the convolutions of several
    edges (`dbsn.nets.fused_cell`, ``stacked_edges``) gets each edge's own fan-out."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // getattr(m, "stacked_edges", 1)
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d) and m.affine:
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
