"""Packed-Ensembles (Laurent et al., ICLR 2023): M members side by side in the channels of one
network, kept apart by grouped convolutions.

`pack(net, alpha, gamma, size)` rebuilds a network in place: every layer gets α times its channels
and as many groups as keep the M = `size` members apart, so one forward is M independent networks
of α·c / M channels each (member-contiguous), with logits (b, M·C), member m's at columns
m·C .. (m + 1)·C − 1. The rules follow torch-uncertainty's `PackedConv2d` / `PackedLinear` and its
packed ResNet and WideResNet: the stem keeps its input channels (one group), the head
`classifier` is α·F -> M·C in M groups, every other convolution splits each member into γ
subgroups, γ lowered until every group has `min_channels_per_group` input channels and the
channels divide (here also the output channels, where theirs would raise; `WITHOUT_SUBGROUPS`
keeps γ = 1), and BatchNorm is per channel, hence per member. Layers are initialised per group
with PyTorch's defaults; no weights are copied.

Anything else with parameters, or a width the groups do not divide, is refused in one line naming
the layer. A concatenation along channels would mix members: a module with a `channel_groups`
attribute (DBSN's `Cell`) is told M and concatenates member by member. Settings and sources:
docs/field.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.nets.fused_cell import unfuse

__all__ = ["WITHOUT_SUBGROUPS", "PackedLinear", "pack"]

#: Per network class (by name), the convolutions (fnmatch patterns of module names) that the
#: authors' packed version builds without subgroups (γ = 1): ResNet's first convolution of every
#: block (torch-uncertainty `models/resnet/packed.py`, `_BasicBlock.conv1`; `dbsn.nets.ResNet18`).
WITHOUT_SUBGROUPS: dict[str, tuple[str, ...]] = {"ResNet18": ("layer*.conv1",)}


class PackedLinear(nn.Module):
    """A linear layer of `groups` independent blocks: the inputs and outputs split into `groups`
    consecutive blocks, output block g a linear map of input block g (torch-uncertainty's
    `PackedLinear`). `weight` is (out_features, in_features / groups), the blocks' weights
    stacked, each initialised as `nn.Linear` initialises a layer of in_features / groups inputs."""

    def __init__(
        self, in_features: int, out_features: int, groups: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        if in_features % groups or out_features % groups:
            raise ValueError(
                f"PackedLinear: {in_features} -> {out_features} features are not divisible by {groups} groups"
            )
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features // groups, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # fan-in: one block's inputs
        if self.bias is not None:
            bound = 1 / math.sqrt(self.weight.shape[1])
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if self.groups == 1:
            return F.linear(x, self.weight, self.bias)
        w = self.weight.view(self.groups, self.out_features // self.groups, -1)
        y = torch.einsum("...gi,goi->...go", x.unflatten(-1, (self.groups, -1)), w).flatten(-2)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}, bias={self.bias is not None}"


def pack(
    net: nn.Module,
    alpha: float,
    gamma: int,
    size: int,
    *,
    min_channels_per_group: int = 64,
    without_subgroups: Sequence[str] | None = None,
) -> nn.Module:
    """Rebuild `net` in place as a Packed-Ensemble of `size` members (see the module docstring)
    and return it; its logits become (b, size · C), member m's at columns m·C .. (m + 1)·C - 1.

    Args:
        alpha: α, the width factor (α·c must be a whole number for every channel count c).
        gamma: γ, subgroups per member in the inner convolutions.
        size: M, the number of members.
        min_channels_per_group: fewest input channels a group may have before γ is lowered
            (the authors' 64; 1 keeps γ wherever it divides).
        without_subgroups: fnmatch patterns of the convolutions that keep γ = 1; None: the
            network's entry in `WITHOUT_SUBGROUPS` (none for a network not listed).
    """
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"alpha (the width factor) must be > 0, got {alpha}")
    for name, value in (("gamma", gamma), ("size", size), ("min_channels_per_group", min_channels_per_group)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    head = getattr(net, "classifier", None)
    if type(head) is not nn.Linear:
        raise ValueError(
            f"pack needs the network's head `classifier`, an nn.Linear; {type(net).__name__} has "
            f"{type(head).__name__ if head is not None else 'none'}"
        )
    net = unfuse(net)  # the members' channel groups run through every edge's own layers
    patterns = tuple(WITHOUT_SUBGROUPS.get(type(net).__name__, ()) if without_subgroups is None else without_subgroups)
    convs = [name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    stem = convs[0] if convs else None
    rules = _Rules(alpha, size, min_channels_per_group)
    packed: dict[str, nn.Module] = {}
    for name, m in net.named_modules():
        if m is head:
            packed[name] = PackedLinear(
                rules.width(m.in_features, name),
                size * m.out_features,
                size,
                m.bias is not None,
                device=m.weight.device,
                dtype=m.weight.dtype,
            )
        elif type(m) is nn.Conv2d:
            subgroups = 1 if any(fnmatchcase(name, p) for p in patterns) else gamma
            packed[name] = rules.conv(m, name, first=name == stem, gamma=subgroups)
        elif isinstance(m, nn.BatchNorm2d):
            like = next(iter(m.buffers()), None) if m.weight is None else m.weight
            packed[name] = type(m)(
                rules.width(m.num_features, name),
                eps=m.eps,
                momentum=m.momentum,
                affine=m.affine,
                track_running_stats=m.track_running_stats,
                **({} if like is None else {"device": like.device, "dtype": like.dtype}),
            )
        elif any(True for _ in m.parameters(recurse=False)):
            raise ValueError(
                f"pack rebuilds Conv2d, BatchNorm2d and the nn.Linear classifier; {name} of "
                f"{type(net).__name__} is a {type(m).__name__}"
            )
    for name, module in packed.items():
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent), child, module)
    for m in net.modules():
        if hasattr(m, "channel_groups"):
            m.channel_groups = size
    return net


class _Rules:
    """The widths and groups of the packed layers (torch-uncertainty's `PackedConv2d`)."""

    def __init__(self, alpha: float, size: int, min_channels: int) -> None:
        self.alpha, self.size, self.min_channels = alpha, size, min_channels

    def width(self, channels: int, name: str) -> int:
        """α·c, refused unless a whole number divisible by M."""
        scaled = channels * self.alpha
        if abs(scaled - round(scaled)) > 1e-9 or round(scaled) % self.size:
            raise ValueError(
                f"pack: {name} has {channels} channels, and alpha = {self.alpha} times that ({scaled:g}) is not "
                f"a whole number divisible by the M = {self.size} members"
            )
        return round(scaled)

    def conv(self, m: nn.Conv2d, name: str, first: bool, gamma: int) -> nn.Conv2d:
        out_channels = self.width(m.out_channels, name)
        if first:
            if m.groups != 1:
                raise ValueError(f"pack: the stem {name} has {m.groups} groups; it must have one")
            in_channels, groups = m.in_channels, 1
        elif m.groups > 1 and m.groups == m.in_channels:  # depthwise: stays depthwise
            in_channels = self.width(m.in_channels, name)
            groups = in_channels
        else:
            in_channels = self.width(m.in_channels, name)
            per_member = m.groups * self.size
            while gamma > 1 and (
                in_channels % (per_member * gamma)
                or out_channels % (per_member * gamma)
                or in_channels // (per_member * gamma) < self.min_channels
            ):
                gamma -= 1
            groups = per_member * gamma
            if in_channels % groups or out_channels % groups:
                raise ValueError(
                    f"pack: {name} ({in_channels} -> {out_channels} channels at alpha = {self.alpha}) is not "
                    f"divisible by its {groups} groups (M = {self.size} members x {m.groups} groups of its own "
                    f"x gamma = {gamma})"
                )
        return nn.Conv2d(
            in_channels,
            out_channels,
            m.kernel_size,
            stride=m.stride,
            padding=m.padding,
            dilation=m.dilation,
            groups=groups,
            bias=m.bias is not None,
            padding_mode=m.padding_mode,
            device=m.weight.device,
            dtype=m.weight.dtype,
        )
