"""Selective prediction: how well an uncertainty score ranks a classifier's errors.

A selective classifier accepts the examples whose ``uncertainty`` (HIGHER = LESS certain) is at
most a threshold τ and abstains on the rest. With per-example ``errors`` (1 = wrong): the coverage
``κ(τ)`` (the share accepted), the selective risk ``r(τ)`` (the error rate among the accepted;
Geifman & El-Yaniv 2017) and the generalized risk ``g(τ) = κ(τ) r(τ)`` (accepted and wrong; Traub
et al. 2024, NeurIPS).

Ties are accepted together: the curve has one point per DISTINCT uncertainty, and the accepted
errors grow linearly between points, so every number is its expectation over random tie-breaking
(as Traub et al.'s ``fd-shifts`` ``RiskCoverageStats``). AURC ``= ∫_0^1 r(κ) dκ`` is integrated
exactly on each segment (a logarithm, see `aurc`); without ties it differs from Geifman &
El-Yaniv's mean ``1/n Σ_k r(k/n)`` by at most ``(H_n - 1) / n ≤ ln(n) / n``, and in exchange the
oracle scores exactly `optimal_aurc` whether or not its scores tie. AUGRC ``= ∫_0^1 g(κ) dκ``,
the trapezoid rule, exact for the linear ``g``.

``max_probability`` is a confidence, which `selective_metrics` negates (not ``1 - p``, which can
merge distinct float32 confidences). The ``max_probability`` of
`dbsn.metrics.uncertainty.detection_scores` is already ``1 - p``: do not pass that dict here.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

__all__ = [
    "CONFIDENCE_SCORES",
    "score_as_uncertainty",
    "augrc",
    "aurc",
    "optimal_aurc",
    "risk_at_coverage",
    "risk_coverage_curve",
    "risk_coverage_figure",
    "selective_metrics",
]

CONFIDENCE_SCORES = frozenset({"max_probability"})
"""Score names that are confidences (higher = more certain); every other score is an uncertainty."""


def _as_errors(errors: Tensor) -> Tensor:
    """Flat float64 0/1 tensor; ValueError if empty or not binary."""
    errors = torch.as_tensor(errors).detach().cpu().flatten().double()
    if errors.numel() == 0:
        raise ValueError("errors is empty: need at least one example")
    if not bool(((errors == 0) | (errors == 1)).all()):
        raise ValueError("errors must be 0/1 (1 = wrong prediction)")
    return errors


def _as_uncertainty(uncertainty: Tensor, n: int) -> Tensor:
    """Flat float64 tensor of n finite scores (float32 -> float64 is exact: no new ties)."""
    uncertainty = torch.as_tensor(uncertainty).detach().cpu().flatten().double()
    if uncertainty.numel() != n:
        raise ValueError(f"uncertainty has {uncertainty.numel()} values for {n} errors")
    bad = int((~torch.isfinite(uncertainty)).sum())
    if bad:
        raise ValueError(f"uncertainty has {bad} non-finite value(s) (NaN or ±inf) out of {n}")
    return uncertainty


def _threshold_points(errors: Tensor, uncertainty: Tensor) -> tuple[Tensor, Tensor]:
    """Coverage ``κ_j`` and generalized risk ``g_j`` at each distinct uncertainty, ascending.

    Point ``j`` accepts every example with uncertainty ≤ the j-th smallest distinct value;
    the last point has coverage 1. Within a tie group the sort order is arbitrary, but only
    the cumulative sums at group ends are read, and those do not depend on it.
    """
    errors = _as_errors(errors)
    uncertainty = _as_uncertainty(uncertainty, errors.numel())
    n = errors.numel()
    sorted_u, order = torch.sort(uncertainty)
    accepted_errors = errors[order].cumsum(0)
    _, counts = torch.unique_consecutive(sorted_u, return_counts=True)
    ends = counts.cumsum(0) - 1
    return (ends + 1).double() / n, accepted_errors[ends] / n


def _segments(coverage: Tensor, generalized_risk: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Left/right coverage and generalized risk of each segment, the first from (0, 0)."""
    zero = coverage.new_zeros(1)
    return torch.cat([zero, coverage[:-1]]), coverage, torch.cat([zero, generalized_risk[:-1]]), generalized_risk


