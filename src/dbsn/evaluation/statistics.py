"""How sure a run's numbers are: bootstrap intervals of every test metric, the calibrated metrics,
and the per-example data that lets the report pair two methods on the same examples.

`Statistics` (config `statistics.*`) seeds an evaluation and sets its bootstrap: `resamples`
resamples of the test examples (with replacement, `seed`), one (resamples, n) count matrix that
every metric is computed on at once (`dbsn.metrics.intervals`); the interval of a metric is the
percentile interval at `level`. Row 0 of every statistic is the metric itself (unit counts).

Calibrated metrics (Ashukha et al., ICLR 2020): NLL, Brier and ECE after one temperature is fitted
on held-out predictions, so that methods are compared at their best temperature: on the validation
split where the data has one, else by the paper's test-time cross-validation (two seeded random
halves of the test set, each calibrated by the other's temperature). The calibrated
log-probabilities are fixed before resampling: the intervals hold the temperature fixed.

The unbiased squared calibration error (`test/ce2`, `test/calibrated/ce2`) is the exception: a
percentile bootstrap of this U-statistic is too wide near 0, so its interval is the score interval
`metrics.ce2_inference.score_interval`, and metrics.json's `"statistics"` says so (`CE2_INTERVAL`).
`prediction_arrays` is what `predictions.npz` keeps for the report's paired bootstrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dbsn.evaluation.recorder import PredictionRecorder
from dbsn.methods.temperature import TemperatureScaler
from dbsn.metrics.ce2_inference import score_interval
from dbsn.metrics.intervals import (
    percentile_interval,
    resample_counts,
    weighted_adaptive_ece,
    weighted_brier,
    weighted_classwise_ece,
    weighted_ece,
    weighted_error,
    weighted_nll,
    weighted_selective,
    weighted_squared_calibration_error,
)
from dbsn.metrics.selective import score_as_uncertainty

__all__ = [
    "CE2_INTERVAL",
    "PREDICTIONS_FILE",
    "RecordedStatistics",
    "Statistics",
    "calibrate",
    "ce2_intervals",
    "classification_statistics",
    "intervals_of",
    "prediction_arrays",
    "recorded_statistics",
    "validation_predictions",
]

#: the per-example test predictions of an evaluation (log-probabilities, targets, calibrated
#: log-probabilities, uncertainty scores): what the report pairs methods on
PREDICTIONS_FILE = "predictions.npz"
#: the uncertainty scores whose ranking of errors selective prediction measures (and whose metrics get intervals)
SELECTIVE_SCORES = ("max_probability", "predictive_entropy", "mutual_information")
#: how metrics.json's `test/ce2` and `test/calibrated/ce2` intervals are made
CE2_INTERVAL = (
    "score interval of the U-statistic's variance at each hypothesised CE² "
    "(dbsn.metrics.ce2_inference.score_interval), lower end clipped at 0"
)


@dataclass(frozen=True)
class Statistics:
    """The seed and the bootstrap of an evaluation.

    Args:
        seed: seeds everything random in an evaluation: the structures and members drawn for
            the Bayes ensemble, the test-time calibration split, the bootstrap resamples.
        resamples: bootstrap resamples of the test examples (at least 1,000 for a 95 % interval).
        level: the intervals' coverage.
    """

    seed: int = 0
    resamples: int = 1000
    level: float = 0.95

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"statistics.seed must be an integer, got {self.seed!r}")
        if int(self.resamples) < 1:
            raise ValueError(f"statistics.resamples must be at least 1, got {self.resamples}")
        if not 0 < float(self.level) < 1:
            raise ValueError(f"statistics.level must lie in (0, 1), got {self.level}")

    def weights(self, n: int, stream: int = 0) -> Tensor:
        """(1 + resamples, n): unit counts (the metric itself), then the seeded resamples. Sets
        resampled independently of each other (an OOD set beside the test set) take different
        `stream`s; sets resampled together (two methods on one test set) the same one."""
        seed = int(self.seed) * 1_000_003 + int(stream)
        return torch.cat([torch.ones(1, n, dtype=torch.float64), resample_counts(n, int(self.resamples), seed)])

    def record(self) -> dict[str, Any]:
        """What metrics.json says about its intervals."""
        return {
            "seed": int(self.seed),
            "resamples": int(self.resamples),
            "level": float(self.level),
            "interval": "percentile bootstrap over the test examples",
        }


def calibrate(
    log_probs: Tensor, targets: Tensor, validation: tuple[Tensor, Tensor] | None = None, seed: int = 0
) -> tuple[Tensor, dict[str, Any]]:
    """The test set's log-probabilities after temperature scaling (see the module docstring) and
    how the temperature was found: `validation` = (log-probabilities, targets) of the validation
    split, else test-time 2-fold cross-validation with a `seed`ed split."""
    log_probs = log_probs.double()
    if validation is not None:
        scaler = TemperatureScaler()
        scaler.fit(validation[0].double(), validation[1])
        with torch.no_grad():
            return scaler(log_probs), {"fitted_on": "validation", "temperature": scaler.temperature}
    n = len(targets)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    halves = (order[: n // 2], order[n // 2 :])
    out, temperatures = torch.empty_like(log_probs), []
    for fit, apply in (halves, halves[::-1]):
        scaler = TemperatureScaler()
        scaler.fit(log_probs[fit], targets[fit])
        with torch.no_grad():
            out[apply] = scaler(log_probs[apply])
        temperatures.append(scaler.temperature)
    return out, {"fitted_on": "test, 2-fold cross-validation (Ashukha et al. 2020)", "temperature": temperatures}


def classification_statistics(
    log_probs: Tensor, targets: Tensor, scores: dict[str, Tensor], weights: Tensor, calibrated: Tensor | None = None
) -> dict[str, Tensor]:
    """Every test metric of a classifier's ensemble prediction at each row of `weights` (counts
    of the test examples): `test/{error,nll,brier,ce2,ece,adaptive_ece,classwise_ece}`,
    `test/calibrated/{nll,brier,ce2,ece}` (given the calibrated log-probabilities) and
    `selective/<score>/{aurc,eaurc,augrc,risk@80}` with `selective/optimal_aurc`. `ce2` is the
    unbiased squared calibration error (`metrics.calibration.squared_calibration_error`), the one
    to compare (its interval: `ce2_intervals`); the ECEs are the familiar plug-in numbers, biased upward."""
    log_probs = log_probs.double()
    probs = log_probs.exp()
    out = {
        "test/error": weighted_error(probs, targets, weights),
        "test/nll": weighted_nll(log_probs, targets, weights),
        "test/brier": weighted_brier(probs, targets, weights),
        "test/ce2": weighted_squared_calibration_error(probs, targets, weights),
        "test/ece": weighted_ece(probs, targets, weights),
        "test/adaptive_ece": weighted_adaptive_ece(probs, targets, weights),
        "test/classwise_ece": weighted_classwise_ece(probs, targets, weights),
    }
    if calibrated is not None:
        calibrated = calibrated.double()
        out.update(
            {
                "test/calibrated/nll": weighted_nll(calibrated, targets, weights),
                "test/calibrated/brier": weighted_brier(calibrated.exp(), targets, weights),
                "test/calibrated/ce2": weighted_squared_calibration_error(calibrated.exp(), targets, weights),
                "test/calibrated/ece": weighted_ece(calibrated.exp(), targets, weights),
            }
        )
    errors = (probs.argmax(1) != targets).double()
    for name in SELECTIVE_SCORES:
        if name in scores:
            found = weighted_selective(errors, score_as_uncertainty(name, scores[name]).double(), weights)
            out["selective/optimal_aurc"] = found.pop("optimal_aurc")
            out.update({f"selective/{name}/{key}": value for key, value in found.items()})
    return out


def intervals_of(statistics: dict[str, Tensor], level: float) -> dict[str, list[float]]:
    """[low, high] of each statistic: the percentile interval of rows 1.. (row 0 is the value)."""
    out = {}
    for key, rows in statistics.items():
        interval = percentile_interval(float(rows[0]), rows[1:], level)
        out[key] = [interval.low, interval.high]
    return out


def ce2_intervals(
    log_probs: Tensor, targets: Tensor, calibrated: Tensor | None, level: float
) -> dict[str, list[float]]:
    """[low, high] of `test/ce2` (and `test/calibrated/ce2` given calibrated log-probabilities): the
    score interval of `metrics.ce2_inference` (module docstring), not the percentile bootstrap."""
    found = {"test/ce2": log_probs, **({} if calibrated is None else {"test/calibrated/ce2": calibrated})}
    return {key: list(score_interval(value.double().exp(), targets, level)[1:3]) for key, value in found.items()}


def prediction_arrays(
    log_probs: Tensor, targets: Tensor, scores: dict[str, Tensor], calibrated: Tensor | None
) -> dict[str, np.ndarray]:
    """`predictions.npz`'s arrays (float32 log-probabilities: 4 bytes per class and example)."""
    out = {"log_probs": log_probs.float().numpy(), "targets": targets.numpy()}
    if calibrated is not None:
        out["calibrated_log_probs"] = calibrated.float().numpy()
    out.update({f"score_{k}": v.float().numpy() for k, v in scores.items() if k in SELECTIVE_SCORES})
    return out


