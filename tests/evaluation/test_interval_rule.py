"""The rule of every shown interval (dbsn.evaluation.interval_rule): each metric's limits by its stable
name, bounds moved within them, the flag of an interval that misses its estimate, differences without
a limit at 0; and the places that apply it (W&B's numbers, the report's cells and differences)."""

from __future__ import annotations

import math

import pytest

from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, Limits, limits_of, shown_interval


@pytest.mark.parametrize(
    "name, limits",
    [
        ("test/error", (0.0, 1.0)),
        ("test/calibrated/ce2", (0.0, 1.0)),
        ("ood/svhn/entropy/auroc", (0.0, 1.0)),
        ("selective/max_probability/risk@80", (0.0, 1.0)),
        ("test/iou/sky", (0.0, 1.0)),
        ("conformal/90/aps/shift/coverage", (0.0, 1.0)),
        ("test/brier", (0.0, 2.0)),
        ("test/calibrated/nll", (0.0, math.inf)),
        ("conformal/90/raps/size", (0.0, math.inf)),
        ("calibrated_nll", (0.0, math.inf)),
        ("train_seconds", (0.0, math.inf)),
        ("deep_ensemble_equivalent", (1.0, math.inf)),
        ("test/something_new", (-math.inf, math.inf)),
        (None, (-math.inf, math.inf)),
    ],
)
def test_each_metric_has_its_limits_by_its_stable_name(name, limits):
    assert limits_of(name) == Limits(*limits)


def test_limits_scale_with_the_cell_and_a_difference_has_no_limit_at_zero():
    assert limits_of("test/error", scale=100.0) == (0.0, 100.0)
    assert limits_of("test/error", difference=True) == (-1.0, 1.0)
    assert limits_of("test/nll", difference=True) == (-math.inf, math.inf)
    with pytest.raises(ValueError, match="positive"):
        limits_of("test/error", scale=0.0)


def test_bounds_are_kept_within_the_limits_and_a_missed_estimate_is_flagged():
    # a t interval over two seeds reaches below 0: moved to 0, the estimate inside, no flag
    assert shown_interval("test/error", 0.01, -0.05, 0.07) == (0.0, 0.07, False)
    assert shown_interval("test/error", 98.0, 95.0, 101.5, scale=100.0) == (95.0, 100.0, False)
    # the plug-in ECE's percentile interval above its estimate: shown as it is, flagged
    assert shown_interval("test/ece", 0.0264, 0.0288, 0.0713) == (0.0288, 0.0713, True)
    # an unbiased CE² may be negative, the truth cannot: not flagged under an interval that starts at 0 ...
    assert shown_interval("test/ce2", -2e-4, -1e-3, 3e-3) == (0.0, 3e-3, False)
    # ... but flagged where the interval lies above 0 entirely
    assert shown_interval("test/ce2", -2e-4, 5e-4, 3e-3) == (5e-4, 3e-3, True)
    # a difference keeps its negative bounds; flagged where it misses the difference
    assert shown_interval("test/error", -0.02, -0.05, 0.01, difference=True) == (-0.05, 0.01, False)
    assert shown_interval(None, 0.02, -0.05, 0.01, difference=True) == (-0.05, 0.01, True)
    # nothing to compare: no flag
    assert shown_interval("test/error", None, 0.2, 0.3).misses is False
    assert shown_interval("test/error", math.nan, 0.2, 0.3).misses is False
    # the estimate on an end, as a percentile interval can have it (rounded apart): not flagged
    assert shown_interval("test/nll", 0.3 * 3, 0.9, 1.0).misses is False


def test_wandb_gets_clipped_bounds_and_the_flag_of_every_interval_whose_estimate_it_knows():
    from dbsn.evaluation.results import interval_numbers

    numbers = interval_numbers(
        {"test/ece": [0.0288, 0.0713], "test/error": [-0.01, 0.2], "ood/x/auroc": [0.5, 0.6]},
        {"test/ece": 0.0264, "test/error": 0.1},
    )
    assert numbers == {
        "test/ece/ci_low": 0.0288,
        "test/ece/ci_high": 0.0713,
        "test/ece/ci_misses_estimate": 1.0,
        "test/error/ci_low": 0.0,
        "test/error/ci_high": 0.2,
        "test/error/ci_misses_estimate": 0.0,
        "ood/x/auroc/ci_low": 0.5,
        "ood/x/auroc/ci_high": 0.6,
    }


def test_the_reports_cells_and_differences_follow_the_rule():
    from dbsn.evaluation.report.comparisons import _interval_text
    from dbsn.evaluation.report.format import Cell, fmt

    # a t interval of an error in % over two seeds: its lower end at 0, not below
    assert fmt(Cell(1.0, 0.5, 2, -3.49, 5.49), 2, "test/error", 100.0) == "1.00 ± 0.50 [0.00, 5.49] (2)"
    assert fmt(Cell(1.0, 0.5, 2, -3.49, 5.49), 2) == "1.00 ± 0.50 [-3.49, 5.49] (2)"  # no metric named: no limits
    assert fmt(Cell(0.0264, None, 1, 0.0288, 0.0713), 4, "test/ece") == f"0.0264 [0.0288, 0.0713] {OUTSIDE_NOTE} (1)"
    assert _interval_text(-0.02, -0.05, 0.01) == "-0.0200 [-0.0500, +0.0100]"
    assert _interval_text(0.02, 0.03, 0.05) == f"+0.0200 [+0.0300, +0.0500] {OUTSIDE_NOTE}"
