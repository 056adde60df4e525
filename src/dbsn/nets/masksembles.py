"""Masksembles (Durasov, Bagautdinov, Baque & Fua, CVPR 2021): M members that are M fixed binary
masks on the channels of one network.

Member m multiplies the input channels of every masked layer by its own 0/1 mask, drawn once when
the network is built (a buffer: checkpoints keep it), so the M members are M fixed subnetworks
with shared weights. A batch holds the members' rows *interleaved*: row r belongs to member
r mod M (the authors cut it into M consecutive blocks; only the row order differs).

The masks follow the authors' code (nikitadurasov/masksembles `common.py`, as torch-uncertainty):
`draw_masks` (their `generate_masks_`), `generate_masks` (redrawn until the union keeps its
expected size) and `masks_for_channels` (their `generation_wrapper`), whose bisection for the
scale that makes the union exactly c channels uses torch-uncertainty's bounds, since the
authors' hold no solution for some small layers. The scale s sets the overlap: two masks'
intersection over union is about 1/(2s − 1) (s = 1: the plain network M times). Refused, as
theirs: fewer than 10 channels, a scale above 6 or below 1.

`masksembles(net, M, scale)` masks the input of every `nn.Conv2d` but the stem and of the head,
in place, as torch-uncertainty's masked ResNet and WideResNet; BatchNorm stays shared. Formulas
and sources: docs/field.md ("Settings and their sources").
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.nets.batch_ensemble import swap_layers

__all__ = [
    "MaskedConv2d",
    "MaskedLinear",
    "draw_masks",
    "generate_masks",
    "masked_layers",
    "masks_for_channels",
    "mask_overlap",
    "masksembles",
    "union_size",
]

#: The authors' limits: fewest channels a layer may have, largest scale.
MIN_CHANNELS, MAX_SCALE = 10, 6.0
#: Redraws `generate_masks` makes before it gives up (the authors' loop has no bound).
MAX_DRAWS = 10_000


def union_size(m: int, n: int, s: float) -> int:
    """⌊m·s·(1 − (1 − 1/s)ⁿ)⌋: the positions n masks of m ones among ⌊m·s⌋ keep, the authors'
    expected size of their union."""
    return int(m * s * (1 - (1 - 1 / s) ** n))


def draw_masks(m: int, n: int, s: float, generator: torch.Generator | None = None) -> Tensor:
    """n masks, each with m ones at positions drawn uniformly without replacement from ⌊m·s⌋, and
    the positions no mask uses dropped: (n, positions used), float 0/1 (the authors'
    `generate_masks_`)."""
    positions = int(m * s)
    if positions < m:
        raise ValueError(f"masks of {m} ones need at least {m} positions; scale {s} gives {positions}")
    masks = torch.zeros(n, positions)
    for row in masks:
        row[torch.randperm(positions, generator=generator)[:m]] = 1.0
    return masks[:, masks.any(0)]


def generate_masks(m: int, n: int, s: float, generator: torch.Generator | None = None) -> Tensor:
    """`draw_masks(m, n, s)` drawn again until it keeps exactly `union_size(m, n, s)` positions
    (the authors' `generate_masks`; refused after `MAX_DRAWS` draws, which their loop is not)."""
    expected = union_size(m, n, s)
    for _ in range(MAX_DRAWS):
        masks = draw_masks(m, n, s, generator)
        if masks.shape[1] == expected:
            return masks
    raise ValueError(
        f"no {n} masks of {m} ones among {int(m * s)} positions kept {expected} of them in {MAX_DRAWS} "
        "draws: change the scale"
    )


def masks_for_channels(channels: int, n: int, scale: float, generator: torch.Generator | None = None) -> Tensor:
    """n masks over exactly `channels` channels, each with ⌊c / (scale·(1 − (1 − 1/scale)ⁿ))⌋ ones
    (the authors' `generation_wrapper`, see the module docstring): (n, channels), float 0/1."""
    if channels < MIN_CHANNELS:
        raise ValueError(
            f"Masksembles needs at least {MIN_CHANNELS} channels in a masked layer (the authors' limit); got {channels}"
        )
    if not 1 <= scale <= MAX_SCALE:
        raise ValueError(f"the masks' scale must be in [1, {MAX_SCALE:g}] (the authors' bounds), got {scale}")
    ones = int(channels / (scale * (1 - (1 - 1 / scale) ** n)))
    low, high = max(0.2 * scale, 1.0), 4 * scale
    for _ in range(1000):  # the authors' bisection, on the union's size (a non-decreasing function of s)
        s = (low + high) / 2
        size = union_size(ones, n, s)
        if size == channels:
            return generate_masks(ones, n, s, generator)
        low, high = (low, s) if size > channels else (s, high)
    raise ValueError(f"no scale near {scale} gives {n} masks of {ones} ones over {channels} channels: change the scale")


class _MaskedLayer(nn.Module):
    """A layer (`layer`) whose input channels are multiplied, row r, by mask r mod M of `masks`
    (M, C), a buffer."""

    channels_first: bool

    def __init__(self, layer: nn.Module, masks: Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("masks", masks)

    @property
    def size(self) -> int:
        return self.masks.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] % self.size:
            raise ValueError(
                f"a masked layer of M = {self.size} members needs a batch of whole member groups (rows "
                f"interleaved, row r = member r mod M); got {x.shape[0]} rows"
            )
        rows = self.masks.to(x.dtype).repeat(x.shape[0] // self.size, 1)  # (b·M, C)
        ones = (1,) * (x.dim() - 2)
        mask = rows.view(*rows.shape, *ones) if self.channels_first else rows.view(rows.shape[0], *ones, -1)
        return self.layer(x * mask)


class MaskedConv2d(_MaskedLayer):
    """`nn.Conv2d` on its input with each member's channels masked (torch-uncertainty's
    `MaskedConv2d`, rows interleaved)."""

    channels_first = True


class MaskedLinear(_MaskedLayer):
    """`nn.Linear` on its input with each member's features masked (torch-uncertainty's
    `MaskedLinear`, rows interleaved)."""

    channels_first = False  # (b, ..., C)


def masksembles(net: nn.Module, size: int, scale: float = 2.0, generator: torch.Generator | None = None) -> nn.Module:
    """Make `net` a Masksembles of `size` members in place: every `nn.Conv2d` but the first (the
    stem) becomes a `MaskedConv2d`, every `nn.Linear` a `MaskedLinear`, each with masks of its
    input channels from `masks_for_channels(channels, size, scale)`. Returns `net`, which then takes
    batches of whole member groups (row r = member r mod `size`)."""
    if size < 1:
        raise ValueError(f"size (M, the number of members) must be >= 1, got {size}")
    names = {id(m): name for name, m in net.named_modules()}
    stem = next((m for m in net.modules() if isinstance(m, nn.Conv2d)), None)

    def masks(layer: nn.Module, channels: int) -> Tensor:
        try:
            found = masks_for_channels(channels, size, scale, generator)
        except ValueError as err:
            raise ValueError(f"masksembles: {names[id(layer)]} of {type(net).__name__}: {err}") from None
        return found.to(device=layer.weight.device, dtype=layer.weight.dtype)

    return swap_layers(
        net,
        lambda conv: conv if conv is stem else MaskedConv2d(conv, masks(conv, conv.in_channels)),
        lambda linear: MaskedLinear(linear, masks(linear, linear.in_features)),
    )


def masked_layers(net: nn.Module) -> list[_MaskedLayer]:
    """The masked layers of `net`, in the order of `net.modules()`."""
    return [m for m in net.modules() if isinstance(m, _MaskedLayer)]


def mask_overlap(masks: Tensor) -> float:
    """The mean intersection over union of the pairs of masks (M, C) (1 for a single mask)."""
    if masks.shape[0] < 2:
        return 1.0
    a, b = torch.triu_indices(masks.shape[0], masks.shape[0], offset=1)
    both = (masks[a] * masks[b]).sum(-1)
    either = ((masks[a] + masks[b]) > 0).float().sum(-1)
    return (both / either).mean().item()
