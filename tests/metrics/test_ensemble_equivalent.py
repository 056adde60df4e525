"""The deep-ensemble equivalent (dbsn.metrics.ensemble_equivalent): an ensemble's own NLL maps to
its size, the map is monotone and linear between sizes, the ends are 1.0 and inf, a noisy curve
is read through its running minimum, and bad inputs say what is wrong."""

from __future__ import annotations

import functools
import math
from itertools import pairwise

import numpy as np
import pytest

from dbsn.metrics.ensemble_equivalent import (
    deep_ensemble_equivalent,
    deep_ensemble_equivalent_interval,
)

SIZES = [1, 2, 3, 4, 6, 8]
CURVE = [1.00, 0.90, 0.85, 0.82, 0.79, 0.78]  # decreasing, as a real ensemble's NLL


@pytest.mark.parametrize("k", range(len(SIZES)))
def test_an_ensembles_own_nll_gives_its_size_exactly(k):
    assert deep_ensemble_equivalent(CURVE[k], SIZES, CURVE) == SIZES[k]


def test_midway_between_two_and_three_members_is_two_and_a_half():
    assert deep_ensemble_equivalent((0.90 + 0.85) / 2, SIZES, CURVE) == pytest.approx(2.5)
    # between sizes 4 and 6, a quarter of the way down in NLL is a quarter of the way in size
    assert deep_ensemble_equivalent(0.82 - 0.25 * 0.03, SIZES, CURVE) == pytest.approx(4.5)


def test_non_increasing_in_nll_over_a_dense_grid():
    grid = np.linspace(0.7, 1.1, 2001)
    dee = [deep_ensemble_equivalent(v, SIZES, CURVE) for v in grid]
    assert all(a >= b for a, b in pairwise(dee))
    assert dee[0] == math.inf and dee[-1] == 1.0


def test_no_better_than_one_network_is_one():
    assert deep_ensemble_equivalent(1.00, SIZES, CURVE) == 1.0
    assert deep_ensemble_equivalent(1.50, SIZES, CURVE) == 1.0
    assert deep_ensemble_equivalent(math.inf, SIZES, CURVE) == 1.0


def test_better_than_the_largest_ensemble_is_inf():
    assert deep_ensemble_equivalent(0.78, SIZES, CURVE) == 8.0
    assert deep_ensemble_equivalent(0.7799, SIZES, CURVE) == math.inf
    assert deep_ensemble_equivalent(-math.inf, SIZES, CURVE) == math.inf


def test_non_monotone_curve_is_read_through_its_running_minimum():
    sizes, curve = [1, 2, 3, 4], [1.0, 0.9, 0.95, 0.8]  # noise: 3 members worse than 2
    # running minimum [1.0, 0.9, 0.9, 0.8]: 0.9 is first reached at 2 members (start of the flat part)
    assert deep_ensemble_equivalent(0.9, sizes, curve) == 2.0
    assert deep_ensemble_equivalent(0.92, sizes, curve) == pytest.approx(1.8)
    # below the flat part, interpolate from (3, 0.9) to (4, 0.8), not from the bump at 0.95
    assert deep_ensemble_equivalent(0.85, sizes, curve) == pytest.approx(3.5)
    grid = np.linspace(0.75, 1.05, 601)
    dee = [deep_ensemble_equivalent(v, sizes, curve) for v in grid]
    assert all(a >= b for a, b in pairwise(dee))


def test_a_curve_that_ends_higher_than_its_minimum():
    sizes, curve = [1, 2, 3], [1.0, 0.8, 0.85]
    assert deep_ensemble_equivalent(0.85, sizes, curve) == pytest.approx(1.75)
    assert deep_ensemble_equivalent(0.8, sizes, curve) == 2.0
    assert deep_ensemble_equivalent(0.79, sizes, curve) == math.inf


def test_interval_swaps_its_ends():
    low, high = deep_ensemble_equivalent_interval(0.82, 0.875, SIZES, CURVE)
    assert (low, high) == (pytest.approx(2.5), 4.0)
    assert deep_ensemble_equivalent_interval(0.5, 2.0, SIZES, CURVE) == (1.0, math.inf)
    assert deep_ensemble_equivalent_interval(0.85, 0.85, SIZES, CURVE) == (3.0, 3.0)


@pytest.mark.parametrize(
    ("sizes", "curve", "message"),
    [
        ([1, 2, 3], [1.0, 0.9], "differ in length"),
        ([1], [1.0], "two sizes or more"),
        ([1, 3, 2], [1.0, 0.9, 0.8], "strictly increasing"),
        ([1, 2, 2], [1.0, 0.9, 0.8], "strictly increasing"),
        ([2, 3], [1.0, 0.9], "start at 1"),
        ([1, 2.5], [1.0, 0.9], "whole numbers"),
        ([1, 2], [1.0, math.nan], "finite"),
    ],
)
def test_bad_curves_raise_a_one_line_message(sizes, curve, message):
    with pytest.raises(ValueError, match=message) as info:
        deep_ensemble_equivalent(0.9, sizes, curve)
    assert "\n" not in str(info.value)


