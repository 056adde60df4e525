"""The Monte Carlo sample ablation: how the Bayes ensemble's metrics change with S.

One set of S forward passes gives every smaller ensemble for free: the ensemble of the first s
members is

    log p_s(y | x) = logsumexp_{t ≤ s} log p_t(y | x) − log s,

which is one `torch.logcumsumexp` over the member axis. `SampleAblation` accumulates the test
metrics (error, NLL, Brier, ECE) of every requested s over the test batches, so the row for
s = S is exactly the full ensemble's metrics (same members, same order) and no forward pass is
repeated per s. The paper's Figure 5 is this table for s = 1 … 100.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from dbsn.metrics.classification import ClassificationMetrics

__all__ = ["SampleAblation", "ablation_figure", "prefix_ensembles", "write_ablation"]

COLUMNS = ("n_samples", "error", "nll", "brier", "ece")


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
        sizes: the ensemble sizes to report; None = every s from 1 to `max_samples`.
        max_samples: S, the number of members each `update` receives.
    """

    def __init__(self, num_classes: int, max_samples: int, sizes: Sequence[int] | None = None) -> None:
        super().__init__()
        sizes = list(range(1, max_samples + 1)) if sizes is None else sorted({int(s) for s in sizes})
        if not sizes or sizes[0] < 1 or sizes[-1] > max_samples:
            raise ValueError(f"ablation sizes must lie in 1..{max_samples} (the ensemble's S), got {sizes}")
        self.sizes = sizes
        self.max_samples = max_samples
        self.metrics = nn.ModuleList(ClassificationMetrics(num_classes) for _ in sizes)

    def update(self, member_log_probs: Tensor, target: Tensor,
               transform: Callable[[Tensor], Tensor] | None = None) -> None:
        """Add a batch: member log-probabilities (S, b, C) and targets (b,).

        `transform` is applied to each prefix ensemble's log-probabilities (e.g. the post-hoc
        temperature), as the method applies it to its full ensemble.
        """
        if member_log_probs.shape[0] != self.max_samples:
            raise ValueError(f"expected {self.max_samples} members, got {member_log_probs.shape[0]}")
        ensembles = prefix_ensembles(member_log_probs, self.sizes)
        for metrics, log_probs in zip(self.metrics, ensembles):
            metrics.update(transform(log_probs) if transform is not None else log_probs, target)

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


def write_ablation(rows: list[dict[str, float]], folder: Path) -> tuple[Path, Path]:
    """results.csv (columns n_samples, error, nll, brier, ece) and results.json in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = folder / "results.csv", folder / "results.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: row[k] for k in COLUMNS} for row in rows)
    json_path.write_text(json.dumps(rows, indent=2) + "\n")
    return csv_path, json_path


def ablation_figure(results: dict[str, list[dict[str, float]]], title: str | None = None) -> Figure:
    """Test error (%), NLL and ECE against the number of samples S (log axis), one line per
    label (e.g. per method). The value at the right end is the full ensemble's."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = (("error", "Test error (%)", 100.0), ("nll", "Test NLL (nats)", 1.0), ("ece", "Test ECE (15 bins)", 1.0))
    for ax, (key, label, scale) in zip(axes, panels):
        for name, rows in results.items():
            s = [row["n_samples"] for row in rows]
            ax.plot(s, [scale * row[key] for row in rows], marker="o" if len(s) <= 12 else None, ms=3,
                    label=name)
        ax.set_xscale("log")
        ax.set(xlabel="Monte Carlo samples S", ylabel=label, title=label.split(" (")[0] + " vs. S")
        ax.grid(True, which="both", alpha=0.3)
    if len(results) > 1 or any(results):
        axes[0].legend(title="method" if len(results) > 1 else None)
    if title:
        fig.suptitle(title)
    return fig