def risk_coverage_curve(errors: Tensor, uncertainty: Tensor) -> tuple[Tensor, Tensor]:
    """The risk–coverage curve: (coverage, selective risk), one point per distinct threshold.

    ``errors`` (N,) is 1 where the prediction is wrong; ``uncertainty`` (N,) is higher where
    the model is less certain. Examples are accepted in order of increasing uncertainty,
    tied examples together (module docstring). Returns two float64 tensors of the same
    length (the number of distinct uncertainties), coverage increasing to 1.
    """
    coverage, generalized_risk = _threshold_points(errors, uncertainty)
    return coverage, generalized_risk / coverage


def aurc(errors: Tensor, uncertainty: Tensor) -> float:
    """Area under the risk–coverage curve (Geifman & El-Yaniv, 2017); lower is better.

    ``∫_0^1 g(κ)/κ dκ`` with the generalized risk ``g`` linear between threshold points
    (module docstring). On a segment from ``(a, g_a)`` to ``(b, g_b)`` with ``a > 0``:
    ``∫_a^b g/κ dκ = (g_b - g_a) + (g_a b - g_b a)/(b - a) · ln(b/a)``; the first segment,
    from (0, 0), contributes ``g_1`` (risk constant ``r_1`` over ``[0, κ_1]``).
    """
    a, b, g_a, g_b = _segments(*_threshold_points(errors, uncertainty))
    intercept = (g_a * b - g_b * a) / (b - a)  # g(κ) = intercept + slope · κ on the segment
    log_ratio = torch.where(a > 0, torch.log(b / torch.where(a > 0, a, b)), 0.0)
    return ((g_b - g_a) + intercept * log_ratio).sum().item()


def augrc(errors: Tensor, uncertainty: Tensor) -> float:
    """Area under the generalized risk–coverage curve (Traub et al., 2024); lower is better.

    ``∫_0^1 g(κ) dκ`` by the trapezoid rule over the threshold points and ``(0, 0)``, exact
    for ``g`` linear between the points. It is the probability of a silent failure (an
    example accepted and wrong) averaged over coverage; unlike the AURC it does not let the
    few most certain examples, where the selective risk is a ratio of small counts, weigh
    as much as the rest.
    """
    a, b, g_a, g_b = _segments(*_threshold_points(errors, uncertainty))
    return ((b - a) * (g_a + g_b) / 2).sum().item()


def risk_at_coverage(errors: Tensor, uncertainty: Tensor, coverage: float = 0.8) -> float:
    """Selective risk when accepting exactly the ``coverage`` share of most certain examples.

    ``g(κ*) / κ*`` with ``g`` linear between threshold points: when the cut falls inside a
    tie group (or between two whole-example counts), this is the expected error rate among
    the accepted when just enough of the group is accepted, at random, to reach ``κ*``. So
    every score is compared at the same coverage, however coarse its ties. Without ties and
    with ``κ* n`` whole, it is the error rate of the ``κ* n`` most certain examples.
    """
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    a, b, g_a, g_b = _segments(*_threshold_points(errors, uncertainty))
    target = torch.tensor([coverage], dtype=b.dtype)
    # First segment whose right end reaches the target (ends are ascending and the last is 1).
    j = torch.searchsorted(b, target).clamp(max=b.numel() - 1)
    g = g_a[j] + (g_b[j] - g_a[j]) * (target - a[j]) / (b[j] - a[j])
    return (g / target).item()


def optimal_aurc(errors: Tensor | float) -> float:
    """AURC of the oracle that accepts every correct example before any wrong one.

    ``errors`` is the 0/1 error tensor or the error rate ``e``. With the integration of
    :func:`aurc` the oracle's risk is 0 up to coverage ``1 - e`` and ``1 - (1 - e)/κ``
    after, so ``AURC* = e + (1 - e) ln(1 - e)`` (Geifman et al., 2019, "Bias-Reduced
    Uncertainty Estimation for Deep Neural Classifiers", ICLR), whether or not the oracle's
    scores tie. No ranking has a smaller :func:`aurc`, so ``aurc - optimal_aurc ≥ 0``.
    """
    if isinstance(errors, (int, float)):
        rate = float(errors)
        if not 0 <= rate <= 1:
            raise ValueError(f"error rate must be in [0, 1], got {rate}")
    else:
        rate = _as_errors(errors).mean().item()
    correct = 1 - rate
    return rate + (correct * math.log(correct) if correct > 0 else 0.0)


