"""Bootstrap intervals over test examples, every resample at once.

A bootstrap resample of n test examples is a vector of counts c (how often each example was
drawn; Σ c = n). Every metric here is a statistic of per-example quantities weighted by those
counts, so B resamples are one (B, n) count matrix and each metric is computed for all of them
together (matrix products, cumulative sums, batched searches) instead of in a loop over
resamples. A metric at counts c equals the same metric on the data set that repeats example i
c_i times (tested), and at c = 1 it equals the plain metric of `classification` and
`calibration` (tested). Two methods scored with the same count matrix give a paired bootstrap:
the interval of their difference (`paired_interval`).

Intervals are percentile intervals (Efron & Tibshirani 1993, ch. 13) of `resamples` seeded
resamples. A percentile interval is only as good as the statistic is unbiased under resampling:
the plug-in ECEs (`weighted_ece` and its equal-mass and classwise kin) are biased upward by an
amount that grows as the bins empty, so their intervals miss the truth of a calibrated model and
can even miss their own estimate. `weighted_squared_calibration_error` is unbiased, but a
U-statistic whose percentile interval is too wide near 0 (where it is degenerate): CE²'s interval
and paired test are `ce2_inference`'s, from the U-statistic's own variance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dbsn.metrics.binning import bin_index

__all__ = [
    "Interval",
    "resample_counts",
    "percentile_interval",
    "bootstrap",
    "paired_interval",
    "weighted_error",
    "weighted_nll",
    "weighted_brier",
    "weighted_ece",
    "weighted_squared_calibration_error",
    "weighted_adaptive_ece",
    "weighted_classwise_ece",
    "weighted_auroc",
    "weighted_average_precision",
    "weighted_fpr95",
    "weighted_selective",
]


@dataclass(frozen=True)
class Interval:
    """A value with its bootstrap interval at `level` (e.g. 0.95)."""

    value: float
    low: float
    high: float
    level: float

    def excludes(self, x: float = 0.0) -> bool:
        """Whether `x` lies outside the interval (for a difference: distinguishable from no difference)."""
        return not (self.low <= x <= self.high)


def resample_counts(n: int, resamples: int = 1000, seed: int = 0) -> Tensor:
    """(resamples, n) float counts: row b says how often each of the n examples is drawn in
    bootstrap resample b (n draws with replacement). Seeded: the same seed, the same rows."""
    if n < 1 or resamples < 1:
        raise ValueError(f"need n >= 1 examples and resamples >= 1, got n={n}, resamples={resamples}")
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(n, (resamples, n), generator=generator)
    counts = torch.zeros(resamples, n, dtype=torch.float64)
    return counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))


def percentile_interval(value: float, samples: Tensor, level: float = 0.95) -> Interval:
    """The percentile interval of a statistic's bootstrap `samples` around its `value`."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    samples = samples.detach().double().flatten()
    low, high = torch.quantile(samples, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return Interval(float(value), float(low), float(high), level)


def bootstrap(
    metric: Callable[[Tensor], Tensor], n: int, resamples: int = 1000, level: float = 0.95, seed: int = 0
) -> Interval:
    """`metric(weights)` -> (B,) values for a (B, n) weight matrix; its value at unit weights and
    its percentile interval over `resamples` seeded resamples."""
    value = metric(torch.ones(1, n, dtype=torch.float64))[0]
    return percentile_interval(float(value), metric(resample_counts(n, resamples, seed)), level)


def paired_interval(
    metric_a: Callable[[Tensor], Tensor],
    metric_b: Callable[[Tensor], Tensor],
    n: int,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The interval of `metric_a - metric_b`, both computed on the same resamples of the same n
    test examples (a paired bootstrap: the noise the two share cancels)."""
    ones = torch.ones(1, n, dtype=torch.float64)
    counts = resample_counts(n, resamples, seed)
    value = float(metric_a(ones)[0] - metric_b(ones)[0])
    return percentile_interval(value, metric_a(counts) - metric_b(counts), level)


# --- weighted metrics: weights (B, n), one row per resample --------------------------------


def _weights(weights: Tensor, n: int) -> Tensor:
    weights = torch.as_tensor(weights, dtype=torch.float64)
    weights = weights.unsqueeze(0) if weights.ndim == 1 else weights
    if weights.ndim != 2 or weights.shape[1] != n:
        raise ValueError(f"weights must be (B, {n}) (one row per resample), got {tuple(weights.shape)}")
    return weights


def _mean(per_example: Tensor, weights: Tensor) -> Tensor:
    weights = _weights(weights, per_example.shape[0])
    return weights @ per_example.double() / weights.sum(1)


def weighted_error(probs: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """(B,) error rates of the argmax of `probs` (N, C)."""
    return _mean((probs.argmax(1) != target).double(), weights)


def weighted_nll(log_probs: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """(B,) mean negative log-likelihoods of `log_probs` (N, C)."""
    return _mean(-log_probs.double().gather(1, target[:, None]).squeeze(1), weights)


def weighted_brier(probs: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """(B,) Brier scores, summed over classes as `classification.brier_score`."""
    one_hot = torch.nn.functional.one_hot(target, probs.shape[1]).double()
    return _mean(((probs.double() - one_hot) ** 2).sum(1), weights)


def _group_sums(weights: Tensor, group: Tensor, groups: int) -> Tensor:
    """(B, groups): each row's weights summed within groups (O(B n) memory, no one-hot matrix)."""
    return torch.zeros(weights.shape[0], groups, dtype=torch.float64).index_add_(1, group, weights)


def _binned_gap(confidence: Tensor, correct: Tensor, weights: Tensor, n_bins: int) -> Tensor:
    """Σ_b |Σ_{i in b} w_i (correct_i - confidence_i)| / Σ w over equal-width bins closed on
    the left, the last closed so that a confidence of exactly 1 falls in it (`dbsn.metrics.binning`,
    the bins of `expected_calibration_error` and of the reliability diagram)."""
    members = torch.nn.functional.one_hot(bin_index(confidence, n_bins), n_bins).double()  # (n, bins)
    gap = weights @ (members * (correct - confidence).double()[:, None])  # (B, bins)
    return gap.abs().sum(1) / weights.sum(1)


def weighted_ece(probs: Tensor, target: Tensor, weights: Tensor, n_bins: int = 15) -> Tensor:
    """(B,) top-label ECE over equal-width bins (`classification.expected_calibration_error`)."""
    confidence, prediction = probs.max(1)
    return _binned_gap(confidence, (prediction == target).to(probs.dtype), _weights(weights, len(target)), n_bins)


def weighted_squared_calibration_error(probs: Tensor, target: Tensor, weights: Tensor, n_bins: int = 15) -> Tensor:
    """(B,) the unbiased estimate of the squared top-label calibration error over equal-width bins
    (`calibration.squared_calibration_error`) of the resampled sets, as a U-statistic over pairs of
    distinct test examples: with w_i copies of example i, d = correct − confidence, and over bin b
    S_b = Σ w_i d_i, T_b = Σ w_i² d_i², n_b = Σ w_i, M_b = Σ w_i², bin b's mean of d_i d_j over the
    pairs of copies of two different examples is (S_b² − T_b) / (n_b² − M_b); weighted by n_b / Σ w.
    At unit weights it is the plain estimate. Pairs of copies of one example are left out: they
    would add d_i² > 0 to every resample and move the resampled values off a calibrated model's 0.
    Even so, its percentile interval is too wide near 0 (module docstring): intervals and tests of
    CE² come from `ce2_inference`."""
    confidence, prediction = probs.max(1)
    weights = _weights(weights, len(target))
    d = (prediction == target).double() - confidence.double()
    members = torch.nn.functional.one_hot(bin_index(confidence, n_bins), n_bins).double()  # (n, bins)
    squared = weights**2
    n_b, s_b = weights @ members, weights @ (members * d[:, None])
    t_b, m_b = squared @ (members * (d**2)[:, None]), squared @ members
    pairs = n_b**2 - m_b
    per_bin = torch.where(pairs > 0, n_b * (s_b**2 - t_b) / pairs.clamp_min(1e-300), torch.zeros_like(n_b))
    return per_bin.sum(1) / weights.sum(1)


def weighted_classwise_ece(probs: Tensor, target: Tensor, weights: Tensor, n_bins: int = 15) -> Tensor:
    """(B,) classwise ECE (`calibration.classwise_expected_calibration_error`): the mean over
    classes k of the equal-width ECE of p_k against the indicator of label k."""
    weights = _weights(weights, len(target))
    per_class = [
        _binned_gap(probs[:, k].contiguous(), (target == k).to(probs.dtype), weights, n_bins)
        for k in range(probs.shape[1])
    ]
    return torch.stack(per_class).mean(0)


def weighted_adaptive_ece(probs: Tensor, target: Tensor, weights: Tensor, n_bins: int = 15) -> Tensor:
    """(B,) top-label ECE over equal-mass bins (`calibration.adaptive_expected_calibration_error`)
    of the resampled set: its Σw copies in order of confidence, Σw / n_bins to a bin, tied
    confidences sharing their mean correctness.

    Each group g of tied confidences v_g holds W_g copies (its examples' counts) with mean
    correctness A_g / W_g, so each of its copies adds A_g / W_g - v_g to the bin its position
    falls in. G(q), the sum of that over the first q positions, is piecewise linear in q, and a
    bin's sum is G(end) - G(start): batched searches over the cumulative counts."""
    confidence, prediction = probs.max(1)
    correct = (prediction == target).double()
    weights = _weights(weights, len(target))
    values, group = torch.unique(confidence, return_inverse=True)  # groups in increasing confidence
    count = _group_sums(weights, group, len(values))  # (B, G) copies per group
    hits = _group_sums(weights * correct, group, len(values))  # (B, G) correct copies per group
    per_copy = torch.where(count > 0, hits / count.clamp_min(1e-300) - values.double(), torch.zeros_like(count))
    ends = count.cumsum(1)  # position after each group's last copy
    gap_ends = (per_copy * count).cumsum(1)  # G at those positions
    total = ends[:, -1:]

    def cumulative_gap(q: Tensor) -> Tensor:  # G(q) for (B, k) positions q
        g = torch.searchsorted(ends, q, right=True).clamp_max(ends.shape[1] - 1)  # the group holding position q
        before = torch.where(g > 0, ends.gather(1, (g - 1).clamp_min(0)), torch.zeros_like(q))
        gap_before = torch.where(g > 0, gap_ends.gather(1, (g - 1).clamp_min(0)), torch.zeros_like(q))
        return gap_before + per_copy.gather(1, g) * (q - before).clamp_min(0)

    # position p goes to bin floor(p * n_bins / total): bin b holds positions ceil(b * total / n_bins) ...
    bounds = torch.ceil(torch.arange(n_bins + 1, dtype=torch.float64) * total / n_bins - 1e-9)
    sums = cumulative_gap(bounds)
    return (sums[:, 1:] - sums[:, :-1]).abs().sum(1) / total.squeeze(1)


def weighted_auroc(scores_in: Tensor, scores_out: Tensor, weights_in: Tensor, weights_out: Tensor) -> Tensor:
    """(B,) AUROC of telling the `scores_out` set (positive: scored higher) from `scores_in`,
    each set resampled with its own weights: P(out > in) + P(out = in) / 2 over weighted pairs."""
    weights_in, weights_out = _weights(weights_in, len(scores_in)), _weights(weights_out, len(scores_out))
    values, inverse = torch.unique(torch.cat([scores_in, scores_out]).double(), return_inverse=True)
    w_in = _group_sums(weights_in, inverse[: len(scores_in)], len(values))  # (B, G) weight at each distinct score
    w_out = _group_sums(weights_out, inverse[len(scores_in) :], len(values))
    below = w_in.cumsum(1) - w_in  # in-distribution weight strictly below each value
    pairs = (w_out * (below + w_in / 2)).sum(1)
    return pairs / (w_in.sum(1) * w_out.sum(1))


def _ranked_sums(
    scores_in: Tensor, scores_out: Tensor, weights_in: Tensor, weights_out: Tensor
) -> tuple[Tensor, Tensor]:
    """(B, G) weight of the in- and out-sets at each distinct score, in DEcreasing score order."""
    weights_in, weights_out = _weights(weights_in, len(scores_in)), _weights(weights_out, len(scores_out))
    values, inverse = torch.unique(torch.cat([scores_in, scores_out]).double(), return_inverse=True)
    inverse = len(values) - 1 - inverse  # the highest score first
    return (
        _group_sums(weights_in, inverse[: len(scores_in)], len(values)),
        _group_sums(weights_out, inverse[len(scores_in) :], len(values)),
    )


def weighted_average_precision(
    scores_in: Tensor, scores_out: Tensor, weights_in: Tensor, weights_out: Tensor
) -> Tensor:
    """(B,) average precision with the out-set positive (`ood.detection_metrics`' AUPR):
    Σ_k (R_k - R_{k-1}) P_k over the distinct thresholds, highest first. For the AUPR with the
    in-set positive, pass the negated scores with the sets swapped."""
    w_in, w_out = _ranked_sums(scores_in, scores_out, weights_in, weights_out)
    tp, fp = w_out.cumsum(1), w_in.cumsum(1)
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1e-300), torch.zeros_like(tp))
    return (w_out * precision).sum(1) / w_out.sum(1)