@torch.no_grad()
def validation_predictions(model, datamodule) -> tuple[Tensor, Tensor] | None:
    """The ensemble's log-probabilities and the targets of the validation split (None without one)."""
    if not getattr(datamodule, "has_val", False):
        return None
    if getattr(datamodule, "val_set", None) is None:
        datamodule.setup("validate")
    loader = datamodule.val_dataloader()
    if not loader:
        return None
    model.eval()
    model.enable_test_noise()
    outputs, labels = [], []
    for images, targets in loader:
        outputs.append(model.predict_log_probs(datamodule.preprocess(images.to(model.device))).float().cpu())
        labels.append(targets.cpu())
    return torch.cat(outputs), torch.cat(labels)


@dataclass
class RecordedStatistics:
    """What `recorded_statistics` found: the calibrated metrics, every interval, how they were made,
    and the per-example arrays of `predictions.npz`."""

    metrics: dict[str, float]
    intervals: dict[str, list[float]]
    record: dict[str, Any]
    arrays: dict[str, np.ndarray] | None


def recorded_statistics(
    model, recorded: PredictionRecorder, datamodule, statistics: Statistics
) -> RecordedStatistics | None:
    """The intervals and calibrated metrics of a classifier's test pass (`recorded`: its
    predictions; `model` predicts the validation split the temperature is fitted on); of a
    segmentation model's, the intervals of mIoU, global accuracy, pixel ECE and NLL, resampling
    test images (None where the test pass kept neither)."""
    if recorded.log_probs is None or recorded.scores is None:
        images = recorded.image_metrics
        rows = None if images is None else images.per_image()
        if rows is None:
            return None
        found = images.resampled(statistics.weights(len(rows)), rows)
        intervals = intervals_of({f"test/{k}": v for k, v in found.items()}, statistics.level)
        return RecordedStatistics(
            metrics={},
            intervals=intervals,
            arrays=None,
            record={"statistics": {**statistics.record(), "interval": "percentile bootstrap over the test images"}},
        )
    log_probs, targets, scores = recorded.log_probs.double(), recorded.targets, recorded.scores
    calibrated, calibration = calibrate(log_probs, targets, validation_predictions(model, datamodule), statistics.seed)
    found = classification_statistics(log_probs, targets, scores, statistics.weights(len(targets)), calibrated)
    metrics = {key: float(found[key][0]) for key in found if key.startswith("test/calibrated/") or key == "test/ce2"}
    intervals = intervals_of(found, statistics.level)
    intervals.update(ce2_intervals(log_probs, targets, calibrated, statistics.level))
    return RecordedStatistics(
        metrics=metrics,
        intervals=intervals,
        record={"statistics": {**statistics.record(), "ce2_interval": CE2_INTERVAL}, "calibration": calibration},
        arrays=prediction_arrays(log_probs, targets, scores, calibrated),
    )
