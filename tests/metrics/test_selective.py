"""Tests for dbsn.metrics.selective: brute-force loops with ties, tie invariance, the oracle,
hand-worked values and the risk–coverage figure."""

import itertools
import math

import pytest
import torch
from scipy.integrate import quad

from dbsn.metrics.selective import (
    augrc,
    aurc,
    optimal_aurc,
    risk_at_coverage,
    risk_coverage_curve,
    risk_coverage_figure,
    selective_metrics,
)

SEEDS = range(6)


# ---------------------------------------------------------------- brute-force references
def brute_points(errors, uncertainty):
    """(coverage, #errors accepted / n) at each distinct threshold, by explicit loops."""
    errors, uncertainty = [float(e) for e in errors], [float(u) for u in uncertainty]
    n = len(errors)
    points = []
    for tau in sorted(set(uncertainty)):
        accepted = [i for i in range(n) if uncertainty[i] <= tau]
        points.append((len(accepted) / n, sum(errors[i] for i in accepted) / n))
    return points


def brute_generalized_risk(points, kappa):
    """g(κ): linear between (0, 0) and the threshold points, found by walking the segments."""
    previous = (0.0, 0.0)
    for point in points:
        if kappa <= point[0]:
            (a, g_a), (b, g_b) = previous, point
            return g_a + (g_b - g_a) * (kappa - a) / (b - a)
        previous = point
    raise AssertionError("coverage above 1")


def brute_aurc(errors, uncertainty):
    """∫_0^1 g(κ)/κ dκ by numerical quadrature, segment by segment (no closed form)."""
    points = brute_points(errors, uncertainty)
    total, left = 0.0, 0.0
    for right, _ in points:
        value, _ = quad(lambda k: brute_generalized_risk(points, k) / k, left, right, epsabs=1e-13, epsrel=1e-12)
        total += value
        left = right
    return total


def brute_augrc(errors, uncertainty):
    """Trapezoids over (0, 0) and the threshold points."""
    total, (a, g_a) = 0.0, (0.0, 0.0)
    for b, g_b in brute_points(errors, uncertainty):
        total += (b - a) * (g_a + g_b) / 2
        a, g_a = b, g_b
    return total


def random_case(seed, n=40, error_rate=0.3, decimals=1):
    """Errors and uncertainties rounded to `decimals` (so there are many ties)."""
    gen = torch.Generator().manual_seed(seed)
    errors = (torch.rand(n, generator=gen) < error_rate).double()
    # Errors somewhat more uncertain than right answers, so the ranking is neither perfect nor random.
    uncertainty = (torch.rand(n, generator=gen) + 0.4 * errors).clamp(max=1)
    return errors, torch.round(uncertainty * 10**decimals) / 10**decimals


# ---------------------------------------------------------------- agreement with the loops
@pytest.mark.parametrize("seed", SEEDS)
def test_curve_matches_brute_force_with_ties(seed):
    errors, uncertainty = random_case(seed)
    assert uncertainty.unique().numel() < uncertainty.numel() // 2  # the test is about ties
    coverage, risk = risk_coverage_curve(errors, uncertainty)
    points = brute_points(errors, uncertainty)
    assert coverage.numel() == len(points) == uncertainty.unique().numel()
    assert coverage.tolist() == pytest.approx([c for c, _ in points], abs=1e-15)
    assert risk.tolist() == pytest.approx([g / c for c, g in points], abs=1e-15)
    assert coverage[-1].item() == 1.0 and risk[-1].item() == pytest.approx(errors.mean().item())


@pytest.mark.parametrize("seed", SEEDS)
def test_areas_and_risk_at_coverage_match_brute_force_with_ties(seed):
    errors, uncertainty = random_case(seed)
    assert aurc(errors, uncertainty) == pytest.approx(brute_aurc(errors, uncertainty), abs=1e-10)
    assert augrc(errors, uncertainty) == pytest.approx(brute_augrc(errors, uncertainty), abs=1e-14)
    points = brute_points(errors, uncertainty)
    for kappa in (0.05, 0.5, 0.8, 0.9, 1.0):
        expected = brute_generalized_risk(points, kappa) / kappa
        assert risk_at_coverage(errors, uncertainty, kappa) == pytest.approx(expected, abs=1e-14)