def weighted_fpr95(scores_in: Tensor, scores_out: Tensor, weights_in: Tensor, weights_out: Tensor) -> Tensor:
    """(B,) the in-set share flagged at the first threshold, from the highest score down, where
    at least 95 % of the out-set is flagged (`ood.detection_metrics`' FPR95, OOD positive)."""
    w_in, w_out = _ranked_sums(scores_in, scores_out, weights_in, weights_out)
    tp, fp = w_out.cumsum(1), w_in.cumsum(1)
    # 20 TP >= 19 P, as the plain metric's exact integer test (counts are whole numbers)
    reached = 20 * tp >= 19 * tp[:, -1:] - 1e-9
    first = reached.double().argmax(1, keepdim=True)
    return fp.gather(1, first).squeeze(1) / fp[:, -1]


def weighted_selective(
    errors: Tensor, uncertainty: Tensor, weights: Tensor, coverage: float = 0.8
) -> dict[str, Tensor]:
    """(B,) AURC, E-AURC, AUGRC and selective risk at `coverage` (`selective.selective_metrics`,
    ties accepted together, the exact integrals of `selective.aurc` / `augrc`) of the resampled
    sets: the threshold points are the distinct uncertainties, each carrying its examples' counts
    (a value no resample draws makes a segment of length zero, which adds nothing)."""
    weights = _weights(weights, len(errors))
    values, group = torch.unique(uncertainty.double(), return_inverse=True)  # ascending: most certain first
    total = weights.sum(1, keepdim=True)
    b = _group_sums(weights, group, len(values)).cumsum(1) / total  # coverage at each threshold
    g_b = _group_sums(weights * errors.double(), group, len(values)).cumsum(1) / total  # generalized risk
    a, g_a = torch.nn.functional.pad(b[:, :-1], (1, 0)), torch.nn.functional.pad(g_b[:, :-1], (1, 0))
    length = b - a
    safe = torch.where(length > 0, length, torch.ones_like(length))
    intercept = torch.where(length > 0, (g_a * b - g_b * a) / safe, torch.zeros_like(length))
    log_ratio = torch.where(
        (a > 0) & (length > 0), torch.log(b / torch.where(a > 0, a, b).clamp_min(1e-300)), torch.zeros_like(a)
    )
    aurc = ((g_b - g_a) + intercept * log_ratio).sum(1)
    augrc = (length * (g_a + g_b) / 2).sum(1)
    rate = g_b[:, -1]
    optimal = rate + torch.where(rate < 1, (1 - rate) * torch.log((1 - rate).clamp_min(1e-300)), torch.zeros_like(rate))
    target = torch.full((len(b), 1), float(coverage), dtype=torch.float64)
    j = torch.searchsorted(b.contiguous(), target).clamp_max(b.shape[1] - 1)
    a_j, b_j, ga_j, gb_j = (t.gather(1, j) for t in (a, b, g_a, g_b))
    g = ga_j + (gb_j - ga_j) * (target - a_j) / (b_j - a_j).clamp_min(1e-300)
    return {
        "aurc": aurc,
        "eaurc": aurc - optimal,
        "augrc": augrc,
        "risk@80": (g / target).squeeze(1),
        "optimal_aurc": optimal,
    }
