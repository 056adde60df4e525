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

`statistics_apart(modules)` keeps the lists these tools fill out of sight of a compiled region
(`dbsn.nets.fused_cell.FusedCell.nodes`), which would otherwise compile anew as they grow.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

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
    group's batch statistics) or ``pending`` (a `RunningStatistics` of the training step:
    the running statistics move once, at its end).

    Layout. An NCHW-contiguous batch is viewed as (b, G*C, H, W), which puts group g's
    channels at g*C..(g+1)*C, so one ``native_batch_norm`` call without running statistics
    computes per-group statistics and returns each group's mean and 1/std: no copy of the
    running statistics per call. A channels-last batch has no such view (its channels are
    innermost, the groups outermost); it is normalised from per-group moments over a
    (b, G, C, H, W) view instead (`_moments`, `_scale_shift`): the same function, in float32,
    without a copy of the input's layout.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.statistics: tuple[Tensor, Tensor] | None = None
        self.collected: list[tuple[Tensor, Tensor]] | None = None
        self.pending: RunningStatistics | None = None

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:  # type: ignore[override]
        if self.statistics is not None:
            return self._normalise(x, groups, *self.statistics)
        uses_batch_stats = self.training or self.running_mean is None
        update = self.training and self.track_running_stats and self.running_mean is not None
        if self.collected is None and (not uses_batch_stats or (groups == 1 and (self.pending is None or not update))):
            return super().forward(x)  # nn.BatchNorm2d: eval, or one group moving its statistics itself
        y, mean, invstd = self._group_statistics(x, groups)
        n, _, h, w = x.shape
        count = (n // groups) * h * w
        if self.collected is not None:
            var = _unbiased(invstd, self.eps, count)
            self.collected.append((mean.view(groups, -1).detach(), var.view(groups, -1).detach()))
        elif update and self.pending is not None:
            self.pending.add(self, mean, invstd, groups, count)
        elif update:
            with torch.no_grad():
                factor = self._next_factor()
                self.running_mean.lerp_(mean.view(groups, -1).mean(0).to(self.running_mean.dtype), factor)
                var = _unbiased(invstd, self.eps, count).view(groups, -1).mean(0)
                self.running_var.lerp_(var.to(self.running_var.dtype), factor)
        return y

    def _next_factor(self) -> float:
        """Count one more batch and return the running statistics' update factor."""
        self.num_batches_tracked.add_(1)
        # momentum=None: cumulative moving average, as in nn.BatchNorm2d.
        return self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)

    def _group_statistics(self, x: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
        """Normalise each group with its batch statistics; return the output and each group's
        mean and 1 / sqrt(biased variance + eps), flat (G*C,), in float32 (float64 for a
        float64 x), detached."""
        n, c, h, w = x.shape
        if _channels_last(x):
            mean, var = _moments(x, groups)
            y = self._scale_shift(x, groups, mean, var)
            return y, mean.detach().reshape(-1), torch.rsqrt(var.detach() + self.eps).reshape(-1)
        weight, bias = self._affine(groups)
        if weight is None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            # a CPU computes a 16-bit batch's statistics in its dtype unless a float32 parameter makes it
            # mix (a GPU accumulates in float32 either way): the statistics stay float32, as promised
            weight, bias = x.new_ones(groups * c, dtype=torch.float32), x.new_zeros(groups * c, dtype=torch.float32)
        # (its mean and 1/std come out of autograd's graph: nothing to detach)
        y, mean, invstd = torch.native_batch_norm(
            x.reshape(n // groups, groups * c, h, w), weight, bias, None, None, True, 0.0, self.eps
        )
        return y.view(n, c, h, w), full(mean), full(invstd)

    def _affine(self, groups: int) -> tuple[Tensor | None, Tensor | None]:
        if not self.affine:
            return None, None
        if groups == 1:
            return self.weight, self.bias
        return self.weight.repeat(groups), self.bias.repeat(groups)

    def _batch_statistics(self, x: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
        """Normalise each group with its batch statistics; return the output and each group's
        mean and unbiased variance, (G, C), in float32."""
        y, mean, invstd = self._group_statistics(x, groups)
        n, _, h, w = x.shape
        var = _unbiased(invstd, self.eps, (n // groups) * h * w)
        return y, mean.view(groups, -1), var.view(groups, -1)

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
        y = F.batch_norm(
            x.reshape(n // groups, groups * c, h, w),
            mean.reshape(-1),
            var.reshape(-1),
            *self._affine(groups),
            False,
            0.0,
            self.eps,
        )
        return y.view(n, c, h, w)

    def _scale_shift(self, x: Tensor, groups: int, mean: Tensor, var: Tensor) -> Tensor:
        """(x - mean[g]) / sqrt(var[g] + eps) * weight + bias for group g, in float32, from a
        (b, G, C, H, W) view of x (any layout); returned in x's dtype and layout."""
        n, c, h, w = x.shape
        with float32():
            scale = torch.rsqrt(full(var) + self.eps)  # (G, C)
            if self.affine:
                scale = scale * self.weight
            shift = -full(mean) * scale
            if self.affine:
                shift = shift + self.bias
            y = full(x.view(n // groups, groups, c, h, w)) * scale[:, :, None, None] + shift[:, :, None, None]
        return y.to(x.dtype).view(n, c, h, w)


def _unbiased(invstd: Tensor, eps: float, count: int) -> Tensor:
    """The unbiased variance from 1 / sqrt(biased variance + eps) over `count` values."""
    return (invstd.pow(-2) - eps) * (count / max(count - 1, 1))


class RunningStatistics:
    """The running-statistics updates of one training step, made at its end in a few operations.

    Every `GroupBatchNorm2d` call of the step (`pending` set by `accumulated_running_statistics`)
    hands over its groups' batch means and 1/std; `apply` then moves each module's running
    statistics once, towards the mean over all the groups it saw, by the module's factor, and
    counts one batch for it: what one grouped forward over all of them does. For all modules
    together it is a handful of operations (one concatenation, one `index_add_` per statistic,
    one `_foreach_lerp_`), not a dozen per call: the per-structure BatchNorm's bookkeeping
    dominated the eager step's operation count. The index and scale tensors are made once for
    each pattern of calls (the same every step), so `apply` makes no host-to-device copy after
    the first step and can be captured in a CUDA graph.

    ``keep`` (a one-element tensor) given to `apply` leaves every running statistic where it was
    when it is true (a step whose loss was not finite), without a host synchronisation.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[GroupBatchNorm2d, Tensor, Tensor, int, int]] = []
        self._plans: dict[tuple, tuple] = {}

    def add(self, module: GroupBatchNorm2d, mean: Tensor, invstd: Tensor, groups: int, count: int) -> None:
        self.calls.append((module, mean, invstd, groups, count))

    def _plan(self, calls) -> tuple:
        key = tuple(
            (id(m), groups, count, mean.numel(), mean.dtype, mean.device) for m, mean, _, groups, count in calls
        )
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        modules: list[GroupBatchNorm2d] = []
        offsets: dict[int, int] = {}
        for m, *_ in calls:
            if id(m) not in offsets:
                offsets[id(m)] = sum(x.num_features for x in modules)
                modules.append(m)
        seen = {id(m): 0 for m in modules}  # groups each module saw in the step
        for m, _, _, groups, _ in calls:
            seen[id(m)] += groups
        index, scale, correction, eps = [], [], [], []
        for m, mean, _, groups, count in calls:
            c = m.num_features
            index += [offsets[id(m)] + k for _ in range(groups) for k in range(c)]
            scale += [1.0 / seen[id(m)]] * (groups * c)
            correction += [count / max(count - 1, 1)] * (groups * c)
            eps += [m.eps] * (groups * c)
        device, dtype = calls[0][1].device, calls[0][1].dtype
        as_tensor = lambda values, kind=dtype: torch.tensor(values, dtype=kind, device=device)  # noqa: E731
        plan = (
            modules,
            as_tensor(index, torch.long),
            as_tensor(scale),
            as_tensor(correction),
            as_tensor(eps),
            [m.num_features for m in modules],
        )
        self._plans[key] = plan
        return plan

    @torch.no_grad()
    def apply(self, keep: Tensor | None = None) -> None:
        calls, self.calls = self.calls, []
        if not calls:
            return
        modules, index, scale, correction, eps, sizes = self._plan(calls)
        means = torch.cat([mean for _, mean, _, _, _ in calls])
        variances = (torch.cat([invstd for _, _, invstd, _, _ in calls]).pow(-2) - eps) * correction
        total = sum(sizes)
        targets = []
        for values in (means, variances):
            moved = torch.zeros(total, dtype=values.dtype, device=values.device).index_add_(0, index, values * scale)
            targets.append(moved)
        running = ([m.running_mean for m in modules], [m.running_var for m in modules])
        if keep is not None:
            keep = keep.reshape(()) != 0
            targets = [torch.where(keep, torch.cat(r).to(t.dtype), t) for r, t in zip(running, targets)]
        counters = [m.num_batches_tracked for m in modules]
        torch._foreach_add_(counters, 1)
        by_momentum: dict[float, list[int]] = {}
        for k, m in enumerate(modules):
            if m.momentum is not None:
                by_momentum.setdefault(float(m.momentum), []).append(k)
                continue
            factor = 1.0 / m.num_batches_tracked.to(m.running_mean.dtype)  # cumulative average, on the device
            start = sum(sizes[:k])
            for buffer, target in zip((m.running_mean, m.running_var), targets):
                buffer.lerp_(target.narrow(0, start, sizes[k]).to(buffer.dtype), factor)
        for buffers, target in zip(running, targets):
            parts = target.split(sizes)
            for momentum, ks in by_momentum.items():
                torch._foreach_lerp_([buffers[k] for k in ks], [parts[k].to(buffers[k].dtype) for k in ks], momentum)
        if keep is not None:  # a kept step counts no batch either
            torch._foreach_add_(counters, keep.long(), alpha=-1)


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
def accumulated_running_statistics(
    net: nn.Module, enabled: bool = True, statistics: RunningStatistics | None = None, keep: Tensor | None = None
) -> Iterator[RunningStatistics | None]:
    """Within the block, training forwards hand their per-group batch statistics to a
    `RunningStatistics` instead of moving the running statistics; on exit the running
    statistics move once, by the usual factor, towards the mean over all the groups seen. T
    structures run in chunks then leave the running statistics exactly where one grouped
    forward over all T leaves them, and one grouped forward makes its updates in a handful of
    operations instead of a dozen per BatchNorm call. ``statistics``: a `RunningStatistics` to
    reuse (it keeps its index tensors from step to step); ``keep``: see `RunningStatistics.apply`.
    Nothing is applied when the block raises."""
    norms = [m for _, m in _group_norms(net) if m.track_running_stats] if enabled else []
    if not norms:
        yield None
        return
    collector = statistics if statistics is not None else RunningStatistics()
    for m in norms:
        m.pending = collector
    try:
        yield collector
    except BaseException:
        collector.calls = []
        raise
    finally:
        for m in norms:
            m.pending = None
    collector.apply(keep)


@contextmanager
def statistics_apart(modules: Iterable[GroupBatchNorm2d]) -> Iterator[None]:
    """Within the block, what `modules` hand over -- their `RunningStatistics`' calls
    (``pending``), their ``collected`` statistics -- goes to fresh empty lists, appended to the
    real ones on exit, in order: the same lists as without the block.

    For a compiled region (`dbsn.nets.fused_cell.FusedCell.nodes`): dynamo guards a list's length,
    and a training step's list of calls grows cell by cell (``collected`` batch by batch), so each
    cell would compile a graph of its own although cells of a stage have the same shapes. Seen
    from inside the block every list is empty, every time."""
    modules = list(modules)
    collectors = list({id(m.pending): m.pending for m in modules if m.pending is not None}.values())
    collecting = [m for m in modules if m.collected is not None]
    calls = [c.calls for c in collectors]
    collected = [m.collected for m in collecting]
    for c in collectors:
        c.calls = []
    for m in collecting:
        m.collected = []
    try:
        yield
    finally:
        for c, saved in zip(collectors, calls):
            saved.extend(c.calls)
            c.calls = saved
        for m, saved in zip(collecting, collected):
            saved.extend(m.collected)
            m.collected = saved


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
        return {
            name: tuple(
                torch.stack(parts).mean(0).expand(num_structures, -1).contiguous() for parts in zip(*m.collected)
            )
            for name, m in norms
            if m.collected
        }
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
    return {name: (torch.cat([p[name][0] for p in parts]), torch.cat([p[name][1] for p in parts])) for name in parts[0]}
