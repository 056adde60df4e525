"""Tests for dbsn.metrics.classification: hand-worked values, numpy loops, torchmetrics agreement."""

import math

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import multiclass_calibration_error

from dbsn.metrics.classification import (
    ClassificationMetrics,
    brier_score,
    error_rate,
    expected_calibration_error,
    negative_log_likelihood,
    reliability_bins,
)
from tests.support.fakedata import CRAFTED_PROBS, CRAFTED_TARGET


def test_error_rate_crafted():
    # Rows 2 and 4 are wrong: 2 / 5.
    assert error_rate(CRAFTED_PROBS, CRAFTED_TARGET).item() == pytest.approx(0.4)


def test_negative_log_likelihood_crafted():
    # p(y|x) per row: 0.7, 0.3, 0.8, 0.3, 0.9; mean of -log = 3.093126 / 5 = 0.618625.
    expected = -(math.log(0.7) + 2 * math.log(0.3) + math.log(0.8) + math.log(0.9)) / 5
    assert expected == pytest.approx(0.618625, abs=1e-6)
    nll = negative_log_likelihood(CRAFTED_PROBS.log(), CRAFTED_TARGET)
    assert nll.item() == pytest.approx(expected)


def test_brier_score_crafted():
    # Row 1: 0.3^2 + 0.2^2 + 0.1^2    = 0.14
    # Row 2: 0.2^2 + 0.5^2 + 0.7^2    = 0.78
    # Row 3: 0.1^2 + 0.1^2 + 0.2^2    = 0.06
    # Row 4: 0.6^2 + 0.7^2 + 0.1^2    = 0.86
    # Row 5: 0.05^2 + 0.1^2 + 0.05^2  = 0.015
    # Mean: 1.855 / 5 = 0.371 (summed over classes, not divided by C).
    assert brier_score(CRAFTED_PROBS, CRAFTED_TARGET).item() == pytest.approx(0.371)


def test_ece_crafted():
    # 4 bins [0, .25) [.25, .5) [.5, .75) [.75, 1]. Confidence 0.5 sits on an edge and goes up.
    # [.5, .75): rows 1, 2, 4 -> acc 1/3, conf (0.7 + 0.5 + 0.6) / 3 = 0.6, weight 3/5
    #            3/5 * |1/3 - 0.6| = 0.16
    # [.75, 1):  rows 3, 5    -> acc 1,   conf 0.85, weight 2/5 -> 2/5 * 0.15 = 0.06
    # ECE = 0.22
    ece = expected_calibration_error(CRAFTED_PROBS, CRAFTED_TARGET, n_bins=4)
    assert ece.item() == pytest.approx(0.22)
    tm = multiclass_calibration_error(CRAFTED_PROBS, CRAFTED_TARGET, num_classes=3, n_bins=4)
    assert tm.item() == pytest.approx(0.22, abs=1e-6)


def test_reliability_bins_crafted():
    bins = reliability_bins(CRAFTED_PROBS, CRAFTED_TARGET, n_bins=4)
    assert bins["count"].tolist() == [0, 0, 3, 2]
    assert bins["lower"].tolist() == [0.0, 0.25, 0.5, 0.75]
    assert bins["upper"].tolist() == [0.25, 0.5, 0.75, 1.0]
    # Empty bins are nan; the others as worked out in test_ece_crafted.
    assert torch.isnan(bins["accuracy"][:2]).all() and torch.isnan(bins["confidence"][:2]).all()
    assert bins["accuracy"][2:].tolist() == pytest.approx([1 / 3, 1.0])
    assert bins["confidence"][2:].tolist() == pytest.approx([0.6, 0.85])


