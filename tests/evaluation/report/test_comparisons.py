"""The report's comparisons (dbsn.evaluation.report.comparisons): paired differences are
antisymmetric, zero against oneself and of the right sign on a crafted case; Holm's procedure by
hand; the paired, cost and deep-ensemble-equivalent sections on hand-made runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dbsn.evaluation.report import build_report
from dbsn.evaluation.report.comparisons import holm, paired_differences
from dbsn.evaluation.statistics import Statistics
from tests.support.fakeruns import MODELS, write_run

N, C = 400, 4


def _predictions(seed: int, accuracy: float, confidence: float = 0.7) -> dict[str, torch.Tensor]:
    """Predictions on one fixed test set (the targets do not depend on `seed`): right on a share
    `accuracy` of the examples (drawn with `seed`), with the given confidence in the argmax."""
    targets = torch.arange(N) % C
    g = torch.Generator().manual_seed(seed)
    right = torch.rand(N, generator=g) < accuracy
    predicted = torch.where(right, targets, (targets + 1) % C)
    probs = torch.full((N, C), (1 - confidence) / (C - 1), dtype=torch.float64)
    probs[torch.arange(N), predicted] = confidence
    return {"log_probs": probs.log(), "targets": targets}


def test_a_paired_difference_is_antisymmetric_and_zero_against_oneself():
    statistics = Statistics(seed=1, resamples=300)
    a = {1: _predictions(1, 0.8), 2: _predictions(2, 0.8)}
    b = {1: _predictions(11, 0.75, 0.8), 2: _predictions(12, 0.75, 0.8)}
    ab, ba, aa = (
        paired_differences(a, b, statistics),
        paired_differences(b, a, statistics),
        paired_differences(a, a, statistics),
    )
    assert set(ab) == {"error", "NLL", "Brier", "CE²"}  # no calibrated predictions given; no plug-in ECE
    for name in ab:
        for seed in (1, 2):
            value, low, high = ab[name]["seeds"][seed]
            other = ba[name]["seeds"][seed]
            assert (
                value == pytest.approx(-other[0])
                and low == pytest.approx(-other[2])
                and high == pytest.approx(-other[1])
            )
            assert aa[name]["seeds"][seed] == (0.0, 0.0, 0.0)
        assert ab[name]["combined"][0] == pytest.approx(-ba[name]["combined"][0])
        assert aa[name]["combined"] == (0.0, 0.0, 0.0) and aa[name]["p"] == 1.0


def test_a_crafted_better_method_has_a_negative_difference_whose_interval_excludes_zero():
    targets = torch.arange(N) % C
    worse = _predictions(0, 0.6)
    better = {"log_probs": worse["log_probs"].clone(), "targets": targets}
    fixed = torch.arange(N) % 5 == 0  # the better method also gets every fifth example right that the worse one missed
    wrong = worse["log_probs"].argmax(1) != targets
    better["log_probs"][fixed & wrong] = worse["log_probs"][fixed & wrong].roll(
        -1, dims=1
    )  # moves the argmax to the target
    assert bool((better["log_probs"].argmax(1) == targets)[fixed].all())
    gained = int((fixed & wrong).sum()) / N
    found = paired_differences({0: better}, {0: worse}, Statistics(resamples=500))
    value, low, high = found["error"]["combined"]
    assert value == pytest.approx(-gained) and low < value < high < 0
    assert found["error"]["p"] < 0.01
    # unpaired, the two error intervals overlap; paired, the difference is sharply negative
    assert high - low < 2 * 1.96 * (0.6 * 0.4 / N) ** 0.5


def test_holm_by_hand():
    # sorted: 0.001 <= 0.05/4, 0.012 <= 0.05/3, 0.03 > 0.05/2: stop; 0.04 not rejected either
    assert holm([0.03, 0.001, 0.04, 0.012]) == [False, True, False, True]
    assert holm([0.2, 0.5]) == [False, False] and holm([]) == []


def _seed_rows(k: int, delta: float, seed_sd: float, test_sd: float, resamples: int, generator) -> torch.Tensor:
    """(k, 1 + resamples) difference rows of k seeds on one shared test set: each seed's difference is
    delta + its seed effect + the shared test-set noise, and its resampled values move with the common
    resamples (the same draws for every seed) plus a little of its own."""
    seed_effects = seed_sd * torch.randn(k, 1, generator=generator, dtype=torch.float64)
    shared = test_sd * torch.randn(1, resamples + 1, generator=generator, dtype=torch.float64)
    own = 0.3 * test_sd * torch.randn(k, resamples + 1, generator=generator, dtype=torch.float64)
    rows = delta + seed_effects + shared + own
    rows[:, 1:] = (
        rows[:, 1:] - rows[:, 1:].mean(1, keepdim=True) + rows[:, :1]
    )  # resamples centred on each seed's value
    return rows


def test_the_combined_interval_holds_its_level_at_three_seeds_where_seed_noise_dominates():
    """Three seeds whose spread is five times the test set's: the combined 95 % interval covers the true
    difference in about 95 % of 1,000 simulations, and its test rejects a null difference in about 5 %
    (a review measured a two-level bootstrap over three seeds at about 81 % and 19 %)."""
    from dbsn.evaluation.report.comparisons import combine_seeds
    from dbsn.evaluation.report.seeds import resampled_covariance

    generator = torch.Generator().manual_seed(0)
    covered, rejected, runs = 0, 0, 1000
    for _ in range(runs):
        rows = _seed_rows(3, 0.0, 0.05, 0.01, 200, generator)
        value, low, high, p, df = combine_seeds(rows[:, 0], resampled_covariance(rows[:, 1:]), 0.95)
        covered += low <= 0.0 <= high
        rejected += p <= 0.05
    assert 0.93 <= covered / runs <= 0.99, covered
    assert 0.01 <= rejected / runs <= 0.07, rejected


def test_holm_rejects_a_real_difference_in_a_family_of_thirty():
    """One real difference among 30 comparisons, one seed each, 1,000 resamples: its normal-theory p is
    small enough for Holm's first step (0.05 / 30); a bootstrap p could not go below 2 / 1,001."""
    from dbsn.evaluation.report.comparisons import combine_seeds

    def p_value(rows: torch.Tensor) -> float:
        return combine_seeds(rows[:, 0], rows[:, 1:].var().reshape(1, 1), 0.95).p

    generator = torch.Generator().manual_seed(1)
    family = [p_value(_seed_rows(1, 0.0, 0.0, 0.01, 1000, generator)) for _ in range(29)]
    real = p_value(_seed_rows(1, 0.08, 0.0, 0.01, 1000, generator))
    assert real < 0.05 / 30 < 2 / 1001
    rejected = holm([real, *family])
    assert rejected[0] and sum(rejected[1:]) <= 1


