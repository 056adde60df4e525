"""The Monte Carlo sample ablation: how the Bayes ensemble's metrics change with S.

One set of S forward passes gives every smaller ensemble for free: the ensemble of the first s
members is

    log p_s(y | x) = logsumexp_{t ≤ s} log p_t(y | x) − log s,

which is one `torch.logcumsumexp` over the member axis. `SampleAblation` accumulates the test
metrics (error, NLL, Brier, ECE) of every requested s over the test batches, so the row for
s = S is exactly the full ensemble's metrics (same members, same order) and no forward pass is
repeated per s. A test pass streams its members (`dbsn.methods.predictive.EnsembleStream`) and
hands over only the prefix ensembles of the requested sizes (`update_prefixes`).

The sizes default to `default_sizes(S)`: every s up to 100 (the paper's Figure 5 is this table
for s = 1 … 100; `dbsn.evaluation.ablation` writes and draws it), then 200, 500, 1000, 2000, …
and S: at most 100 + 3 per decade of S, so the ablation's memory (each size's metric states) and
its work per batch stay bounded whatever S is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from dbsn.metrics.classification import ClassificationMetrics

__all__ = ["EVERY_SIZE_UP_TO", "SampleAblation", "default_sizes", "prefix_ensembles"]

#: the default sizes include every s up to this one (the paper's Figure 5)
EVERY_SIZE_UP_TO = 100


def default_sizes(n_samples: int) -> list[int]:
    """Every s in 1..min(S, 100), then 200, 500, 1000, 2000, 5000, … below S, and S."""
    sizes = list(range(1, min(n_samples, EVERY_SIZE_UP_TO) + 1))
    decade = EVERY_SIZE_UP_TO
    while decade < n_samples:
        sizes += [m * decade for m in (2, 5, 10) if m * decade < n_samples]
        decade *= 10
    return sorted(set(sizes) | {n_samples})


def prefix_ensembles(member_log_probs: Tensor, sizes: Sequence[int]) -> Tensor:
    """log-probabilities of the ensembles of the first s members for each s in `sizes`.

    Args:
        member_log_probs: (S, N, C) log-probabilities of the members, in draw order.
        sizes: ensemble sizes, each in 1..S.

    Returns:
        (len(sizes), N, C).
    """
    total = member_log_probs.shape[0]
    if any(not 1 <= s <= total for s in sizes):
        raise ValueError(f"ensemble sizes must lie in 1..{total}, got {list(sizes)}")
    cumulative = torch.logcumsumexp(member_log_probs, dim=0)
    index = torch.as_tensor([s - 1 for s in sizes], device=member_log_probs.device)
    logs = torch.as_tensor([math.log(s) for s in sizes], dtype=cumulative.dtype, device=cumulative.device)
    return cumulative.index_select(0, index) - logs.view(-1, 1, 1)


class SampleAblation(nn.Module):
    """Test metrics of the ensembles of the first s members, for every s in `sizes`.

    Args:
        num_classes: C.
        n_samples: S, the number of members each `update` receives.
        sizes: the ensemble sizes to report; None = `default_sizes(n_samples)` (every s up to 100).
        keep: also keep every size's ensemble log-probabilities (`kept`, (sizes, N, C) once
            `compute`d), for what needs them whole (the calibrated NLL of each size); None:
            keep them for at most 16 sizes (a deep ensemble's 1..M, not DBSN's 1..100).
    """

    def __init__(
        self, num_classes: int, n_samples: int, sizes: Sequence[int] | None = None, keep: bool | None = None
    ) -> None:
        super().__init__()
        sizes = default_sizes(n_samples) if sizes is None else sorted({int(s) for s in sizes})
        if not sizes or sizes[0] < 1 or sizes[-1] > n_samples:
            raise ValueError(f"ablation sizes must lie in 1..{n_samples} (the ensemble's S), got {sizes}")
        self.sizes = sizes
        self.n_samples = n_samples
        self.metrics = nn.ModuleList(ClassificationMetrics(num_classes) for _ in sizes)
        self.keep = len(sizes) <= 16 if keep is None else keep
        self._kept: list[Tensor] = []

    def update(
        self, member_log_probs: Tensor, target: Tensor, transform: Callable[[Tensor], Tensor] | None = None
    ) -> None:
        """Add a batch: member log-probabilities (S, b, C) and targets (b,).

        `transform` is applied to each prefix ensemble's log-probabilities (e.g. the post-hoc
        temperature), as the method applies it to its full ensemble.
        """
        if member_log_probs.shape[0] != self.n_samples:
            raise ValueError(f"expected {self.n_samples} members, got {member_log_probs.shape[0]}")
        self.update_prefixes(prefix_ensembles(member_log_probs, self.sizes), target, transform)

    def update_prefixes(
        self, ensembles: Tensor | dict[int, Tensor], target: Tensor, transform: Callable[[Tensor], Tensor] | None = None
    ) -> None:
        """Add a batch from its prefix ensembles: (sizes, b, C) in `sizes`' order, or size -> (b, C)
        (`EnsembleStream.prefixes`, which must hold every size), and the targets (b,)."""
        if isinstance(ensembles, dict):
            missing = [s for s in self.sizes if s not in ensembles]
            if missing:
                raise ValueError(
                    f"the prediction holds no prefix ensemble of sizes {missing[:5]}: set the method's "
                    "prefix_sizes to the ablation's sizes before the test pass"
                )
            ensembles = torch.stack([ensembles[s] for s in self.sizes])
        if transform is not None:
            ensembles = torch.stack([transform(log_probs) for log_probs in ensembles])
        for metrics, log_probs in zip(self.metrics, ensembles):
            metrics.update(log_probs, target)
        if self.keep:
            self._kept.append(ensembles.detach().float().cpu())

    @property
    def kept(self) -> Tensor | None:
        """(sizes, N, C): every size's ensemble log-probabilities of the batches since the last
        `reset`, in order (None unless `keep`)."""
        return torch.cat(self._kept, dim=1) if self.keep and self._kept else None

    def compute(self) -> list[dict[str, float]]:
        """One row per size: {"n_samples", "error", "nll", "brier", "ece"}."""
        rows = []
        for s, metrics in zip(self.sizes, self.metrics):
            values = {k: float(v) for k, v in metrics.compute().items()}
            rows.append({"n_samples": s, **values})
        return rows

    def reset(self) -> None:
        for metrics in self.metrics:
            metrics.reset()
        self._kept = []
