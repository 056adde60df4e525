"""dbsn's statistics for predictions from any model: a user's own logits or log-probabilities and
targets, as tensors or arrays. Thin wrappers over the functions evaluate.py and the report use, so
the numbers are the same:

- `metric_intervals`: every test metric with its percentile bootstrap interval over the test
  examples (`evaluation.statistics`), the calibrated metrics after temperature scaling, and CE²'s
  score interval (`metrics.ce2_inference.score_interval`);
- `compare`: the paired differences a − b of two predictors on the same examples, per seed and
  combined over k seeds (the report's paired table: `evaluation.report.comparisons.paired_differences`);
- `ce2_interval`, `ce2_paired_test`: CE² of one predictor, and the paired test of two;
- `seed_level`: k seeds' estimates combined (`evaluation.report.seeds.combine_seeds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dbsn.evaluation.report.comparisons import paired_differences
from dbsn.evaluation.report.seeds import SeedLevel, combine_seeds
from dbsn.evaluation.statistics import Statistics, calibrate, ce2_intervals, classification_statistics, intervals_of
from dbsn.metrics.ce2_inference import TestResult, paired_test, score_interval

__all__ = ["Estimate", "ce2_interval", "ce2_paired_test", "compare", "metric_intervals", "seed_level", "to_log_probs"]


class Estimate(NamedTuple):
    """A metric's value on the test set and its interval."""

    value: float
    low: float
    high: float


def to_log_probs(predictions) -> Tensor:
    """Log-probabilities (N, C), float64, from logits or log-probabilities (a tensor or an array):
    log_softmax leaves log-probabilities unchanged, so either may be given."""
    return torch.log_softmax(
        torch.as_tensor(np.asarray(predictions) if not isinstance(predictions, Tensor) else predictions).double(),
        dim=-1,
    )


def _targets(targets) -> Tensor:
    return torch.as_tensor(np.asarray(targets) if not isinstance(targets, Tensor) else targets).long()


def metric_intervals(
    predictions,
    targets,
    statistics: Statistics | None = None,
    calibrated: bool = True,
    validation: tuple | None = None,
    scores: dict | None = None,
) -> dict[str, Estimate]:
    """Every test metric of one predictor (`test/{error,nll,brier,ce2,ece,adaptive_ece,classwise_ece}`,
    with `calibrated`: `test/calibrated/{nll,brier,ce2,ece}`) with its interval at `statistics.level`:
    the percentile bootstrap over the test examples, CE²'s score interval. The temperature is fitted
    on `validation` = (predictions, targets) where given, else by test-time 2-fold cross-validation.
    `scores`: per-example uncertainty scores (N,) by name (`max_probability`, `predictive_entropy`,
    `mutual_information`, as `Method.uncertainty_scores` gives them) add the selective-prediction
    metrics `selective/<score>/{aurc,eaurc,augrc,risk@80}` of how well each ranks the errors."""
    statistics = statistics or Statistics()
    log_probs, y = to_log_probs(predictions), _targets(targets)
    held_out = None if validation is None else (to_log_probs(validation[0]), _targets(validation[1]))
    cal = calibrate(log_probs, y, held_out, statistics.seed)[0] if calibrated else None
    scores = {k: torch.as_tensor(np.asarray(v) if not isinstance(v, Tensor) else v) for k, v in (scores or {}).items()}
    found = classification_statistics(log_probs, y, scores, statistics.weights(len(y)), cal)
    intervals = intervals_of(found, statistics.level)
    intervals.update(ce2_intervals(log_probs, y, cal, statistics.level))
    return {key: Estimate(float(found[key][0]), *intervals[key]) for key in found}


def _per_seed(predictions) -> list:
    """One prediction per seed: a list (or tuple) of them, or one (N, C) array."""
    return list(predictions) if isinstance(predictions, (list, tuple)) else [predictions]


def compare(a, b, targets, statistics: Statistics | None = None, calibrated: bool = True) -> dict[str, dict]:
    """The paired differences a − b of two predictors on the same test examples, as the report's
    paired table computes them. `a`, `b`: logits or log-probabilities (N, C), or a list of k of
    them (seed i of a paired with seed i of b); `targets`: (N,), or a list of k.

    Returns {metric: {"seeds": {i: (value, low, high)}, "combined": (value, low, high), "p": p,
    "df": df}} for error, NLL, Brier, CE² (and calibrated NLL, calibrated CE² with `calibrated`):
    each seed's difference on the same bootstrap resamples (CE²: its paired score test), combined
    over seeds by a t interval whose variance adds the seeds' spread to the test noise they share."""
    statistics = statistics or Statistics()
    a, b = _per_seed(a), _per_seed(b)
    if len(a) != len(b):
        raise ValueError(f"compare: {len(a)} seeds of a against {len(b)} of b")
    ys = [_targets(t) for t in (targets if isinstance(targets, (list, tuple)) else [targets] * len(a))]

    def side(predictions: list) -> dict[int, dict]:
        out = {}
        for seed, (p, y) in enumerate(zip(predictions, ys)):
            log_probs = to_log_probs(p)
            out[seed] = {"log_probs": log_probs, "targets": y}
            if calibrated:
                out[seed]["calibrated_log_probs"] = calibrate(log_probs, y, None, statistics.seed)[0]
        return out

    return paired_differences(side(a), side(b), statistics)


def ce2_interval(predictions, targets, level: float = 0.95) -> TestResult:
    """CE² of one predictor with its score interval and the p-value of CE² = 0."""
    return score_interval(to_log_probs(predictions).exp(), _targets(targets), level)


def ce2_paired_test(a, b, targets, level: float = 0.95) -> TestResult:
    """CE²_a − CE²_b on the same examples, its interval and the p-value of no difference."""
    return paired_test(to_log_probs(a).exp(), to_log_probs(b).exp(), _targets(targets), level)


def seed_level(values: Sequence[float], test_cov=None, level: float = 0.95) -> SeedLevel:
    """k seeds' estimates combined: their mean, its t interval and p-value against 0 and the degrees of
    freedom. `test_cov` (k, k): the covariance of their test-set noise (None: independent test sets
    whose noise the seeds' spread already holds, zeros)."""
    values = torch.as_tensor(np.asarray(values, dtype=np.float64))
    cov = (
        torch.zeros(len(values), len(values), dtype=torch.float64)
        if test_cov is None
        else torch.as_tensor(np.asarray(test_cov, dtype=np.float64))
    )
    return combine_seeds(values, cov, level)