def test_calibrated_metrics_are_paired_only_between_runs_calibrated_alike():
    from dbsn.evaluation.report.comparisons import _same_calibration

    a = {**_predictions(1, 0.8), "calibrated_log_probs": torch.zeros(N, C), "calibrated_on": "validation"}
    b = {
        **_predictions(2, 0.8),
        "calibrated_log_probs": torch.zeros(N, C),
        "calibrated_on": "test, 2-fold cross-validation (Ashukha et al. 2020)",
    }
    assert "calibrated_log_probs" not in _same_calibration(a, b)
    assert _same_calibration(a, {**b, "calibrated_on": "validation"}) is a
    found = paired_differences({1: _same_calibration(a, b)}, {1: b}, Statistics(resamples=50))
    assert not any(name.startswith("calibrated") for name in found)


def test_an_interval_that_misses_its_estimate_says_why():
    from dbsn.evaluation.report.format import OUTSIDE_NOTE, Cell, fmt

    assert fmt(Cell(0.0264, None, 1, 0.0288, 0.0713), 4) == f"0.0264 [0.0288, 0.0713] {OUTSIDE_NOTE} (1)"
    assert fmt(Cell(0.03, None, 1, 0.0288, 0.0713), 4) == "0.0300 [0.0288, 0.0713] (1)"