@pytest.mark.parametrize("seed", SEEDS)
def test_without_ties_aurc_is_close_to_the_mean_selective_risk(seed):
    # Geifman & El-Yaniv's AURC is the mean of r(k/n) over k; ours integrates between the
    # same points and may differ by at most (H_n - 1)/n (module docstring; docs/evaluation.md).
    gen = torch.Generator().manual_seed(seed)
    n = 300
    errors = (torch.rand(n, generator=gen) < 0.2).double()
    uncertainty = torch.rand(n, generator=gen) + 0.3 * errors
    order = uncertainty.argsort()
    k = torch.arange(1, n + 1, dtype=torch.float64)
    geifman = (errors[order].cumsum(0) / k).mean().item()
    bound = (sum(1 / i for i in range(1, n + 1)) - 1) / n
    assert abs(aurc(errors, uncertainty) - geifman) <= bound
    # Without ties and with κ n whole, risk@κ is the error rate of the κ n most certain.
    assert risk_at_coverage(errors, uncertainty, 0.8) == pytest.approx(errors[order[:240]].mean().item(), abs=1e-14)


# ---------------------------------------------------------------- ties
def _tie_groups(uncertainty):
    return [torch.nonzero(uncertainty == value).flatten() for value in uncertainty.unique()]


def _all_metrics(errors, uncertainty):
    return [
        aurc(errors, uncertainty),
        augrc(errors, uncertainty),
        risk_at_coverage(errors, uncertainty, 0.8),
        *risk_coverage_curve(errors, uncertainty)[1].tolist(),
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_results_do_not_depend_on_the_order_of_tied_examples(seed):
    errors, uncertainty = random_case(seed)
    reference = _all_metrics(errors, uncertainty)
    gen = torch.Generator().manual_seed(100 + seed)
    # Shuffle which of the tied examples are the errors, group by group.
    shuffled = errors.clone()
    for group in _tie_groups(uncertainty):
        shuffled[group] = errors[group][torch.randperm(group.numel(), generator=gen)]
    assert not torch.equal(shuffled, errors)
    assert _all_metrics(shuffled, uncertainty) == pytest.approx(reference, abs=1e-14)
    # And reorder the whole data set.
    perm = torch.randperm(errors.numel(), generator=gen)
    assert _all_metrics(errors[perm], uncertainty[perm]) == pytest.approx(reference, abs=1e-14)


def test_tied_value_is_the_mean_over_all_ways_to_break_the_ties():
    # Groups of 3 and 2 tied examples: 3! * 2! = 12 ways to order them.
    errors = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    uncertainty = torch.tensor([0.2, 0.2, 0.2, 0.1, 0.5, 0.5, 0.3])
    groups = _tie_groups(uncertainty)
    broken = []
    for orders in itertools.product(*(itertools.permutations(g.tolist()) for g in groups)):
        distinct = uncertainty.clone().double()
        for order in orders:
            for position, index in enumerate(order):
                distinct[index] += 1e-3 * position
        assert distinct.unique().numel() == 7
        broken.append(_all_metrics(errors, distinct)[:3])
    assert len(broken) == 12
    mean = [sum(values) / len(broken) for values in zip(*broken)]
    assert _all_metrics(errors, uncertainty)[:3] == pytest.approx(mean, abs=1e-14)


def test_float32_scores_keep_their_ties_and_distinctions():
    errors = torch.tensor([0.0, 1.0, 1.0, 0.0])
    uncertainty = torch.tensor([0.3, 0.3, 0.3 + 3e-8, 0.9], dtype=torch.float32)
    assert uncertainty[2] != uncertainty[0]  # distinct in float32
    assert risk_coverage_curve(errors, uncertainty)[0].tolist() == pytest.approx([0.5, 0.75, 1.0])


# ---------------------------------------------------------------- oracle and worst ranking
@pytest.mark.parametrize("seed", SEEDS)
def test_oracle_ranking_has_zero_excess_aurc(seed):
    errors, _ = random_case(seed)
    gen = torch.Generator().manual_seed(seed)
    optimal = optimal_aurc(errors)
    assert optimal == pytest.approx(optimal_aurc(errors.mean().item()))
    # Oracle scores that tie (the errors themselves) and that do not.
    assert aurc(errors, errors) == pytest.approx(optimal, abs=1e-13)
    assert aurc(errors, errors + 0.5 * torch.rand(errors.numel(), generator=gen)) == pytest.approx(optimal, abs=1e-13)
    rate = errors.mean().item()
    assert augrc(errors, errors) == pytest.approx(rate**2 / 2, abs=1e-15)


@pytest.mark.parametrize("seed", SEEDS)
def test_no_ranking_beats_the_oracle_and_the_reverse_ranking_is_worst(seed):
    errors, uncertainty = random_case(seed)
    rate = errors.mean().item()
    optimal, ours, worst = optimal_aurc(errors), aurc(errors, uncertainty), aurc(errors, -errors)
    assert optimal - 1e-12 <= ours < worst
    # Errors first: risk 1 up to coverage e, then e/κ; the area is e - e ln e.
    assert worst == pytest.approx(rate - rate * math.log(rate), abs=1e-13)
    # A score with no information (all tied) has AURC = error rate, between the two.
    assert aurc(errors, torch.zeros_like(errors)) == pytest.approx(rate, abs=1e-15)
    assert optimal < rate < worst


def test_optimal_aurc_closed_form_and_edge_cases():
    assert optimal_aurc(0.5) == pytest.approx(0.5 + 0.5 * math.log(0.5))
    assert optimal_aurc(0.0) == 0.0
    assert optimal_aurc(1.0) == 1.0
    assert aurc(torch.ones(5), torch.arange(5.0)) == pytest.approx(1.0)
    assert aurc(torch.zeros(5), torch.arange(5.0)) == 0.0
    with pytest.raises(ValueError, match=r"error rate must be in \[0, 1\]"):
        optimal_aurc(1.5)


# ---------------------------------------------------------------- hand-worked examples
def test_hand_example_without_ties():
    # Accepting in order: right, wrong, right, wrong. Points κ = 1/4..1, g = 0, 1/4, 1/4, 1/2,
    # selective risk 0, 1/2, 1/3, 1/2.
    errors, uncertainty = torch.tensor([0, 1, 0, 1]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    coverage, risk = risk_coverage_curve(errors, uncertainty)
    assert coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert risk.tolist() == pytest.approx([0, 1 / 2, 1 / 3, 1 / 2])
    # Segments: [0, 1/4] -> 0; [1/4, 1/2] -> 1/4 - 1/4 ln 2; [1/2, 3/4] -> 1/4 ln(3/2);
    # [3/4, 1] -> 1/4 - 1/2 ln(4/3). Sum = 0.284238...
    expected = 0.5 - 0.25 * math.log(2) + 0.25 * math.log(1.5) - 0.5 * math.log(4 / 3)
    assert expected == pytest.approx(0.284238, abs=1e-6)
    assert aurc(errors, uncertainty) == pytest.approx(expected, abs=1e-15)
    # Trapezoids: 0 + 1/4 * 1/8 + 1/4 * 1/4 + 1/4 * 3/8 = 3/16.
    assert augrc(errors, uncertainty) == pytest.approx(3 / 16, abs=1e-15)
    # κ = 0.8 is 1/5 of the way through the last segment: g = 1/4 + 1/20 = 0.3, risk 0.3/0.8.
    assert risk_at_coverage(errors, uncertainty, 0.8) == pytest.approx(0.375, abs=1e-15)
    assert risk_at_coverage(errors, uncertainty, 0.75) == pytest.approx(1 / 3, abs=1e-15)


def test_hand_example_with_ties():
    # Uncertainty 0.1: {right, wrong}; 0.2: {right, right, wrong, wrong}. Points:
    # κ = 1/3, g = 1/6 (risk 1/2), and κ = 1, g = 1/2 (risk 1/2).
    errors = torch.tensor([0, 1, 0, 0, 1, 1])
    uncertainty = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
    coverage, risk = risk_coverage_curve(errors, uncertainty)
    assert coverage.tolist() == pytest.approx([1 / 3, 1.0])
    assert risk.tolist() == pytest.approx([0.5, 0.5])
    # g = κ/2 on both segments (the line through (0, 0), (1/3, 1/6), (1, 1/2)): risk 1/2 everywhere.
    assert aurc(errors, uncertainty) == pytest.approx(0.5, abs=1e-15)
    assert augrc(errors, uncertainty) == pytest.approx(0.25, abs=1e-15)
    assert risk_at_coverage(errors, uncertainty, 0.8) == pytest.approx(0.5, abs=1e-15)
    # Two tied right answers, then two tied errors: the oracle. g = 0 up to κ = 1/2, then
    # rises linearly to 1/2: ∫_{1/2}^1 (1 - 1/(2κ)) dκ = 1/2 + 1/2 ln(1/2).
    errors2, uncertainty2 = torch.tensor([0, 0, 1, 1]), torch.tensor([0.05, 0.05, 0.2, 0.2])
    assert aurc(errors2, uncertainty2) == pytest.approx(0.5 + 0.5 * math.log(0.5), abs=1e-15)


# ---------------------------------------------------------------- the named dict
def test_selective_metrics_names_and_max_probability_is_a_confidence():
    errors, uncertainty = random_case(3)
    confidence = 1 - uncertainty
    out = selective_metrics(errors, {"max_probability": confidence, "predictive_entropy": uncertainty})
    names = {"selective/optimal_aurc"} | {
        f"selective/{s}/{m}"
        for s in ("max_probability", "predictive_entropy")
        for m in ("aurc", "eaurc", "augrc", "risk@80")
    }
    assert set(out) == names
    assert all(isinstance(v, float) for v in out.values())
    # The confidence is turned into the same ranking as the uncertainty it came from.
    for m in ("aurc", "eaurc", "augrc", "risk@80"):
        assert out[f"selective/max_probability/{m}"] == pytest.approx(
            out[f"selective/predictive_entropy/{m}"], abs=1e-14
        )
    assert out["selective/predictive_entropy/aurc"] == pytest.approx(aurc(errors, uncertainty), abs=1e-15)
    assert out["selective/predictive_entropy/eaurc"] == pytest.approx(
        aurc(errors, uncertainty) - optimal_aurc(errors), abs=1e-15
    )
    assert out["selective/optimal_aurc"] == optimal_aurc(errors)
    # Any other name is an uncertainty: the same values under "max_probability" rank backwards.
    flipped = selective_metrics(errors, {"max_probability": uncertainty})
    assert flipped["selective/max_probability/aurc"] > out["selective/predictive_entropy/aurc"]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="0/1"):
        aurc(torch.tensor([0.0, 0.5]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="2 values for 3"):
        aurc(torch.tensor([0, 1, 0]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="non-finite"):
        augrc(torch.tensor([0, 1]), torch.tensor([0.1, float("nan")]))
    with pytest.raises(ValueError, match="empty"):
        aurc(torch.tensor([]), torch.tensor([]))
    with pytest.raises(ValueError, match="coverage"):
        risk_at_coverage(torch.tensor([0, 1]), torch.tensor([0.1, 0.2]), 0.0)


# ---------------------------------------------------------------- figure
def test_figure_has_one_curve_per_score_and_the_oracle(tmp_path):
    from dbsn.evaluation.plots import save_figure

    errors, uncertainty = random_case(1)
    gen = torch.Generator().manual_seed(1)
    scores = {
        "predictive_entropy": uncertainty,
        "mutual_information": torch.rand(errors.numel(), generator=gen),
        "max_probability": 1 - uncertainty,
    }
    fig = risk_coverage_figure(errors, scores)
    ax = fig.axes[0]
    assert len(ax.lines) == len(scores) + 1
    labels = [line.get_label() for line in ax.lines]
    for label, (name, _) in zip(labels, scores.items()):
        assert (
            label.startswith(name)
            and f"{aurc(errors, uncertainty if name != 'mutual_information' else scores[name]):.4f}" in label
        )
    assert labels[-1].startswith("oracle") and f"{optimal_aurc(errors):.4f}" in labels[-1]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == labels
    assert "Coverage" in ax.get_xlabel() and "risk" in ax.get_ylabel()
    # Every curve ends at coverage 1 with the overall error rate.
    rate = errors.mean().item()
    for line in ax.lines:
        assert line.get_xdata()[-1] == pytest.approx(1.0) and line.get_ydata()[-1] == pytest.approx(rate)
    assert save_figure(fig, tmp_path / "rc.png").stat().st_size > 0
