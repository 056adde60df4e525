"""Per-group BatchNorm, and BatchNorm statistics that belong to one structure each.

Batches here hold G groups of examples, one per structure, *interleaved* along dim 0: row r
belongs to group r mod G. `GroupBatchNorm2d` normalises each group with its own statistics in
training, so one grouped forward equals G separate forwards. Three tools build on it:

- `accumulated_running_statistics(net)`: a training step whose T structures run in several
  chunks (to save memory) moves the running statistics once, towards the mean over all T
  structures, exactly as the grouped step over all T does;
- `structure_statistics(forward, net, batches, G)`: the BatchNorm statistics of each of the G
  structures that `forward` runs `net` under, on the given batches (mean and unbiased variance, averaged over batches as
  `momentum=None` does), from grouped forwards;
- `using_statistics(net, statistics)`: prediction where group g is normalised with the
  statistics of its own structure instead of the shared running statistics.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.precision import float32, full

#: BatchNorm statistics of G structures per module: {module name: (mean, unbiased variance)},
#: each (G, C).
Statistics = dict[str, tuple[Tensor, Tensor]]


class GroupBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics are computed per group.

    ``forward(x, groups)`` with ``x`` of shape (b*G, C, H, W): in training mode
    (or without running statistics) group g = rows g, g+G, g+2G, ... is normalised
    with its own mean and biased variance over (b, H, W). The running statistics
    move towards the average over groups of each group's mean and unbiased
    variance, which is the average of what G separate ``nn.BatchNorm2d`` copies
    would hold after one step each. With ``groups == 1`` or in eval mode it is
    exactly ``nn.BatchNorm2d`` -- unless the tools of this module have set
    ``statistics`` (per-group statistics for prediction), ``collected`` (record each
    group's batch statistics) or ``pending`` (accumulate the running-statistics update).

    Layout. An NCHW-contiguous batch is viewed as (b, G*C, H, W), which puts group g's
    channels at g*C..(g+1)*C, so one fused ``F.batch_norm`` call computes per-group
    statistics. A channels-last batch has no such view (its channels are innermost, the
    groups outermost); it is normalised from per-group moments over a (b, G, C, H, W) view
    instead (`_moments`, `_scale_shift`): the same function, in float32, without a copy
    of the input's layout.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.statistics: tuple[Tensor, Tensor] | None = None
        self.collected: list[tuple[Tensor, Tensor]] | None = None
        # [Σ group means, Σ group unbiased variances, number of groups (a tensor, so that a
        # compiled forward does not specialise on it)]
        self.pending: list[Tensor] | None = None

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:  # type: ignore[override]
        if self.statistics is not None:
            return self._normalise(x, groups, *self.statistics)
        if self.collected is not None or (self.pending is not None and self.training):
            y, mean, var = self._batch_statistics(x, groups)
            if self.collected is not None:
                self.collected.append((mean, var))
            else:
                self.pending[0].add_(mean.sum(0))
                self.pending[1].add_(var.sum(0))
                self.pending[2].add_(mean.shape[0])
            return y
        uses_batch_stats = self.training or self.running_mean is None
        if groups == 1 or not uses_batch_stats:
            return super().forward(x)
        update = self.training and self.track_running_stats
        if _channels_last(x):
            y, mean, var = self._batch_statistics(x, groups)
            if update:
                with torch.no_grad():
                    factor = self._next_factor()
                    self.running_mean.mul_(1 - factor).add_(mean.mean(0), alpha=factor)
                    self.running_var.mul_(1 - factor).add_(var.mean(0), alpha=factor)
            return y

        # With interleaved groups, (b*G, C, H, W) viewed as (b, G*C, H, W) is free and
        # puts group g's channels at g*C..(g+1)*C: one fused batch_norm call computes
        # per-group statistics, with no copy.
        n, c, h, w = x.shape
        xt = x.reshape(n // groups, groups * c, h, w)  # a view unless x is a channel slice
        running_mean = self.running_mean.repeat(groups) if update else None
        running_var = self.running_var.repeat(groups) if update else None
        factor = self._next_factor() if update else 0.0
        y = F.batch_norm(
            xt, running_mean, running_var, *self._affine(groups), True, factor, self.eps,
        )
        if update:  # each copy moved by factor towards its group's stats; keep their mean
            with torch.no_grad():
                self.running_mean.copy_(running_mean.view(groups, c).mean(0))
                self.running_var.copy_(running_var.view(groups, c).mean(0))
        return y.view(n, c, h, w)

    def _affine(self, groups: int) -> tuple[Tensor | None, Tensor | None]:
        if not self.affine:
            return None, None
        return self.weight.repeat(groups), self.bias.repeat(groups)

    def _next_factor(self) -> float:
        """Count one more batch and return the running statistics' update factor."""
        self.num_batches_tracked.add_(1)
        # momentum=None: cumulative moving average, as in nn.BatchNorm2d.
        return self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)

    def _batch_statistics(self, x: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
        """Normalise each group with its batch statistics; return the output and each group's
        mean and unbiased variance, (G, C), in float32."""
        n, c, h, w = x.shape
        if _channels_last(x):
            mean, var = _moments(x, groups)
            count = (n // groups) * h * w
            y = self._scale_shift(x, groups, mean, var)
            unbiased = var * (count / max(count - 1, 1))
            return y, mean.detach(), unbiased.detach()
        mean = x.new_zeros(groups * c, dtype=torch.float32)
        var = x.new_ones(groups * c, dtype=torch.float32)
        # momentum 1: the "running" buffers become this batch's statistics
        y = F.batch_norm(x.reshape(n // groups, groups * c, h, w), mean, var, *self._affine(groups), True, 1.0, self.eps)
        return y.view(n, c, h, w), mean.view(groups, c).detach(), var.view(groups, c).detach()

    def _normalise(self, x: Tensor, groups: int, mean: Tensor, var: Tensor) -> Tensor:
        """Group g normalised with (mean[g], var[g])."""
        n, c, h, w = x.shape
        if groups == 1 and mean.shape[0] > 1:
            # rows shared by every structure (the prefix that runs before the groups split):
            # their statistics were recorded from shared rows too, so every row holds the same
            mean, var = mean[:1], var[:1]
        if mean.shape[0] != groups:
            raise ValueError(f"statistics of {mean.shape[0]} structures for a batch of {groups} groups")
        if _channels_last(x):
            return self._scale_shift(x, groups, mean, var)
        y = F.batch_norm(x.reshape(n // groups, groups * c, h, w), mean.reshape(-1), var.reshape(-1),
                         *self._affine(groups), False, 0.0, self.eps)
        return y.view(n, c, h, w)

    def _scale_shift(self, x: Tensor, groups: int, mean: Tensor, var: Tensor) -> Tensor:
        """(x - mean[g]) / sqrt(var[g] + eps) * weight + bias for group g, in float32, from a
        (b, G, C, H, W) view of x (any layout); returned in x's dtype and layout."""
        n, c, h, w = x.shape
        with float32():
            scale = torch.rsqrt(var.float() + self.eps)  # (G, C)
            if self.affine:
                scale = scale * self.weight
            shift = -mean.float() * scale
            if self.affine:
                shift = shift + self.bias
            y = full(x.view(n // groups, groups, c, h, w)) * scale[:, :, None, None] + shift[:, :, None, None]
        return y.to(x.dtype).view(n, c, h, w)


def _channels_last(x: Tensor) -> bool:
    """Whether x is a channels-last batch (and not also NCHW-contiguous, as 1x1 maps can be)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _moments(x: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Each group's mean and biased variance over (b, H, W), (G, C), in float32; x is
    (b*G, C, H, W) in any layout (a (b, G, C, H, W) view splits only dimension 0)."""
    n, c, h, w = x.shape
    with float32():
        var, mean = torch.var_mean(full(x.view(n // groups, groups, c, h, w)), dim=(0, 3, 4), correction=0)
    return mean, var


def _group_norms(net: nn.Module) -> list[tuple[str, GroupBatchNorm2d]]:
    return [(name, m) for name, m in net.named_modules() if isinstance(m, GroupBatchNorm2d)]


@contextmanager
def accumulated_running_statistics(net: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, training forwards add their per-group batch statistics up instead of
    moving the running statistics; on exit the running statistics move once, by the usual
    factor, towards the mean over all the groups seen. T structures run in chunks then leave
    the running statistics exactly where one grouped forward over all T leaves them."""
    norms = [m for _, m in _group_norms(net) if m.track_running_stats] if enabled else []
    for m in norms:
        m.pending = [torch.zeros_like(m.running_mean), torch.zeros_like(m.running_var),
                     torch.zeros((), dtype=torch.long, device=m.running_mean.device)]
    try:
        yield
    finally:
        for m in norms:
            (mean_sum, var_sum, count), m.pending = m.pending, None
            with torch.no_grad():  # on the device, without reading `count` back: no sync per module
                seen = count > 0  # modules the forwards did not reach keep their statistics
                m.num_batches_tracked.add_(seen.long())
                if m.momentum is not None:
                    factor: Tensor | float = m.momentum
                else:  # cumulative moving average, as in nn.BatchNorm2d
                    factor = 1.0 / m.num_batches_tracked.clamp_min(1).to(m.running_mean.dtype)
                groups = count.clamp_min(1).to(mean_sum.dtype)
                for running, total in ((m.running_mean, mean_sum), (m.running_var, var_sum)):
                    moved = running * (1 - factor) + total / groups * factor
                    running.copy_(torch.where(seen, moved, running))


@torch.no_grad()
def structure_statistics(forward, net: nn.Module, batches: Iterable[Tensor], num_structures: int) -> Statistics:
    """BatchNorm statistics of each structure of one grouped forward.

    ``forward(x)`` runs ``net`` on a batch under G structures (e.g. ``net(x, alpha,
    replicate=True)``); every `GroupBatchNorm2d` normalises each group with its batch
    statistics, as in training, and records them. The result holds, per module, the mean over
    batches of each group's batch mean and unbiased variance (what ``nn.BatchNorm2d`` with
    ``momentum=None`` accumulates over those batches for that structure alone), (G, C) with G =
    `num_structures`; modules that run before the groups split (on rows shared by every
    structure) give G equal rows. Running statistics are left untouched.
    """
    norms = _group_norms(net)
    for _, m in norms:
        m.collected = []
    try:
        for x in batches:
            forward(x)
        return {name: tuple(torch.stack(parts).mean(0).expand(num_structures, -1).contiguous()
                            for parts in zip(*m.collected))
                for name, m in norms if m.collected}
    finally:
        for _, m in norms:
            m.collected = None


@contextmanager
def using_statistics(net: nn.Module, statistics: Statistics) -> Iterator[None]:
    """Within the block, every `GroupBatchNorm2d` named in `statistics` normalises group g with
    the statistics of structure g (in training and eval mode alike)."""
    norms = dict(_group_norms(net))
    try:
        for name, stats in statistics.items():
            norms[name].statistics = stats
        yield
    finally:
        for name in statistics:
            norms[name].statistics = None


def select(statistics: Statistics, index: slice) -> Statistics:
    """The statistics of the structures `index`."""
    return {name: (mean[index], var[index]) for name, (mean, var) in statistics.items()}


def concatenate(parts: list[Statistics]) -> Statistics:
    """Statistics of consecutive sets of structures joined into one."""
    return {name: (torch.cat([p[name][0] for p in parts]), torch.cat([p[name][1] for p in parts]))
            for name in parts[0]}
