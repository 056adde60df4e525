"""An evaluation's statistics (dbsn.evaluation.statistics): the intervals cover the truth as often
as they say, row 0 of every statistic is the plain metric, calibration fits on held-out
predictions only, and everything is seeded."""

from __future__ import annotations

import pytest
import torch

from dbsn.evaluation.results import interval_numbers
from dbsn.evaluation.statistics import Statistics, calibrate, classification_statistics, intervals_of
from dbsn.methods.temperature import TemperatureScaler
from dbsn.metrics.calibration import (
    adaptive_expected_calibration_error,
    classwise_expected_calibration_error,
    squared_calibration_error,
)
from dbsn.metrics.classification import brier_score, error_rate, expected_calibration_error, negative_log_likelihood
from dbsn.metrics.intervals import weighted_ece, weighted_error
from dbsn.metrics.selective import selective_metrics


def _miscalibrated(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-class predictions whose confidence v is 0.55, 0.75 or 0.95 (probabilities 0.3, 0.3,
    0.4) and right with probability v - 0.1: the population's ECE is exactly 0.1 (each v in its
    own bin) and its error rate 1 - 0.67 = 0.33."""
    v = torch.tensor([0.55, 0.75, 0.95], dtype=torch.float64)[
        torch.multinomial(torch.tensor([0.3, 0.3, 0.4]), n, True, generator=generator)
    ]
    right = torch.rand(n, generator=generator, dtype=torch.float64) < v - 0.1
    probs = torch.stack([v, 1 - v], 1)
    return probs.log(), (~right).long()  # class 0 is predicted: right when the target is 0


def test_the_95_percent_intervals_of_error_and_ece_cover_the_truth_95_percent_of_the_time():
    generator, draws, covered = torch.Generator().manual_seed(0), 200, {"test/error": 0, "test/ece": 0}
    truth = {"test/error": 0.33, "test/ece": 0.1}
    for draw in range(draws):
        log_probs, targets = _miscalibrated(2000, generator)
        weights = Statistics(seed=draw, resamples=1000).weights(len(targets))
        probs = log_probs.exp()
        found = {
            "test/error": weighted_error(probs, targets, weights),
            "test/ece": weighted_ece(probs, targets, weights),
        }
        intervals = intervals_of(found, 0.95)
        for key, (low, high) in intervals.items():
            covered[key] += low <= truth[key] <= high
    for key, hits in covered.items():  # binomial(200, 0.95): mean 190, sd 3.1; 3 sd either side
        assert 180 <= hits <= 199, (key, hits)


def test_row_zero_of_every_statistic_is_the_plain_metric():
    g = torch.Generator().manual_seed(1)
    log_probs = torch.log_softmax(2 * torch.randn(400, 6, generator=g, dtype=torch.float64), 1)
    targets = torch.randint(6, (400,), generator=g)
    probs = log_probs.exp()
    scores = {"max_probability": probs.max(1).values, "predictive_entropy": -(probs * log_probs).sum(1)}
    calibrated = torch.log_softmax(log_probs / 1.7, 1)
    found = classification_statistics(log_probs, targets, scores, Statistics(resamples=5).weights(400), calibrated)
    plain = {
        "test/error": error_rate(probs, targets),
        "test/nll": negative_log_likelihood(log_probs, targets),
        "test/brier": brier_score(probs, targets),
        "test/ece": expected_calibration_error(probs, targets),
        "test/adaptive_ece": adaptive_expected_calibration_error(probs, targets, n_bins=15),
        "test/classwise_ece": classwise_expected_calibration_error(probs, targets, n_bins=15),
        "test/calibrated/nll": negative_log_likelihood(calibrated, targets),
        "test/calibrated/brier": brier_score(calibrated.exp(), targets),
        "test/calibrated/ece": expected_calibration_error(calibrated.exp(), targets),
        "test/ce2": squared_calibration_error(probs, targets),
        "test/calibrated/ce2": squared_calibration_error(calibrated.exp(), targets),
    }
    errors = (probs.argmax(1) != targets).double()
    plain.update(selective_metrics(errors, scores))
    assert set(found) == set(plain)
    for key, value in plain.items():
        assert found[key].shape == (6,)
        assert abs(float(found[key][0]) - float(value)) < 1e-9, key


def test_calibration_fits_on_validation_or_on_the_other_half_of_the_test_set():
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(600, 4, generator=g, dtype=torch.float64)
    targets = torch.multinomial(torch.softmax(logits / 3, 1), 1, generator=g).squeeze(1)  # over-confident by 3
    log_probs = torch.log_softmax(logits, 1)
    val = (log_probs[:200], targets[:200])
    calibrated, how = calibrate(log_probs[200:], targets[200:], validation=val)
    scaler = TemperatureScaler()
    scaler.fit(*val)
    assert how["fitted_on"] == "validation" and abs(how["temperature"] - scaler.temperature) < 1e-12
    assert torch.allclose(calibrated, torch.log_softmax(log_probs[200:] / scaler.temperature, 1))
    assert 2 < how["temperature"] < 4.5  # the over-confidence found
    cv, how_cv = calibrate(log_probs, targets, seed=3)
    assert how_cv["fitted_on"].startswith("test, 2-fold") and len(how_cv["temperature"]) == 2
    assert torch.equal(cv, calibrate(log_probs, targets, seed=3)[0])  # seeded
    assert not torch.equal(cv, calibrate(log_probs, targets, seed=4)[0])
    order = torch.randperm(600, generator=torch.Generator().manual_seed(3))
    first, second = order[:300], order[300:]
    on_second = TemperatureScaler()
    on_second.fit(log_probs[second], targets[second])  # the first half is calibrated by the second's temperature
    assert torch.allclose(cv[first], torch.log_softmax(log_probs[first] / on_second.temperature, 1))
    assert negative_log_likelihood(cv, targets) < negative_log_likelihood(log_probs, targets)
    assert torch.equal(cv.argmax(1), log_probs.argmax(1))  # a temperature never moves the argmax


def test_statistics_are_seeded_and_checked():
    assert torch.equal(Statistics(seed=5).weights(30), Statistics(seed=5).weights(30))
    assert not torch.equal(Statistics(seed=5).weights(30), Statistics(seed=6).weights(30))
    assert bool((Statistics(seed=5).weights(30)[0] == 1).all())
    for bad in ({"resamples": 0}, {"level": 1.0}, {"seed": "a"}):
        with pytest.raises(ValueError, match="statistics"):
            Statistics(**bad)
    assert interval_numbers({"test/error": [0.1, 0.2]}) == {"test/error/ci_low": 0.1, "test/error/ci_high": 0.2}