def test_bad_method_nll_raises():
    with pytest.raises(ValueError, match="nan"):
        deep_ensemble_equivalent(math.nan, SIZES, CURVE)
    with pytest.raises(ValueError, match="low_nll <= high_nll"):
        deep_ensemble_equivalent_interval(0.9, 0.8, SIZES, CURVE)


# ---------------------------------------------------------------------- the interval of both sides' noise
def _equivalent_by_loop(method_nll, ensemble_nll, sizes, level, steps):
    """`equivalent_interval` written out grid point by grid point with numpy (the reference)."""
    from scipy.stats import t as student

    a, b = np.asarray(method_nll, float), np.asarray(ensemble_nll, float)
    (k, n), r = a.shape, b.shape[0]
    grid, kept = [], []
    for q in range(len(sizes) - 1):
        for step in range(steps + (q == len(sizes) - 2)):
            lam = step / steps
            d = sizes[q] + lam * (sizes[q + 1] - sizes[q])
            curves = (1 - lam) * b[:, q] + lam * b[:, q + 1]  # (r, n)
            sigma = np.cov(np.vstack([curves, a])) / n
            w = np.concatenate([np.full(r, 1 / r), np.full(k, -1 / k)])
            variance, terms = max(w @ sigma @ w, 0.0), 0.0
            for means, cov, count in ((curves.mean(1), sigma[:r, :r], r), (a.mean(1), sigma[r:, r:], k)):
                if count > 1:
                    sample = means.var(ddof=1)
                    shared = (np.trace(cov) - cov.sum() / count) / (count - 1)
                    variance += max(sample - shared, 0.0) / count
                    terms += (sample / count) ** 2 / (count - 1)
            df = variance**2 / terms if terms > 0 else math.inf
            reach = student.ppf((1 + level) / 2, df) * variance**0.5
            difference = curves.mean() - a.mean()
            grid.append((d, difference, reach))
            if abs(difference) <= reach:
                kept.append(d)
    if grid[0][1] <= grid[0][2]:
        kept.append(1.0)
    if grid[-1][1] >= -grid[-1][2]:
        kept.append(math.inf)
    return min(kept), max(kept)


def _toy_runs(generator, k, r, sizes, n=300, shift=0.0, seed_sd=0.02):
    """Per-example NLLs of k runs of a method and r runs of an ensemble on one test set (shared
    example difficulty), the ensemble's curve falling with its size, each run with its own offset."""
    import torch

    difficulty = torch.rand(n, generator=generator, dtype=torch.float64)
    gain = torch.tensor([0.3 / s for s in sizes], dtype=torch.float64)
    ensemble = (
        0.2
        + difficulty
        + gain[:, None]
        + seed_sd * torch.randn(r, 1, 1, generator=generator)
        + 0.1 * torch.randn(r, len(sizes), n, generator=generator)
    )
    method = (
        0.2
        + difficulty
        + 0.3 / 2.5
        + shift
        + seed_sd * torch.randn(k, 1, generator=generator)
        + 0.1 * torch.randn(k, n, generator=generator)
    )
    return method, ensemble


@pytest.mark.parametrize("k, r", [(1, 1), (3, 1), (1, 2), (3, 3), (2, 4)])
def test_the_interval_is_the_tests_inversion_written_out_point_by_point(k, r):
    import torch

    from dbsn.metrics.ensemble_equivalent import ENSEMBLE_RUNS, METHOD_RUNS, equivalent_interval

    sizes = [1, 2, 3, 5]
    method, ensemble = _toy_runs(torch.Generator().manual_seed(10 * k + r), k, r, sizes)
    found = equivalent_interval(method, ensemble, sizes, level=0.9, steps=20)
    assert (found.low, found.high) == pytest.approx(_equivalent_by_loop(method, ensemble, sizes, 0.9, 20), rel=1e-12)
    assert found.value == deep_ensemble_equivalent(float(method.mean()), sizes, ensemble.mean((0, 2)).tolist())
    assert found.low <= found.value <= found.high
    assert found.leaves_out == (*((ENSEMBLE_RUNS,) if r == 1 else ()), *((METHOD_RUNS,) if k == 1 else ()))


