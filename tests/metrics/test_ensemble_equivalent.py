"""The deep-ensemble equivalent (dbsn.metrics.ensemble_equivalent): an ensemble's own NLL maps to
its size, the map is monotone and linear between sizes, the ends are 1.0 and inf, a noisy curve
is read through its running minimum, and bad inputs say what is wrong."""

from __future__ import annotations

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