def _run(folder: Path, method: str, seed: int, predictions: dict, cost: dict | None = None, ablation=None) -> Path:
    write_run(
        folder,
        MODELS.get(method, {"_target_": "dbsn.methods.DeepEnsemble", "weights": None}),
        "dbsn.data.CIFAR10DataModule",
        seed,
        0.1,
    )
    record = json.loads((folder / "metrics.json").read_text())
    record["metrics"]["test/calibrated/nll"] = 0.5
    record["intervals"] = {"test/error": [0.05, 0.15]}
    record["cost"] = cost or {}
    (folder / "metrics.json").write_text(json.dumps(record))
    np.savez(
        folder / "predictions.npz",
        log_probs=predictions["log_probs"].float().numpy(),
        targets=predictions["targets"].numpy(),
    )
    if ablation is not None:
        (folder / "ablation").mkdir()
        (folder / "ablation" / "results.json").write_text(json.dumps(ablation))
    return folder


def test_the_report_pairs_methods_by_seed_and_draws_the_cost_and_the_ensemble_equivalent(tmp_path):
    cost = {
        "params": 1000,
        "train_flops_per_image": 3e6,
        "predict_flops_per_image": 1e6,
        "n_samples": 1,
        "epoch_seconds": 2.0,
        "peak_memory_mib": 100.0,
        "peak_memory_of": "cpu_max_rss",
    }
    for seed in (1, 2):
        _run(
            tmp_path / "runs" / f"dbsn{seed}",
            "dbsn",
            seed,
            _predictions(seed, 0.8),
            {**cost, "predict_flops_per_image": 5e6},
        )
        _run(tmp_path / "runs" / f"map{seed}", "map", seed, _predictions(10 + seed, 0.8), cost)
    ensemble = _predictions(30, 0.85)
    curve = [
        {"n_samples": 1, "calibrated_nll": 0.9},
        {"n_samples": 2, "calibrated_nll": 0.6},
        {"n_samples": 3, "calibrated_nll": 0.3},
    ]
    _run(
        tmp_path / "runs" / "de1",
        "deep_ensemble",
        1,
        ensemble,
        {**cost, "predict_flops_per_image": 3e6},
        ablation=curve,
    )
    out = tmp_path / "report"
    report = build_report([tmp_path / "runs"], out)
    text = (out / "report.md").read_text()
    assert "## Paired differences against dbsn" in text and (out / "paired.md").is_file()
    with (out / "paired.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == {"map", "deep_ensemble"} and {r["metric"] for r in rows} >= {"error", "NLL"}
    error = next(r for r in rows if (r["method"], r["metric"]) == ("map", "error"))
    assert set(json.loads(error["per_seed"])) == {"1", "2"} and float(error["low"]) <= float(
        error["difference"]
    ) <= float(error["high"])
    assert any(line.startswith("cifar10: indistinguishable from dbsn") for line in report.summary)
    assert "## Cost" in text and (out / "pareto_cifar10.png").stat().st_size > 1000
    assert "## Deep-ensemble equivalent" in text
    with (out / "equivalent.csv").open() as f:
        dee = {r["method"]: r for r in csv.DictReader(f)}
    assert set(dee) == {"dbsn", "map", "deep_ensemble"}
    for row in dee.values():  # monotone: a lower calibrated NLL, a larger equivalent
        assert 1.0 <= float(row["dee"])
    ordered = sorted(dee.values(), key=lambda r: float(r["calibrated_nll"]))
    assert [float(r["dee"]) for r in ordered] == sorted((float(r["dee"]) for r in ordered), reverse=True)
    other = build_report([tmp_path / "runs"], tmp_path / "report_map", reference="map")
    assert "## Paired differences against map" in (other.out / "report.md").read_text()


def _ensemble_run(folder: Path, seed: int, sizes: list[int], statistics: Statistics) -> Path:
    """A deep-ensemble run whose ablation saved each size's per-example calibrated NLL, as an evaluation
    writes it: predictions of its last size, a curve falling with its size."""
    from dbsn.evaluation.ablation import CALIBRATED_NLL_FILE
    from dbsn.evaluation.report.collect import Run
    from dbsn.evaluation.report.comparisons import _calibrated_nll

    predictions = _predictions(40 + seed, 0.85, 0.75)
    _run(folder, "deep_ensemble", seed, predictions)
    _, last = _calibrated_nll(Run(folder, "deep_ensemble", "cifar10", seed, "ok"), statistics)
    nll = torch.stack([last + 0.3 * (sizes[-1] - s) / sizes[-1] for s in sizes])
    (folder / "ablation").mkdir()
    (folder / "ablation" / "results.json").write_text(
        json.dumps([{"n_samples": s, "calibrated_nll": float(v.mean())} for s, v in zip(sizes, nll)])
    )
    np.savez(folder / CALIBRATED_NLL_FILE, sizes=np.array(sizes), nll=nll.float().numpy())
    return folder


def test_the_ensemble_equivalent_carries_the_curves_noise_and_names_what_it_leaves_out(tmp_path):
    """With each ensemble run's per-example curve saved, the equivalent's interval is
    `equivalent_interval` of both sides' per-example NLLs (the same test examples); a method with one
    run names the seeds it leaves out; the ensemble is its own size; an ensemble without saved
    per-example NLLs leaves out its curve's noise, and the table says so."""
    from dbsn.evaluation.report.collect import Run
    from dbsn.evaluation.report.comparisons import UNSAVED_CURVE, _calibrated_nll
    from dbsn.metrics.ensemble_equivalent import METHOD_RUNS, equivalent_interval

    statistics, sizes = Statistics(resamples=100), [1, 2, 3, 4]
    runs = tmp_path / "runs"
    ensembles = [_ensemble_run(runs / f"de{seed}", seed, sizes, statistics) for seed in (1, 2)]
    maps = [_run(runs / f"map{seed}", "map", seed, _predictions(20 + seed, 0.83, 0.75)) for seed in (1, 2)]
    _run(runs / "dbsn1", "dbsn", 1, _predictions(30, 0.83, 0.75))
    build_report([runs], tmp_path / "report", statistics=statistics)
    with (tmp_path / "report" / "equivalent.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    curves = torch.stack(
        [torch.from_numpy(np.load(e / "ablation" / "calibrated_nll.npz")["nll"]).double() for e in ensembles]
    )
    method = torch.stack([_calibrated_nll(Run(m, "map", "cifar10", 0, "ok"), statistics)[1] for m in maps])
    expected = equivalent_interval(method, curves, sizes, statistics.level)
    assert [float(rows["map"][k]) for k in ("dee", "dee_low", "dee_high")] == pytest.approx(expected[:3])
    assert rows["map"]["leaves_out"] == "" and rows["dbsn"]["leaves_out"] == METHOD_RUNS
    assert [float(rows["deep_ensemble"][k]) for k in ("dee", "dee_low", "dee_high")] == [4.0, 4.0, 4.0]
    table = (tmp_path / "report" / "equivalent.md").read_text()
    assert "| the interval leaves out |" in table and f"| {METHOD_RUNS} |" in table
    (runs / "de2" / "ablation" / "calibrated_nll.npz").unlink()  # an ensemble evaluated before they were saved
    build_report([runs], tmp_path / "report")
    with (tmp_path / "report" / "equivalent.csv").open() as f:
        assert {r["method"]: r["leaves_out"] for r in csv.DictReader(f)}["map"] == UNSAVED_CURVE


def test_a_report_at_three_seeds_says_where_holm_cannot_reach_significance(tmp_path):
    """Two methods against dbsn at three seeds whose accuracies spread widely: eight comparisons on
    about 2 degrees of freedom, where Holm's first step needs |t| >= 12.6. The paired table gives
    that |t| in the p column and says so below the table; its CSV marks them unreachable."""
    for seed, spread in ((1, -0.1), (2, 0.0), (3, 0.1)):
        _run(tmp_path / "runs" / f"dbsn{seed}", "dbsn", seed, _predictions(seed, 0.75))
        _run(tmp_path / "runs" / f"map{seed}", "map", seed, _predictions(10 + seed, 0.75 + spread))
        _run(tmp_path / "runs" / f"de{seed}", "deep_ensemble", seed, _predictions(20 + seed, 0.8 - spread))
    build_report([tmp_path / "runs"], tmp_path / "report")
    text = (tmp_path / "report" / "paired.md").read_text()
    assert "Holm's correction cannot reach significance for 8 of these 8 comparisons at their few seeds" in text
    assert "p ≤ 0.0063 (0.05 / 8)" in text and "(Holm needs \\|t\\| ≥ 12." in text
    assert "against 2.7 with the noise known" in text
    with (tmp_path / "report" / "paired.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and all(r["holm_reachable"] == "False" and float(r["df"]) < 3 for r in rows)
    assert all(float(r["holm_needs_p"]) == pytest.approx(0.05 / 8) for r in rows)


def test_a_post_hoc_runs_predictions_are_read_from_its_evaluation(tmp_path):
    from dbsn.evaluation.report.collect import Run
    from dbsn.evaluation.report.comparisons import load_predictions

    folder = tmp_path / "run" / "posthoc" / "laplace"
    (folder / "evaluation").mkdir(parents=True)
    np.savez(
        folder / "evaluation" / "predictions.npz", log_probs=np.zeros((3, 2), np.float32), targets=np.arange(3) % 2
    )
    found = load_predictions(Run(folder, "map_fixed+laplace", "digits", 0, "ok"))
    assert found["log_probs"].dtype == torch.float64 and found["targets"].tolist() == [0, 1, 0]
    assert load_predictions(Run(tmp_path / "run", "map_fixed", "digits", 0, "ok")) is None  # a run's own only


def test_the_learning_rate_search_is_tabled_once_per_search_with_its_choice(tmp_path):
    """tuning.json beside a run: one row per search (the grid's validation NLLs, a diverged rate
    named, the choice), the figure of the means; a run that reused another seed's search is named,
    not tabled twice."""
    search = {
        "grid": [0.1, 0.4],
        "validation_nll": {"0.1": 0.52, "0.4": float("inf")},
        "chosen": 0.1,
        "key": "model.optim.lr",
    }
    for seed, record in ((1, search), (2, {**search, "reused_from": "elsewhere"})):
        folder = _run(tmp_path / "runs" / f"map{seed}", "map", seed, _predictions(seed, 0.8))
        (folder / "tuning.json").write_text(json.dumps(record))
    _run(tmp_path / "runs" / "dbsn1", "dbsn", 1, _predictions(5, 0.8))
    out = tmp_path / "report"
    build_report([tmp_path / "runs"], out)
    text = (out / "tuning.md").read_text()
    with (out / "tuning.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["seed"], float(r["val_nll_lr_0.1"]), r["chosen"]) for r in rows] == [
        ("map", "1", 0.52, "0.1")
    ]
    assert "| map | cifar10 | 1 | 0.5200 | diverged | 0.1 |" in text
    assert "map seed 2" in text and "## Learning-rate search" in (out / "report.md").read_text()
    assert (out / "tuning_cifar10.png").stat().st_size > 1000
