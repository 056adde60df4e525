"""A run folder read from Python: its config, metrics, intervals and per-example predictions."""

from __future__ import annotations

from pathlib import Path

import torch

from dbsn.evaluation.report.collect import Run
from dbsn.evaluation.report.collect import load_run as _load_run
from dbsn.evaluation.report.comparisons import load_predictions


def load_run(folder: str | Path) -> Run:
    """The run in `folder` as the report reads it: `method`, `dataset`, `seed`, `status` ("ok" once
    metrics.json is there), `metrics`, `intervals` (metric -> [low, high]), `config`, `calibration`."""
    return _load_run(Path(folder))


def load_run_predictions(folder: str | Path) -> dict[str, torch.Tensor] | None:
    """The per-example test predictions an evaluation saved (`predictions.npz`: `log_probs` (N, C),
    `targets`, `calibrated_log_probs`, `score_<name>`), float64 / int64; None where there are none.
    These are what `dbsn.api.compare` takes."""
    return load_predictions(_load_run(Path(folder)))
