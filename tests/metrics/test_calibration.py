"""Tests for dbsn.metrics.calibration: equal-mass and classwise ECE against loops written
here, calibrated and over-confident predictions, and how they relate to the equal-width ECE."""

import pytest
import torch

from dbsn.metrics.calibration import (
    adaptive_expected_calibration_error,
    calibration_metrics,
    classwise_expected_calibration_error,
    squared_calibration_error,
)
from dbsn.metrics.classification import expected_calibration_error
from tests.support.fakedata import CRAFTED_PROBS, CRAFTED_TARGET


# ---------------------------------------------------------------- references with loops
def reference_adaptive_ece(probs, target, n_bins):
    """Equal-mass ECE by loops: rank r goes to bin floor(r M / N); a tie group spread over
    several bins puts in each the group's mean (correct - confidence) times its share."""
    confidence = [max(row) for row in probs.tolist()]
    correct = [float(row.index(max(row)) == y) for row, y in zip(probs.tolist(), target.tolist())]
    n = len(confidence)
    gaps = [0.0] * n_bins
    rank = 0
    for value in sorted(set(confidence)):
        members = [i for i in range(n) if confidence[i] == value]
        mean_gap = sum(correct[i] - confidence[i] for i in members) / len(members)
        for _ in members:
            gaps[rank * n_bins // n] += mean_gap
            rank += 1
    return sum(abs(g) for g in gaps) / n


def reference_binary_ece(p, y, n_bins):
    """ECE of probabilities p against 0/1 outcomes y over equal-width bins [b/M, (b+1)/M),
    the last bin closed so that p = 1 falls in it (the convention of the logged ECE). The edges are the
    float64 values of torch.linspace(0, 1, M + 1), as there: with M = 10 the 0.3 edge is
    0.30000000000000004, so p = 0.3 falls in the bin below."""
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64).tolist()
    bins = {}
    for p_i, y_i in zip(p, y):
        b = min(sum(1 for edge in edges if edge <= p_i) - 1, n_bins - 1)  # the last edge at or below p_i
        bins.setdefault(b, []).append((p_i, y_i))
    return sum(abs(sum(y_i - p_i for p_i, y_i in members)) for members in bins.values()) / len(p)


def reference_classwise_ece(probs, target, n_bins):
    probs, target = probs.tolist(), target.tolist()
    classes = range(len(probs[0]))
    return sum(
        reference_binary_ece([row[k] for row in probs], [float(y == k) for y in target], n_bins) for k in classes
    ) / len(classes)


def random_predictions(seed, n=60, c=4, decimals=None):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(n, c, generator=gen, dtype=torch.float64), dim=1)
    if decimals is not None:  # coarse probabilities: many tied confidences
        probs = torch.round(probs * 10**decimals) / 10**decimals
    return probs, torch.randint(0, c, (n,), generator=gen)