def _random_predictions(n=500, c=5, seed=0):
    """Softmax of scaled Gaussian logits (a spread of confidences) and random labels."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, c, generator=gen, dtype=torch.float64)
    target = torch.randint(c, (n,), generator=gen)
    # Make about half the predictions right so accuracy is not ~1/C in every bin.
    right = torch.rand(n, generator=gen) < 0.5
    target = torch.where(right, logits.argmax(dim=1), target)
    return logits.log_softmax(dim=1), target


def _numpy_reference(log_probs, target, n_bins):
    """Straightforward loops over examples and bins."""
    lp, y = log_probs.numpy(), target.numpy()
    p = np.exp(lp)
    n, c = p.shape
    err = nll = brier = 0.0
    conf, correct = np.empty(n), np.empty(n)
    for i in range(n):
        pred = int(np.argmax(p[i]))
        conf[i], correct[i] = p[i, pred], float(pred == y[i])
        err += 1.0 - correct[i]
        nll += -lp[i, y[i]]
        brier += sum((p[i, k] - (1.0 if k == y[i] else 0.0)) ** 2 for k in range(c))
    ece = 0.0
    for b in range(n_bins):  # bins [b/M, (b+1)/M), the last one [(M-1)/M, 1]
        in_bin = (conf >= b / n_bins) & (conf < (b + 1) / n_bins) if b < n_bins - 1 else conf >= b / n_bins
        if in_bin.any():
            ece += in_bin.sum() / n * abs(correct[in_bin].mean() - conf[in_bin].mean())
    return {"error": err / n, "nll": nll / n, "brier": brier / n, "ece": ece}


@pytest.mark.parametrize("seed", [0, 1])
def test_functions_match_numpy_loops(seed):
    log_probs, target = _random_predictions(seed=seed)
    probs = log_probs.exp()
    ref = _numpy_reference(log_probs, target, n_bins=15)
    assert error_rate(probs, target).item() == pytest.approx(ref["error"])
    assert negative_log_likelihood(log_probs, target).item() == pytest.approx(ref["nll"])
    assert brier_score(probs, target).item() == pytest.approx(ref["brier"])
    assert expected_calibration_error(probs, target).item() == pytest.approx(ref["ece"])
    assert ref["ece"] > 0.01  # the check above is not trivially 0 == 0


def test_reliability_bins_match_numpy_loop():
    log_probs, target = _random_predictions(n=300, seed=2)
    probs = log_probs.exp()
    bins = reliability_bins(probs, target, n_bins=10)
    assert bins["count"].sum().item() == 300
    conf, pred = probs.max(dim=1)
    correct = (pred == target).double()
    for b in range(10):
        in_bin = (conf >= b / 10) & (conf < (b + 1) / 10) if b < 9 else conf >= 0.9
        assert bins["count"][b].item() == in_bin.sum().item()
        if in_bin.any():
            assert bins["accuracy"][b].item() == pytest.approx(correct[in_bin].mean().item())
            assert bins["confidence"][b].item() == pytest.approx(conf[in_bin].mean().item())


def test_ece_perfectly_calibrated_is_near_zero():
    # Two classes, confidence c ~ U(0.5, 1), right with probability c: calibrated by construction.
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    conf = 0.5 + 0.5 * torch.rand(n, generator=gen, dtype=torch.float64)
    right = torch.rand(n, generator=gen, dtype=torch.float64) < conf
    probs = torch.stack([conf, 1 - conf], dim=1)
    target = torch.where(right, 0, 1)
    assert expected_calibration_error(probs, target).item() < 0.01
    # The same confidences, right 10 points less often, are off by about 0.1.
    right_less = torch.rand(n, generator=gen, dtype=torch.float64) < conf - 0.1
    ece = expected_calibration_error(probs, torch.where(right_less, 0, 1)).item()
    assert ece == pytest.approx(0.1, abs=0.01)


def test_ece_confidence_on_bin_edge_goes_to_upper_bin():
    # 4 bins. Confidence 0.5 (right) lies on the edge between [.25, .5) and [.5, .75).
    # Upper bin (our convention, torchmetrics' away from 1.0): one bin with acc 0.5, conf 0.6 -> ECE 0.1.
    # Lower bin (Guo et al.'s right-closed bins) would give 1/2 * 0.5 + 1/2 * 0.7 = 0.6.
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]])
    target = torch.tensor([0, 1])
    assert expected_calibration_error(probs, target, n_bins=4).item() == pytest.approx(0.1)
    tm = multiclass_calibration_error(probs, target, num_classes=3, n_bins=4)
    assert tm.item() == pytest.approx(0.1)
    assert reliability_bins(probs, target, n_bins=4)["count"].tolist() == [0, 0, 2, 0]


def test_ece_confidence_one_falls_in_the_last_bin():
    # Confidence 1 (wrong) and 0.8 (right), 4 bins. Both fall in the last bin [.75, 1]:
    # |0.5 - 0.9| = 0.4. torchmetrics gives 1.0 a bin of its own (its issue #3510):
    # 1/2 * |0 - 1| + 1/2 * |1 - 0.8| = 0.6. The convention changed from torchmetrics' to the
    # reliability diagram's, hence 0.4 here where this test once expected 0.6.
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.1, 0.1]])
    target = torch.tensor([1, 0])
    assert expected_calibration_error(probs, target, n_bins=4).item() == pytest.approx(0.4)
    tm = multiclass_calibration_error(probs, target, num_classes=3, n_bins=4)
    assert tm.item() == pytest.approx(0.6)  # torchmetrics' own bin for 1.0
    bins = reliability_bins(probs, target, n_bins=4)
    assert bins["count"].tolist() == [0, 0, 0, 2]
    assert bins["accuracy"][3].item() == pytest.approx(0.5)


@pytest.mark.parametrize("n_bins", [4, 10, 15])
def test_ece_with_confidences_of_one_equals_its_reliability_diagram(n_bins):
    """The ECE of predictions with confidences of exactly 1.0 is the count-weighted gap of the
    reliability diagram's bins: the diagram's own bars (reliability_bins, which plots.py draws),
    the logged ECE of ClassificationMetrics and the resampled ECE at unit weights all agree."""
    from dbsn.metrics.intervals import weighted_ece

    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(4 * torch.randn(400, 5, generator=gen, dtype=torch.float64), 1)
    # Always right, so under-confident (gaps above 0), except the certain ones (confidence exactly 1.0,
    # gaps at most 0): it matters which bin the 1.0s share.
    target = probs.argmax(1)
    ones = torch.arange(0, 400, 7)  # every 7th example certain: confidence exactly 1.0, mostly wrong
    probs[ones] = torch.nn.functional.one_hot(torch.randint(5, (len(ones),), generator=gen), 5).double()
    assert (probs.max(1).values == 1.0).sum() == len(ones)
    bins = reliability_bins(probs, target, n_bins)
    assert bins["count"].sum() == 400  # every prediction, 1.0 included, is in one of the diagram's bars
    filled = bins["count"] > 0
    share = bins["count"][filled].double() / 400
    from_diagram = (share * (bins["accuracy"][filled] - bins["confidence"][filled]).abs()).sum()
    ece = expected_calibration_error(probs, target, n_bins)
    assert ece.item() == pytest.approx(from_diagram.item(), abs=1e-12)
    metrics = ClassificationMetrics(num_classes=5, ece_bins=n_bins)
    metrics.update(probs[:150].log(), target[:150])
    metrics.update(probs[150:].log(), target[150:])
    assert metrics.compute()["ece"].item() == pytest.approx(ece.item(), abs=1e-6)
    assert weighted_ece(probs, target, torch.ones(400), n_bins)[0].item() == pytest.approx(ece.item(), abs=1e-12)
    # torchmetrics bins 1.0 on its own (issue #3510), so it differs here...
    tm = multiclass_calibration_error(probs, target, num_classes=5, n_bins=n_bins, norm="l1")
    assert abs(tm.item() - ece.item()) > 1e-4
    # ... and agrees where no confidence is exactly 1.0.
    rest = probs.max(1).values < 1
    tm_rest = multiclass_calibration_error(probs[rest].float(), target[rest], num_classes=5, n_bins=n_bins, norm="l1")
    ours = expected_calibration_error(probs[rest].float(), target[rest], n_bins).item()
    assert tm_rest.item() == pytest.approx(ours, abs=1e-5)  # float32 rounding; a moved example shifts it by ~1e-3


def test_ece_all_right_with_confidence_one_is_zero():
    target = torch.tensor([0, 2, 1, 2])
    probs = torch.nn.functional.one_hot(target, 3).double()
    assert expected_calibration_error(probs, target).item() == 0.0
    assert error_rate(probs, target).item() == 0.0
    assert brier_score(probs, target).item() == 0.0


@pytest.mark.parametrize("seed", [0, 3])
def test_torchmetrics_ece_equals_hand_ece(seed):
    log_probs, target = _random_predictions(seed=seed)
    probs = log_probs.float().exp()  # torchmetrics bins in float32
    tm = multiclass_calibration_error(probs, target, num_classes=5, n_bins=15, norm="l1")
    assert tm.item() == pytest.approx(expected_calibration_error(probs, target).item(), abs=1e-6)


def test_classification_metrics_accumulates_batches():
    log_probs, target = _random_predictions(n=400, seed=4)
    log_probs = log_probs.float()
    metrics = ClassificationMetrics(num_classes=5)
    for lp, y in zip(log_probs.split([100, 37, 200, 63]), target.split([100, 37, 200, 63])):
        metrics.update(lp, y)
    result = metrics.compute()
    assert set(result) == {"error", "nll", "brier", "ece"}
    probs = log_probs.exp()
    expected = {
        "error": error_rate(probs, target),
        "nll": negative_log_likelihood(log_probs, target),
        "brier": brier_score(probs, target),
        "ece": expected_calibration_error(probs, target, n_bins=15),
    }
    for key, value in expected.items():
        assert result[key].item() == pytest.approx(value.item(), abs=1e-5), key

    # After reset only the new batch counts.
    metrics.reset()
    metrics.update(log_probs[:50], target[:50])
    assert metrics.compute()["nll"].item() == pytest.approx(
        negative_log_likelihood(log_probs[:50], target[:50]).item(), abs=1e-5
    )


def test_classification_metrics_crafted_and_bin_count():
    # The crafted example through the module; with 4 ECE bins it gives the hand value 0.22.
    metrics = ClassificationMetrics(num_classes=3, ece_bins=4)
    metrics.update(CRAFTED_PROBS.float().log(), CRAFTED_TARGET)
    result = {k: v.item() for k, v in metrics.compute().items()}
    assert result == pytest.approx({"error": 0.4, "nll": 0.618625, "brier": 0.371, "ece": 0.22}, abs=1e-5)
