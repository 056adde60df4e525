"""One rule for every interval the project prints or draws: the console, W&B, the report, the figures.

An interval [low, high] of a metric's estimate is shown

- **with a flag where it misses its own estimate** (`OUTSIDE_NOTE`). A percentile interval lies
  where the statistic's resampled values lie, which for a statistic biased under resampling is
  beside the estimate (the plug-in ECE's resampled values sit above it). Such an interval is shown
  as it is, never stretched to its estimate, and flagged.
- **with each bound on the right side of the metric's limits** (`METRIC_LIMITS`: an error rate,
  AUROC or coverage in [0, 1]; an NLL, CE², cost or set size >= 0). A bound beyond a limit is moved
  to it, which never loses coverage. An estimate beyond a limit (the unbiased CE² is negative in
  about half the test sets of a calibrated model) is brought within the limits before the
  comparison, so a negative CE² under an interval from 0 is not flagged.

A difference of two metrics has the limits [low − high, high − low] of the metric's, or none
where the metric is not known. Limits are keyed by the last part of the stable metric name
(`test/error` → `error`, `ood/<set>/<score>/auroc` → `auroc`, `test/iou/<class>` → `iou`); a name
not in the table has no limits, and only the flag applies.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["METRIC_LIMITS", "OUTSIDE_NOTE", "Limits", "ShownInterval", "limits_of", "shown_interval"]

#: appended to (or shown beside) an interval that does not contain its estimate, and why
OUTSIDE_NOTE = "(the estimate lies outside its interval: a statistic biased under resampling)"


class Limits(NamedTuple):
    """The least and the greatest value a metric can take (-inf / inf: no limit)."""

    low: float = -math.inf
    high: float = math.inf

    def clip(self, x: float) -> float:
        """`x` moved within the limits (nan stays nan)."""
        return x if math.isnan(x) else min(max(x, self.low), self.high)

    def scaled(self, scale: float) -> Limits:
        """The limits of the metric times `scale` > 0 (an error in %: [0, 100])."""
        if not scale > 0:
            raise ValueError(f"a metric's scale must be positive, got {scale}")
        return Limits(self.low * scale, self.high * scale)

    def of_difference(self) -> Limits:
        """The limits of a difference of two values within these limits."""
        return Limits(self.low - self.high, self.high - self.low)


UNIT = Limits(0.0, 1.0)
NON_NEGATIVE = Limits(0.0, math.inf)

#: the limits of each metric, by the last part of its stable name
METRIC_LIMITS: dict[str, Limits] = {
    # rates, shares, areas under curves, calibration errors (CE² = Σ w_b (acc_b − conf_b)² <= 1)
    **dict.fromkeys(
        (
            "error",
            "accuracy",
            "global_acc",
            "miou",
            "iou",
            "ece",
            "adaptive_ece",
            "classwise_ece",
            "ce2",
            "auroc",
            "aupr",
            "aupr_in",
            "fpr95",
            "aurc",
            "eaurc",
            "augrc",
            "optimal_aurc",
            "risk@80",
            "coverage",
            "empty",
            "ssc",
            "class_coverage_min",
        ),
        UNIT,
    ),
    "brier": Limits(0.0, 2.0),  # Σ_c (p_c − y_c)² of one example
    # log-losses, entropies, set sizes, costs
    **dict.fromkeys(
        (
            "nll",
            "calibrated_nll",
            "entropy",
            "predictive_entropy",
            "expected_entropy",
            "mutual_information",
            "mean_entropy",
            "size",
            "params",
            "flops",
            "train_flops_per_image",
            "predict_flops_per_image",
            "n_samples",
            "epoch_seconds",
            "train_seconds",
            "peak_memory_mib",
        ),
        NON_NEGATIVE,
    ),
    # members of a deep ensemble: "no better than one network" is 1
    "deep_ensemble_equivalent": Limits(1.0, math.inf),
}


def limits_of(name: str | None, difference: bool = False, scale: float = 1.0) -> Limits:
    """The limits of the metric `name` (its stable name, or only its last part), times `scale`; of a
    difference of two such metrics with `difference`. Unknown or None: no limits."""
    if name is None:
        return Limits()
    parts = name.split("/")
    leaf = "iou" if len(parts) > 2 and parts[-2] == "iou" else parts[-1]
    limits = METRIC_LIMITS.get(leaf, Limits()).scaled(scale)
    return limits.of_difference() if difference else limits


class ShownInterval(NamedTuple):
    """An interval as the rule shows it: its bounds within the metric's limits, and whether it misses
    its estimate."""

    low: float
    high: float
    misses: bool


def shown_interval(
    name: str | None, estimate: float | None, low: float, high: float, difference: bool = False, scale: float = 1.0
) -> ShownInterval:
    """The interval [low, high] of `estimate` of the metric `name` (None: no limits) as the rule shows it
    (module docstring); `estimate` None (unknown): never flagged. All four in the same units: times
    `scale` with respect to the metric's own (an error in %: 100); a difference with `difference`."""
    limits = limits_of(name, difference, scale)
    low, high = limits.clip(float(low)), limits.clip(float(high))
    if estimate is None or any(math.isnan(v) for v in (float(estimate), low, high)):
        return ShownInterval(low, high, False)
    value = limits.clip(float(estimate))
    slack = 1e-12 * max(1.0, abs(value), abs(low), abs(high))  # the same number twice, rounded apart
    return ShownInterval(low, high, not low - slack <= value <= high + slack)