# ---------------------------------------------------------------- equal-mass ECE
def test_adaptive_ece_crafted_equals_equal_width_where_bins_coincide():
    # 2 equal-mass bins of 5 sorted confidences: ranks 0-2 {0.5 w, 0.6 w, 0.7 r}, ranks 3-4
    # {0.8 r, 0.9 r}: 3/5 |1/3 - 0.6| + 2/5 |1 - 0.85| = 0.16 + 0.06 = 0.22. These are
    # also the two non-empty bins of the equal-width ECE with 4 bins.
    ace = adaptive_expected_calibration_error(CRAFTED_PROBS, CRAFTED_TARGET, n_bins=2)
    assert ace.item() == pytest.approx(0.22, abs=1e-12)
    assert expected_calibration_error(CRAFTED_PROBS, CRAFTED_TARGET, n_bins=4).item() == pytest.approx(0.22, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_ece_equals_equal_width_ece_when_each_width_bin_holds_the_same_count(seed):
    # Binary problem: confidences in [0.5, 1), 7 examples strictly inside each of the
    # equal-width bins 5..9 of 10. The 5 equal-mass bins are then the same sets.
    gen = torch.Generator().manual_seed(seed)
    bins = torch.arange(5, 10, dtype=torch.float64).repeat_interleave(7)
    confidence = (bins + 0.05 + 0.9 * torch.rand(bins.numel(), generator=gen, dtype=torch.float64)) / 10
    predicted = torch.randint(0, 2, (bins.numel(),), generator=gen)
    probs = torch.stack([1 - confidence, confidence], dim=1)
    probs = torch.where(predicted.unsqueeze(1) == 1, probs, probs.flip(1))
    target = torch.where(torch.rand(bins.numel(), generator=gen) < confidence, predicted, 1 - predicted)
    ace = adaptive_expected_calibration_error(probs, target, n_bins=5).item()
    assert ace == pytest.approx(expected_calibration_error(probs, target, n_bins=10).item(), abs=1e-12)
    assert ace > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_bins", [3, 7, 15])
def test_adaptive_ece_matches_loops_with_ties_and_uneven_bins(seed, n_bins):
    # n = 61 is divisible by none of the bin counts; probabilities on a 0.1 grid tie a lot.
    probs, target = random_predictions(seed, n=61, decimals=1)
    assert probs.amax(1).unique().numel() < 15
    ace = adaptive_expected_calibration_error(probs, target, n_bins=n_bins).item()
    assert ace == pytest.approx(reference_adaptive_ece(probs, target, n_bins), abs=1e-12)


def test_adaptive_ece_tie_group_split_across_bins_is_averaged():
    # Four examples, all with confidence 0.6, two right: two bins of two. Whatever the order,
    # each bin gets mean correctness 1/2: |2 (0.5 - 0.6)| * 2 / 4 = 0.1. (Splitting by storage
    # order would give (2 * 0.4 + 2 * 0.6) / 4 = 0.5 for this order.)
    probs = torch.tensor([[0.6, 0.3, 0.1]] * 4, dtype=torch.float64)
    target = torch.tensor([0, 0, 1, 1])
    assert adaptive_expected_calibration_error(probs, target, n_bins=2).item() == pytest.approx(0.1, abs=1e-12)
    assert adaptive_expected_calibration_error(probs, target.flip(0), n_bins=2).item() == pytest.approx(0.1, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_ece_does_not_depend_on_example_order(seed):
    probs, target = random_predictions(seed, n=61, decimals=1)
    perm = torch.randperm(61, generator=torch.Generator().manual_seed(seed))
    a = adaptive_expected_calibration_error(probs, target, n_bins=7).item()
    assert adaptive_expected_calibration_error(probs[perm], target[perm], n_bins=7).item() == pytest.approx(
        a, abs=1e-14
    )


def test_adaptive_ece_with_fewer_examples_than_bins():
    # 5 examples, 15 bins: each example alone in a bin, so the ECE is the mean |correct - conf|.
    ace = adaptive_expected_calibration_error(CRAFTED_PROBS, CRAFTED_TARGET, n_bins=15).item()
    assert ace == pytest.approx((0.3 + 0.5 + 0.2 + 0.6 + 0.1) / 5, abs=1e-12)


# ---------------------------------------------------------------- classwise ECE
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decimals", [None, 1])
def test_classwise_ece_matches_loops(seed, decimals):
    # With decimals=1 many probabilities lie exactly on bin edges (n_bins=10) or are 0 or 1.
    probs, target = random_predictions(seed, n=50, c=3, decimals=decimals)
    if decimals:
        probs[:, 2] = 1 - probs[:, 0] - probs[:, 1]  # sums to 1, near the grid
        probs = probs.clamp(0, 1)
        probs[0] = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    value = classwise_expected_calibration_error(probs, target, n_bins=10).item()
    assert value == pytest.approx(reference_classwise_ece(probs, target, 10), abs=1e-12)


def test_classwise_ece_crafted():
    # 2 bins [0, .5), [.5, 1]. Class 0: p = .7,.2,.1,.6,.05, y = 1,0,0,0,0:
    #   low bin {.2,.1,.05}: |0 - .35| ; high bin {.7,.6}: |1 - 1.3| -> (.35 + .3) / 5 = 0.13
    # Class 1: p = .2,.5,.1,.3,.9, y = 0,0,0,1,1: low {.2,.1,.3}: |1 - .6| ; high {.5,.9}: |1 - 1.4|
    #   -> (.4 + .4) / 5 = 0.16
    # Class 2: p = .1,.3,.8,.1,.05, y = 0,1,1,0,0: low {.1,.3,.1,.05}: |1 - .55| ; high {.8}: |1 - .8|
    #   -> (.45 + .2) / 5 = 0.13
    value = classwise_expected_calibration_error(CRAFTED_PROBS, CRAFTED_TARGET, n_bins=2).item()
    assert value == pytest.approx((0.13 + 0.16 + 0.13) / 3, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_classwise_ece_of_two_classes(seed):
    # Two classes: p_0 = 1 - p_1 and 1[y=0] = 1 - 1[y=1], so class 0's ECE is class 1's ECE
    # mirrored (bins symmetric, no probability on an edge here), and the classwise ECE is
    # the binary ECE of p_1 against y. The top-label ECE pools the mirrored bins of
    # predicted-0 and predicted-1 examples, so it is at most that, and equal when every
    # prediction is class 1.
    gen = torch.Generator().manual_seed(seed)
    n = 400
    p1 = 0.02 + 0.96 * torch.rand(n, generator=gen, dtype=torch.float64)
    p1 = torch.where((p1 * 10 - (p1 * 10).round()).abs() < 1e-6, p1 + 1e-3, p1)
    y = (torch.rand(n, generator=gen, dtype=torch.float64) < p1**1.5).long()  # miscalibrated
    probs = torch.stack([1 - p1, p1], dim=1)
    classwise = classwise_expected_calibration_error(probs, y, n_bins=10).item()
    binary = reference_binary_ece(p1.tolist(), y.double().tolist(), 10)
    assert classwise == pytest.approx(binary, abs=1e-12)
    assert reference_binary_ece((1 - p1).tolist(), (1 - y).double().tolist(), 10) == pytest.approx(binary, abs=1e-12)
    assert expected_calibration_error(probs, y, n_bins=10).item() <= classwise + 1e-12
    # Only class-1 predictions: p1 in (0.5, 1).
    high = 0.5 + p1 / 2
    probs_high = torch.stack([1 - high, high], dim=1)
    assert classwise_expected_calibration_error(probs_high, y, n_bins=10).item() == pytest.approx(
        expected_calibration_error(probs_high, y, n_bins=10).item(), abs=1e-12
    )


# ---------------------------------------------------------------- calibrated vs over-confident
@pytest.mark.parametrize("seed", range(2))
def test_calibrated_predictions_score_near_zero_and_overconfident_ones_do_not(seed):
    # Labels drawn from the predicted distribution: calibrated by construction. Sharpening the
    # same predictions (logits x 2) makes them over-confident.
    gen = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(40_000, 4, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, dim=1)
    target = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    # CE² is squared (and unbiased, so it may dip below zero): its thresholds are squared.
    calibrated = calibration_metrics(probs, target)
    assert abs(calibrated.pop("ce2")) < 0.015**2, calibrated
    assert all(value < 0.015 for value in calibrated.values()), calibrated
    overconfident = calibration_metrics(torch.softmax(2 * logits, dim=1), target)
    assert overconfident.pop("ce2") > 0.05**2, overconfident
    assert all(value > 0.05 for value in overconfident.values()), overconfident


def test_calibration_metrics_names_and_values():
    probs, target = random_predictions(0)
    out = calibration_metrics(probs, target)
    assert list(out) == ["ce2", "ece", "adaptive_ece", "classwise_ece"]
    assert all(isinstance(v, float) for v in out.values())
    assert out["ce2"] == squared_calibration_error(probs, target, n_bins=15).item()
    assert out["ece"] == expected_calibration_error(probs, target, n_bins=15).item()
    assert out["adaptive_ece"] == adaptive_expected_calibration_error(probs, target, n_bins=15).item()
    assert out["classwise_ece"] == classwise_expected_calibration_error(probs, target, n_bins=15).item()


def test_logits_are_refused():
    # torchmetrics would quietly pass logits through a sigmoid; we raise instead.
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.1]])
    with pytest.raises(ValueError, match="probabilities"):
        classwise_expected_calibration_error(logits, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="probs"):
        calibration_metrics(torch.rand(3, 2), torch.tensor([0, 1]))