def test_the_interval_reaches_one_network_or_beyond_the_largest_ensemble_where_the_data_allow():
    import torch

    from dbsn.metrics.ensemble_equivalent import equivalent_interval

    sizes = [1, 2, 3, 5]
    worse = equivalent_interval(*_toy_runs(torch.Generator().manual_seed(1), 2, 2, sizes, shift=1.0), sizes)
    assert (worse.value, worse.low, worse.high) == (1.0, 1.0, 1.0)
    better = equivalent_interval(*_toy_runs(torch.Generator().manual_seed(1), 2, 2, sizes, shift=-1.0), sizes)
    assert (better.value, better.low, better.high) == (math.inf, math.inf, math.inf)
    noisy = equivalent_interval(*_toy_runs(torch.Generator().manual_seed(1), 2, 2, sizes, n=20, seed_sd=0.5), sizes)
    assert noisy.low == 1.0 and noisy.high == math.inf  # two noisy runs a side: any size at all


@functools.lru_cache
def _population(member_sd: float, method_seed_sd: float, members: int = 8, draws: int = 1_000_000):
    """The true curve and method NLL of `_simulated_runs`' population (Monte Carlo, `draws` examples):
    an ensemble of s members drawn at random, and the method over its seeds."""
    import torch

    g = torch.Generator().manual_seed(123)
    easy = torch.randn(draws, 1, generator=g, dtype=torch.float64) + 1.5
    member = member_sd * torch.randn(draws, members, generator=g, dtype=torch.float64)
    p = torch.sigmoid(easy + member + 2.0 * torch.randn(draws, members, generator=g, dtype=torch.float64))
    curve = -(p.cumsum(1) / torch.arange(1, members + 1)).log().mean(0)
    seed = method_seed_sd * torch.randn(draws, 1, generator=g, dtype=torch.float64)
    method = -torch.nn.functional.logsigmoid(
        easy + 0.25 + seed + 2.0 * torch.randn(draws, 1, generator=g, dtype=torch.float64)
    ).mean()
    return curve.tolist(), float(method)


def _simulated_runs(generator, n, k, r, member_sd, method_seed_sd, members=8):
    """Per-example NLLs on one test set of n examples (each with its own ease, shared by every model):
    r deep-ensemble runs of `members` members whose quality varies (a member's logit offset, sd
    `member_sd`), each member with noise of its own on every example, read as its first-s curve; and k
    runs of a method (a seed's offset, sd `method_seed_sd`)."""
    import torch

    easy = torch.randn(n, generator=generator, dtype=torch.float64) + 1.5
    member = member_sd * torch.randn(r, members, 1, generator=generator, dtype=torch.float64)
    p = torch.sigmoid(easy + member + 2.0 * torch.randn(r, members, n, generator=generator, dtype=torch.float64))
    ensemble = -(p.cumsum(1) / torch.arange(1, members + 1, dtype=torch.float64).view(1, members, 1)).log()
    seed = method_seed_sd * torch.randn(k, 1, generator=generator, dtype=torch.float64)
    method = -torch.nn.functional.logsigmoid(
        easy + 0.25 + seed + 2.0 * torch.randn(k, n, generator=generator, dtype=torch.float64)
    )
    return method, ensemble


@pytest.mark.slow
@pytest.mark.parametrize(
    "k, r, member_sd, method_seed_sd, band",
    [
        (3, 3, 0.3, 0.1, (0.92, 0.98)),  # members vary in quality, and the method's seeds
        (3, 3, 0.03, 0.1, (0.92, 0.98)),  # the method's seeds dominate, the ensemble's test noise next
        (1, 1, 0.0, 0.0, (0.92, 0.98)),  # members of equal quality, one run a side: nothing left out matters
        (1, 1, 0.6, 0.0, (0.0, 0.5)),  # members vary, one ensemble run: a lower bound, and it says so
    ],
)
def test_the_interval_covers_the_true_equivalent_where_members_vary_in_quality(k, r, member_sd, method_seed_sd, band):
    """Coverage of the true deep-ensemble equivalent (the method's population NLL against the expected
    curve of ensembles of members drawn at random) in 400 simulated comparisons of 4,000 test
    examples and 8 members (±3 points at 95 %). Where a side has one run its spread across runs is
    left out and named (`leaves_out`): with members of equal quality that costs nothing, with members
    that vary the interval covers far less, as the table's note says."""
    import torch

    from dbsn.metrics.ensemble_equivalent import equivalent_interval

    curve, method = _population(member_sd, method_seed_sd)
    sizes = list(range(1, 9))
    truth = deep_ensemble_equivalent(method, sizes, curve)
    assert 1.5 < truth < 3.0  # inside the curve, where it is steep enough to matter
    generator, covered, repetitions = torch.Generator().manual_seed(7), 0, 400
    for _ in range(repetitions):
        found = equivalent_interval(*_simulated_runs(generator, 4000, k, r, member_sd, method_seed_sd), sizes)
        covered += found.low <= truth <= found.high
    assert band[0] <= covered / repetitions <= band[1], covered
    assert bool(found.leaves_out) == (k == 1 or r == 1)
