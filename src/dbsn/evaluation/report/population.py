"""The cells of the tables of test-pass metrics (the main tables, calibration, selective
prediction): intervals for a method's population metric, its mean over seeds and over test sets
drawn from the same distribution, which the seeds' spread alone leaves out (they share one test
set, whose noise moves all of them alike).

Each run keeps its per-example predictions (`predictions.npz`); every run of a cell is scored on
the same resamples of the test examples (`Statistics.weights`, `classification_statistics`), and
the covariance of the seeds' resampled values is their test noise's (`seeds.resampled_covariance`),
which `format.seed_cell` combines with the seeds' spread. Where a run has no predictions, or the
runs' test sets differ, the cell falls back to `format.mean_std` on each run's interval (the shared
noise at its bound, marked); one seed shows its run's own interval (the test set's noise only).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dbsn.evaluation.report.collect import Run
from dbsn.evaluation.report.comparisons import load_predictions
from dbsn.evaluation.report.format import Cell, mean_std, run_bounds, seed_cell
from dbsn.evaluation.report.seeds import resampled_covariance
from dbsn.evaluation.statistics import Statistics, classification_statistics

__all__ = ["COVARIANCE_RESAMPLES", "PopulationCells"]

_SCORE_PREFIX = "score_"
#: at most this many resamples measure the covariance (about 4 % relative error at 1,000): a field sweep's
#: 10,000, kept for the tails of its percentile intervals, would score every run ten times longer for nothing
COVARIANCE_RESAMPLES = 1000


class PopulationCells:
    """The cells of test-pass metrics over runs, each run's metrics on the common resamples computed
    once (a run's predictions are read and scored at its first use) with `statistics`' bootstrap (at
    most `COVARIANCE_RESAMPLES` resamples) and level."""

    def __init__(self, statistics: Statistics | None = None) -> None:
        self.statistics = statistics or Statistics()
        self._bootstrap = replace(self.statistics, resamples=min(int(self.statistics.resamples), COVARIANCE_RESAMPLES))
        self._found: dict[Path, tuple[torch.Tensor, dict[str, torch.Tensor]] | None] = {}
        self._weights: dict[int, torch.Tensor] = {}

    def resampled(self, run: Run) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """(targets, {metric key: (1 + resamples,) values}) of the run's predictions, None without them."""
        path = Path(run.path)
        if path not in self._found:
            predictions = load_predictions(run)
            self._found[path] = None if predictions is None else (predictions["targets"], self._score(predictions))
        return self._found[path]

    def _score(self, predictions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        targets = predictions["targets"]
        if len(targets) not in self._weights:
            self._weights[len(targets)] = self._bootstrap.weights(len(targets))  # the same resamples for every run
        scores = {k[len(_SCORE_PREFIX) :]: v for k, v in predictions.items() if k.startswith(_SCORE_PREFIX)}
        return classification_statistics(
            predictions["log_probs"],
            targets,
            scores,
            self._weights[len(targets)],
            predictions.get("calibrated_log_probs"),
        )

    def cell(self, runs: list[Run], key: str, scale: float = 1.0) -> Cell:
        """The cell of metric `key` (scaled) over `runs` (one per seed, each with `key` in its metrics):
        the seeds' metrics.json values, with the test noise's covariance from the common resamples."""
        values = [scale * float(r.metrics[key]) for r in runs]
        level = float(self.statistics.level)
        if len(runs) > 1:
            found = [self.resampled(r) for r in runs]
            if all(f is not None and key in f[1] for f in found) and all(torch.equal(f[0], found[0][0]) for f in found):
                rows = torch.stack([f[1][key][1:] for f in found])
                return seed_cell(values, scale**2 * resampled_covariance(rows), level)
        return mean_std(values, [run_bounds(r, key, scale) for r in runs], level)