def score_as_uncertainty(name: str, score: Tensor) -> Tensor:
    """The score as an uncertainty: confidences (:data:`CONFIDENCE_SCORES`) negated."""
    score = torch.as_tensor(score).detach()
    return -score if name in CONFIDENCE_SCORES else score


def selective_metrics(errors: Tensor, scores: dict[str, Tensor]) -> dict[str, float]:
    """Selective-prediction metrics of each score, under stable names.

    ``errors`` (N,) is 1 where the prediction is wrong; ``scores`` maps a score name to its
    per-example values (N,), as in
    :func:`~dbsn.metrics.uncertainty.uncertainty_decomposition`; names in
    :data:`CONFIDENCE_SCORES` are confidences and are negated, all others are
    uncertainties. Returns, for each score ``<s>``:

    * ``selective/<s>/aurc``: :func:`aurc`;
    * ``selective/<s>/eaurc``: excess AURC, ``aurc - optimal_aurc`` (≥ 0; 0 for the oracle);
    * ``selective/<s>/augrc``: :func:`augrc`;
    * ``selective/<s>/risk@80``: :func:`risk_at_coverage` at coverage 0.8;

    and ``selective/optimal_aurc``, which depends only on the error rate.
    """
    errors = _as_errors(errors)
    optimal = optimal_aurc(errors)
    out = {"selective/optimal_aurc": optimal}
    for name, score in scores.items():
        uncertainty = score_as_uncertainty(name, score)
        area = aurc(errors, uncertainty)
        out[f"selective/{name}/aurc"] = area
        out[f"selective/{name}/eaurc"] = area - optimal
        out[f"selective/{name}/augrc"] = augrc(errors, uncertainty)
        out[f"selective/{name}/risk@80"] = risk_at_coverage(errors, uncertainty, 0.8)
    return out


def risk_coverage_figure(errors: Tensor, scores: dict[str, Tensor], title: str | None = None) -> Figure:
    """Risk–coverage curves of several scores and of the oracle, on one axes.

    ``errors`` and ``scores`` are as for :func:`selective_metrics`. In ``fig.axes[0]`` the
    first ``len(scores)`` lines are the scores' curves, in order, through their threshold
    points (:func:`risk_coverage_curve`) and starting at coverage 0 with the first point's
    risk; the last line is the oracle, ``max(0, 1 - (1 - e)/κ)``. Each legend entry gives the
    AURC. A good score's curve stays low at low coverage and hugs the oracle.
    Save it with :func:`dbsn.evaluation.plots.save_figure`.
    """
    errors = _as_errors(errors)
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    ax = fig.subplots()
    top = 0.0
    for name, score in scores.items():
        uncertainty = score_as_uncertainty(name, score)
        coverage, risk = risk_coverage_curve(errors, uncertainty)
        x = np.concatenate([[0.0], coverage.numpy()])
        y = np.concatenate([risk[:1].numpy(), risk.numpy()])
        top = max(top, float(y.max()))
        ax.plot(x, y, label=f"{name} (AURC {aurc(errors, uncertainty):.4f})")

    rate = errors.mean().item()
    kappa = np.concatenate([[0.0], np.linspace(1 - rate, 1, 200)])
    oracle = np.clip(1 - (1 - rate) / np.maximum(kappa, 1e-12), 0, None)
    ax.plot(kappa, oracle, color="black", linestyle="--", label=f"oracle (AURC {optimal_aurc(rate):.4f})")

    ax.set(
        xlim=(0, 1),
        ylim=(0, max(1.05 * top, 1.05 * rate, 1e-3)),
        xlabel="Coverage (share of examples accepted)",
        ylabel="Selective risk (error rate of accepted)",
        title=title if title is not None else "Risk–coverage curves",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return fig
