"""Inference over seeds that share a test set (dbsn.evaluation.report.seeds, format.seed_cell,
population.PopulationCells): the variance formula against Monte Carlo, the degrees of freedom at
their limits, the bounded covariance, Holm's reach, and the cells the tables of test-pass metrics
build from runs' predictions. Coverage through the report's functions: test_seed_coverage.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm, t

from dbsn.evaluation.report.collect import Run
from dbsn.evaluation.report.format import SEEDS_AND_TEST, SEEDS_AND_TEST_BOUND, TEST_ONLY, seed_cell, t_interval
from dbsn.evaluation.report.population import PopulationCells
from dbsn.evaluation.report.seeds import (
    bounded_covariance,
    combine_seeds,
    holm_note,
    holm_reachable,
    holm_threshold,
    resampled_covariance,
)
from dbsn.evaluation.statistics import Statistics
from dbsn.metrics.intervals import weighted_error


def test_the_variance_of_the_mean_is_the_seeds_spread_over_k_plus_their_shared_test_covariance():
    """k = 4 seeds with unequal, correlated test noise (Σ) and seed effects: Var(mean) = E[s²]/k + c by
    Monte Carlo (c: Σ's mean off-diagonal), while adding the test noise of the mean to s²/k counts each
    seed's own noise twice."""
    rng = np.random.default_rng(0)
    k, draws, seed_sd = 4, 400_000, 0.5
    sd = np.array([1.0, 0.8, 1.2, 0.9])
    correlation = np.array([[1, 0.7, 0.5, 0.6], [0.7, 1, 0.4, 0.8], [0.5, 0.4, 1, 0.3], [0.6, 0.8, 0.3, 1]])
    sigma = correlation * np.outer(sd, sd)
    x = seed_sd * rng.standard_normal((draws, k)) + rng.standard_normal((draws, k)) @ np.linalg.cholesky(sigma).T
    c = (sigma.sum() - np.trace(sigma)) / (k * (k - 1))
    variance, s2 = x.mean(1).var(), x.var(1, ddof=1).mean()
    assert s2 / k + c == pytest.approx(variance, rel=0.01)
    assert s2 / k + sigma.sum() / k**2 > 1.1 * variance  # the double count


def test_combine_seeds_at_its_limits():
    values = torch.tensor([0.10, 0.14, 0.12])
    # no shared test noise: Student's t over the seeds on k - 1 degrees of freedom
    found = combine_seeds(values, torch.zeros(3, 3), 0.95)
    assert found.df == pytest.approx(2) and (found.low, found.high) == pytest.approx(t_interval(values.tolist()))
    assert found.p == pytest.approx(2 * t.sf(0.12 / (0.02 / 3**0.5), 2))
    # shared noise only (seeds that agree exactly): normal theory on c
    found = combine_seeds(torch.full((3,), 0.12), torch.full((3, 3), 1e-4), 0.95)
    assert math.isinf(found.df) and found.high - found.value == pytest.approx(norm.ppf(0.975) * 1e-2)
    # shared noise added to the seeds' variance, the degrees of freedom between k - 1 and many
    found = combine_seeds(values, torch.full((3, 3), 1e-4) + 1e-4 * torch.eye(3), 0.95)
    assert 2 < found.df < 50 and found.high - found.value == pytest.approx(
        t.ppf(0.975, found.df) * (0.02**2 / 3 + 1e-4) ** 0.5
    )
    # one seed: value ± z sqrt(variance), normal p
    found = combine_seeds(torch.tensor([0.03]), torch.tensor([[1e-4]]), 0.95)
    assert (found.low, found.high) == pytest.approx((0.03 - norm.ppf(0.975) * 0.01, 0.03 + norm.ppf(0.975) * 0.01))
    assert found.p == pytest.approx(2 * norm.sf(3.0)) and math.isinf(found.df)
    assert combine_seeds(torch.zeros(2), torch.zeros(2, 2), 0.95)[:4] == (0.0, 0.0, 0.0, 1.0)


def test_the_bounded_covariance_is_at_least_the_true_one():
    """From each seed's 95 % interval alone: its SD and perfect correlation, never below any covariance
    the same SDs allow (Cauchy–Schwarz)."""
    z = norm.ppf(0.975)
    bound = bounded_covariance([[0.1 - z * 0.01, 0.1 + z * 0.01], [0.2 - z * 0.02, 0.2 + z * 0.02]])
    assert bound.numpy() == pytest.approx(np.array([[1e-4, 2e-4], [2e-4, 4e-4]]))
    rows = torch.randn(2, 5000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows[1] = 0.5 * rows[0] + rows[1]
    found = resampled_covariance(rows)
    assert found.numpy() == pytest.approx(np.cov(rows.numpy()))
    assert float(found[0, 1]) <= float(found[0, 0] * found[1, 1]) ** 0.5


def test_holm_is_out_of_reach_at_three_seeds_in_a_family_of_thirty():
    assert holm_threshold(30, 2) == pytest.approx(t.ppf(1 - 0.05 / 60, 2)) and 24.4 < holm_threshold(30, 2) < 24.6
    assert holm_threshold(30, math.inf) == pytest.approx(norm.ppf(1 - 0.05 / 60))
    assert not holm_reachable(30, 2) and not holm_reachable(30, 4)
    assert holm_reachable(30, 9) and holm_reachable(30, math.inf) and holm_reachable(4, 4) and not holm_reachable(4, 3)
    note = holm_note(30, [2.0, 2.0])
    assert "2 of these 30" in note and "|t| ≥ 24.5" in note and "p ≤ 0.0017" in note and holm_note(30, []) == ""


N, C = 300, 4


def _predictions(seed: int, accuracy: float, targets: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    targets = torch.arange(N) % C if targets is None else targets
    difficulty = torch.rand(N, generator=torch.Generator().manual_seed(0))  # the test set's, shared by every seed
    right = 0.8 * difficulty + 0.2 * torch.rand(N, generator=torch.Generator().manual_seed(seed)) < accuracy
    probs = torch.full((N, C), 0.1, dtype=torch.float64)
    probs[torch.arange(N), torch.where(right, targets, (targets + 1) % C)] = 0.7
    return {"log_probs": probs.log().float().numpy(), "targets": targets.numpy()}


def _run(folder, seed: int, accuracy: float, interval=None, predictions: bool = True, targets=None) -> Run:
    folder.mkdir(parents=True)
    arrays = _predictions(seed, accuracy, targets)
    if predictions:
        np.savez(folder / "predictions.npz", **arrays)
    error = float((np.argmax(arrays["log_probs"], 1) != arrays["targets"]).mean())
    return Run(
        folder,
        "map",
        "cifar10",
        seed,
        "ok",
        metrics={"test/error": error},
        intervals={} if interval is None else {"test/error": interval},
    )


def test_a_cell_of_runs_with_predictions_adds_the_test_noise_they_share(tmp_path):
    """Three seeds' predictions on one test set: the cell is `seed_cell` of their errors with the
    covariance of their errors on the same resamples; without predictions for one of them, each run's
    interval bounds it (§); one seed keeps its own interval; test sets that differ are not paired."""
    statistics = Statistics(seed=3, resamples=200)
    runs = [_run(tmp_path / str(s), s, 0.7 + 0.05 * s, [0.1, 0.3]) for s in range(3)]
    cells = PopulationCells(statistics)
    cell = cells.cell(runs, "test/error", 100.0)
    weights, targets = statistics.weights(N), torch.arange(N) % C
    log_probs = [torch.from_numpy(np.load(r.path / "predictions.npz")["log_probs"]).double() for r in runs]
    rows = torch.stack([weighted_error(lp.exp(), targets, weights) for lp in log_probs])
    expected = seed_cell([100 * r.metrics["test/error"] for r in runs], 1e4 * torch.cov(rows[:, 1:]), 0.95)
    assert cell == pytest.approx(expected) and cell.interval == SEEDS_AND_TEST
    assert float(torch.cov(rows[:, 1:])[0, 1]) > 0  # the examples' shared difficulty: the seeds' noises correlate
    runs.append(_run(tmp_path / "3", 3, 0.8, [0.1, 0.3], predictions=False))
    assert cells.cell(runs, "test/error").interval == SEEDS_AND_TEST_BOUND
    assert cells.cell(runs[:1], "test/error")[3:] == (0.1, 0.3, TEST_ONLY)
    other = _run(tmp_path / "4", 4, 0.8, [0.1, 0.3], targets=(torch.arange(N) + 1) % C)
    assert cells.cell([runs[0], other], "test/error").interval == SEEDS_AND_TEST_BOUND
