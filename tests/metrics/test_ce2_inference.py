"""Inference for CE² (dbsn.metrics.ce2_inference): the grouped second-order sum is the double loop
it replaces, the variance formula is the Monte Carlo variance, and, in simulations of predictors
whose calibration is known, the per-run interval covers the truth, the paired test holds its size
where both methods are calibrated and where both are equally miscalibrated, and its power is that
of the exact-level test of the same null; the report and metrics.json use these."""

from __future__ import annotations

import math

import pytest
import torch

from dbsn.metrics.calibration import squared_calibration_error
from dbsn.metrics.ce2_inference import (
    ce2_difference_covariance,
    covariance,
    first_order_covariance,
    paired_test,
    score_interval,
    second_order_covariance,
    shape_gram,
    top_label_gaps,
)

CLASSES, BINS = 10, 15


# ---------------------------------------------------------------------- predictors of known calibration
def _confidence(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """Top-label confidences: "spread" uniform on [0.2, 1]; "confident" 1 − 0.5 u³ (most near 1)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return 0.2 + 0.8 * u if kind == "spread" else 1 - 0.5 * u**3


def _probs(confidence: torch.Tensor, right: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(n, C) probabilities: `confidence` on the target where `right`, else on another class; the
    rest spread evenly (the top label is the one given: every confidence here is above 1 / C)."""
    n = len(target)
    predicted = torch.where(right, target, (target + 1 + torch.arange(n) % (CLASSES - 1)) % CLASSES)
    probs = ((1 - confidence) / (CLASSES - 1))[:, None].repeat(1, CLASSES)
    probs[torch.arange(n), predicted] = confidence
    return probs


def _draw(
    n: int, generator: torch.Generator, kinds: tuple[str, ...], gaps: tuple[float, ...], coupling: float = 0.0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Predictors on the same n test examples, [(confidence, right)] and the targets: predictor p's
    confidence c has kind `kinds[p]` and is right with probability c − `gaps[p]`, so its CE² is
    gaps[p]² exactly (every bin has the same gap). Each is right when u < c − gap, u uniform: with
    probability `coupling` the example's u shared by all predictors (their errors go together), else
    its own."""
    target = torch.randint(CLASSES, (n,), generator=generator)
    shared = torch.rand(n, generator=generator, dtype=torch.float64)
    out = []
    for kind, gap in zip(kinds, gaps):
        c = _confidence(kind, n, generator)
        own = torch.rand(n, generator=generator, dtype=torch.float64)
        u = torch.where(torch.rand(n, generator=generator) < coupling, shared, own)
        out.append((c, u < c - gap))
    return out, target


def _batched_ce2(confidence: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """(R,) CE² of R test sets at once ((R, n) confidences and rightness): the oracle's statistic."""
    r, n = confidence.shape
    edges = torch.linspace(0, 1, BINS + 1, dtype=torch.float64)
    bins = (torch.bucketize(confidence, edges, right=True) - 1).clamp(max=BINS - 1)  # 1.0 in the last bin
    index = (bins + (BINS + 1) * torch.arange(r)[:, None]).flatten()
    d = (right.double() - confidence).flatten()

    def per_bin(x):
        return torch.zeros(r * (BINS + 1), dtype=torch.float64).index_add_(0, index, x).view(r, BINS + 1)

    size, sums, squares = per_bin(torch.ones_like(d)), per_bin(d), per_bin(d**2)
    return torch.where(size > 1, (sums**2 - squares) / (size - 1).clamp_min(1), 0.0).sum(1) / n


def _oracle_bounds(n: int, kinds, gaps, coupling: float, draws: int, seed: int) -> torch.Tensor:
    """The 2.5 % and 97.5 % quantiles of CE²_A − CE²_B in `draws` test sets: the exact-level test's
    critical values at that configuration."""
    generator = torch.Generator().manual_seed(seed)
    differences = []
    for _ in range(draws // 250):
        sets = [_draw(n, generator, kinds, gaps, coupling)[0] for _ in range(250)]
        (ca, ra), (cb, rb) = ([torch.stack([s[p][i] for s in sets]) for i in (0, 1)] for p in (0, 1))
        differences.append(_batched_ce2(ca, ra) - _batched_ce2(cb, rb))
    return torch.quantile(torch.cat(differences), torch.tensor([0.025, 0.975], dtype=torch.float64))


# ---------------------------------------------------------------------- formulas against loops
def test_the_gaps_give_the_plain_estimate():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(300, 4, generator=g, dtype=torch.float64), 1)
    probs[:5] = torch.eye(4, dtype=torch.float64)[torch.arange(5) % 4]  # confidence exactly 1: in the last bin
    target = torch.randint(4, (300,), generator=g)
    for n_bins in (15, 40):  # 40 bins: some hold one example, which counts nothing
        found = top_label_gaps(probs, target, n_bins).ce2
        assert abs(found - float(squared_calibration_error(probs, target, n_bins))) < 1e-15


def test_the_grouped_second_order_sum_is_the_double_loop():
    """Σ2[p, q] = 2 Σ_{i≠j} K^p_ij K^q_ij d^p_i d^q_i d^p_j d^q_j, by a loop over all pairs."""
    g = torch.Generator().manual_seed(1)
    target = torch.randint(3, (40,), generator=g)
    gaps = [
        top_label_gaps(torch.softmax(s * torch.randn(40, 3, generator=g, dtype=torch.float64), 1), target, 6)
        for s in (0.5, 2.0, 4.0)
    ]
    found = second_order_covariance(gaps)
    n = 40
    for p, a in enumerate(gaps):
        for q, b in enumerate(gaps):
            total = 0.0
            for i in range(n):
                for j in range(n):
                    same_a, same_b = int(a.bins[i]) == int(a.bins[j]), int(b.bins[i]) == int(b.bins[j])
                    if i == j or not (same_a and same_b):
                        continue
                    k_a = 1 / (n * (int((a.bins == a.bins[i]).sum()) - 1))
                    k_b = 1 / (n * (int((b.bins == b.bins[i]).sum()) - 1))
                    total += 2 * k_a * k_b * float(a.d[i] * b.d[i] * a.d[j] * b.d[j])
            assert abs(float(found[p, q]) - total) < 1e-15 + 1e-12 * abs(total), (p, q)


def test_the_score_interval_is_the_set_of_levels_it_does_not_reject():
    g = torch.Generator().manual_seed(2)
    for seed, gap in enumerate((0.0, 0.03, 0.1)):
        (pair,), target = _draw(500, g, ("spread",), (gap,))
        probs = _probs(*pair, target)
        found = score_interval(probs, target)
        gaps = top_label_gaps(probs, target)
        v2, c, n, z = float(second_order_covariance([gaps])[0, 0]), float(shape_gram([gaps])[0, 0]), 500, 1.959964
        assert found.value == gaps.ce2 and 0 <= found.low <= found.high
        for theta in torch.linspace(0, 3 * max(found.high, 1e-3), 301).tolist():
            accepted = (found.value - theta) ** 2 <= z * z * (v2 + 4 / n * (c * theta - theta**2))
            assert (
                accepted == (found.low <= theta <= found.high)
                or min(abs(theta - found.low), abs(theta - found.high)) < 1e-9
            )
        assert (found.p < 0.05) == (found.low > 0)


def test_the_paired_test_is_antisymmetric_zero_against_itself_and_agrees_with_its_interval():
    g = torch.Generator().manual_seed(3)
    for gaps in ((0.0, 0.0), (0.05, 0.0), (0.1, 0.03)):
        (a, b), target = _draw(800, g, ("spread", "confident"), gaps, coupling=0.5)
        pa, pb = _probs(*a, target), _probs(*b, target)
        ab, ba = paired_test(pa, pb, target), paired_test(pb, pa, target)
        assert ab.value == pytest.approx(-ba.value) and ab.p == pytest.approx(ba.p)
        assert ab.low == pytest.approx(-ba.high) and ab.high == pytest.approx(-ba.low)
        assert ab.low <= ab.value <= ab.high and (ab.p < 0.05) == (not ab.low <= 0 <= ab.high)
        # one seed: the seeds' covariance is the test's variance at the null
        variance = float(ce2_difference_covariance([(pa, pb)], target)[0, 0])
        assert ab.p == pytest.approx(math.erfc(abs(ab.value) / math.sqrt(2 * variance)), rel=1e-9)
    assert paired_test(pa, pa, target) == (0.0, 0.0, 0.0, 1.0)


def test_the_evaluation_and_the_report_use_these_intervals_and_tests():
    from dbsn.evaluation.report.comparisons import paired_differences
    from dbsn.evaluation.statistics import Statistics, ce2_intervals

    g = torch.Generator().manual_seed(4)
    (a, b, c), target = _draw(600, g, ("spread", "confident", "spread"), (0.05, 0.0, 0.02), coupling=0.5)
    pa, pb, pc = (_probs(*x, target) for x in (a, b, c))
    found = ce2_intervals(pa.log(), target, pc.log(), 0.95)
    # Equal up to rounding: the evaluation passes log-probabilities, exp(log(p)) is p to an ulp.
    assert found == {
        "test/ce2": pytest.approx(list(score_interval(pa, target)[1:3]), rel=1e-12, abs=1e-15),
        "test/calibrated/ce2": pytest.approx(list(score_interval(pc, target)[1:3]), rel=1e-12, abs=1e-15),
    }
    method = {0: {"log_probs": pa.log(), "calibrated_log_probs": pc.log(), "targets": target}}
    reference = {0: {"log_probs": pb.log(), "calibrated_log_probs": pb.log(), "targets": target}}
    rows = paired_differences(method, reference, Statistics(resamples=20))
    for name, probs in (("CE²", pa), ("calibrated CE²", pc)):
        test = paired_test(probs.log().exp(), pb.log().exp(), target)  # as read back from the log-probabilities
        assert rows[name]["combined"] == tuple(test[:3]) and rows[name]["p"] == test.p
        assert rows[name]["seeds"][0] == tuple(test[:3])
    two = paired_differences({**method, 1: method[0]}, {**reference, 1: reference[0]}, Statistics(resamples=20))
    once = tuple(paired_test(pa.log().exp(), pb.log().exp(), target)[:3])
    assert two["CE²"]["seeds"] == {0: once, 1: once}


# ---------------------------------------------------------------------- simulations of known truth
def _sets(n, generator, kinds, gaps, coupling, runs):
    """`runs` test sets of `_draw`, and their (runs, P) CE² estimates computed all at once."""
    sets = [_draw(n, generator, kinds, gaps, coupling) for _ in range(runs)]
    estimates = [
        _batched_ce2(torch.stack([s[0][p][0] for s in sets]), torch.stack([s[0][p][1] for s in sets]))
        for p in range(len(kinds))
    ]
    return sets, torch.stack(estimates, 1)


def _within_sampling_error(formula: torch.Tensor, monte_carlo: torch.Tensor, runs: int) -> bool:
    """Each entry within 4 standard errors of the Monte Carlo covariance (normal theory)."""
    diagonal = torch.diag(monte_carlo)
    scale = torch.sqrt((diagonal[:, None] * diagonal[None, :] + monte_carlo**2) / runs)
    return bool(((formula - monte_carlo).abs() <= 4 * scale).all())


@pytest.mark.slow
def test_the_variance_formula_is_the_monte_carlo_variance():
    """4,000 test sets of 1,000 examples, three predictors sharing some errors: the Monte Carlo
    covariance of their CE² estimates is Σ1 (at the true bin gaps, and at the true levels in the
    estimated shape) + Σ2 (estimated; means over 300 of the sets) to within sampling error,
    calibrated (only Σ2) and miscalibrated (CE² = 0.0025, 0, 0.0016), and the estimates are unbiased; the seeds' covariance (two predictors of one method
    against one of another, at their common level) is the Monte Carlo covariance of the two
    differences where both methods are equally miscalibrated (CE² = 9e-4)."""
    n, runs, formulas = 1000, 4000, 300
    for gaps in ((0.0, 0.0, 0.0), (0.05, 0.0, 0.04)):
        sets, estimates = _sets(n, torch.Generator().manual_seed(5), ("spread", "confident", "spread"), gaps, 0.6, runs)
        truth = [torch.full((BINS,), -gap, dtype=torch.float64) for gap in gaps]  # one per bin
        theta = torch.tensor(gaps, dtype=torch.float64) ** 2
        found, shaped = [], []
        for pairs, target in sets[:formulas]:
            predictors = [top_label_gaps(_probs(c, r, target), target) for c, r in pairs]
            found.append(first_order_covariance(predictors, truth) + second_order_covariance(predictors))
            shaped.append(covariance(predictors, theta.tolist()))  # the gaps' shape estimated
        formula, monte_carlo = torch.stack(found).mean(0), torch.cov(estimates.T)
        assert _within_sampling_error(formula, monte_carlo, runs), (gaps, formula, monte_carlo)
        assert _within_sampling_error(torch.stack(shaped).mean(0), monte_carlo, runs), (gaps, shaped, monte_carlo)
        assert bool(((estimates.mean(0) - theta).abs() <= 4 * estimates.std(0) / runs**0.5).all())

    gap = 0.03
    sets, estimates = _sets(
        n, torch.Generator().manual_seed(6), ("spread", "spread", "confident"), (gap,) * 3, 0.6, runs
    )
    differences = torch.stack([estimates[:, 0] - estimates[:, 2], estimates[:, 1] - estimates[:, 2]], 1)
    found = []
    for (a, a2, b), target in sets[:formulas]:
        pa, pa2, pb = (_probs(c, r, target) for c, r in (a, a2, b))
        found.append(ce2_difference_covariance([(pa, pb), (pa2, pb)], target))
    formula, monte_carlo = torch.stack(found).mean(0), torch.cov(differences.T)
    assert _within_sampling_error(formula, monte_carlo, runs), (formula, monte_carlo)


PER_RUN = [  # (n, confidence kind, true CE²)
    (2000, "spread", 0.0),
    (2000, "confident", 0.0),
    (2000, "spread", 3e-4),
    (2000, "confident", 3e-4),
    (2000, "spread", 1e-3),
    (2000, "confident", 1e-3),
    (846, "spread", 0.0),
    (846, "confident", 1e-3),
]


@pytest.mark.slow
def test_the_ce2_interval_covers_the_truth_95_percent_of_the_time():
    """600 test sets per configuration (binomial sd 0.9 points): the 95 % score interval holds the
    true CE² in 93–97 % of them (with the simulation's noise, 92.5–98 %), at CE² = 0 (where the
    estimate is a degenerate U-statistic), 3e-4 and 1e-3, at n = 2,000 and 846, for a spread and a
    confident predictor; and for softmax predictors with labels drawn from their own or from tempered
    probabilities (a true CE² from 2e6 draws)."""
    runs = 600
    for n, kind, truth in PER_RUN:
        generator, covered = torch.Generator().manual_seed(int(n + 1e6 * truth)), 0
        for _ in range(runs):
            (pair,), target = _draw(n, generator, (kind,), (truth**0.5,))
            found = score_interval(_probs(*pair, target), target)
            covered += found.low <= truth <= found.high
        assert 0.925 <= covered / runs <= 0.98, (n, kind, truth, covered / runs)
    for temperature in (1.0, 1.1):  # the model predicts softmax(l), the labels follow softmax(l / T)
        truth, generator, covered = _tempered_truth(temperature), torch.Generator().manual_seed(7), 0
        for _ in range(runs):
            logits = 2 * torch.randn(2000, CLASSES, generator=generator, dtype=torch.float64)
            target = torch.multinomial(torch.softmax(logits / temperature, 1), 1, generator=generator).squeeze(1)
            found = score_interval(torch.softmax(logits, 1), target)
            covered += found.low <= truth <= found.high
        assert 0.925 <= covered / runs <= 0.98, (temperature, truth, covered / runs)


def _tempered_truth(temperature: float, draws: int = 2_000_000) -> float:
    """CE² of softmax(2 z) (z standard normal logits) when the labels follow softmax(2 z / T):
    Σ_b P(b) E[p*(top) − c | b]², with p*(top) the true probability of the predicted class (exact per
    draw, so the only error is the bins' means over `draws`: about 1e-6 here)."""
    if temperature == 1.0:
        return 0.0
    generator = torch.Generator().manual_seed(123)
    sums, counts = torch.zeros(BINS + 1, dtype=torch.float64), torch.zeros(BINS + 1, dtype=torch.float64)
    for _ in range(draws // 200_000):
        logits = 2 * torch.randn(200_000, CLASSES, generator=generator, dtype=torch.float64)
        confidence, top = torch.softmax(logits, 1).max(1)
        true = torch.softmax(logits / temperature, 1).gather(1, top[:, None]).squeeze(1)
        edges = torch.linspace(0, 1, BINS + 1, dtype=torch.float64)
        bins = (torch.bucketize(confidence, edges, right=True) - 1).clamp(max=BINS - 1)
        sums.index_add_(0, bins, true - confidence)
        counts.index_add_(0, bins, torch.ones_like(confidence))
    return float((counts / counts.sum() * (sums / counts.clamp_min(1)) ** 2).sum())


@pytest.mark.slow
@pytest.mark.parametrize("coupling", [0.0, 0.8], ids=["independent", "shared-errors"])
def test_the_paired_ce2_test_holds_its_size_where_both_are_calibrated_and_where_both_are_not(coupling):
    """A spread and a confident predictor on the same 2,000 examples, 800 test sets (binomial sd 0.8
    points) per null: both calibrated, and both miscalibrated by CE² = 1e-3: the 5 % test rejects in
    3–7 % of them (with the simulation's noise, 2.5–7.5 %)."""
    runs = 800
    for gap in (0.0, 1e-3**0.5):
        generator, rejected = torch.Generator().manual_seed(8 + int(gap > 0)), 0
        for _ in range(runs):
            (a, b), target = _draw(2000, generator, ("spread", "confident"), (gap, gap), coupling)
            rejected += paired_test(_probs(*a, target), _probs(*b, target), target).p < 0.05
        assert 0.025 <= rejected / runs <= 0.075, (gap, rejected / runs)


@pytest.mark.slow
def test_the_paired_ce2_test_has_the_power_of_the_exact_level_test():
    """One predictor miscalibrated by Δ = 4e-4, 9e-4, 2.5e-3, the other calibrated, on the same 2,000
    examples (errors shared with probability 0.8), 500 test sets each: the test rejects about as often
    as the exact-level test of the null with the same common level (both at Δ / 2: critical values
    from 4,000 simulated test sets), within 7 points; and less often than the exact-level test of
    the calibrated null, which no test can match that also holds its level where both are equally
    miscalibrated."""
    runs, coupling = 500, 0.8
    for delta, seed in ((4e-4, 10), (9e-4, 11), (2.5e-3, 12)):
        kinds = ("confident", "spread") if seed % 2 else ("spread", "confident")
        same_level = _oracle_bounds(2000, kinds, ((delta / 2) ** 0.5,) * 2, coupling, 4000, seed)
        generator, ours, oracle = torch.Generator().manual_seed(seed), 0, 0
        for _ in range(runs):
            (a, b), target = _draw(2000, generator, kinds, (delta**0.5, 0.0), coupling)
            found = paired_test(_probs(*a, target), _probs(*b, target), target)
            ours += found.p < 0.05
            oracle += not same_level[0] <= found.value <= same_level[1]
        assert ours / runs >= oracle / runs - 0.07, (delta, ours / runs, oracle / runs)
