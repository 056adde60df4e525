"""An interval that misses its estimate is flagged wherever it is shown (dbsn.evaluation.interval_rule):
a run's test pass with such an interval prints the flag on the console, sends it to W&B (read back
from the offline run's own file), writes it to metrics.json, and the report built from that run
shows it in its markdown."""

from __future__ import annotations

import json

import pytest
import torch
import wandb

from dbsn.evaluation.interval_rule import OUTSIDE_NOTE
from dbsn.evaluation.recorder import PredictionRecorder
from dbsn.evaluation.report import build_report
from dbsn.evaluation.results import write_results
from dbsn.evaluation.statistics import Statistics
from dbsn.evaluation.test_pass import prediction_results
from dbsn.evaluation.tracking import WandbLogger
from dbsn.metrics.classification import expected_calibration_error
from tests.support.fakeruns import DATA, MODELS, write_run
from tests.support.wandb_records import summary

C = 10


def _exactly_calibrated() -> PredictionRecorder:
    """A test pass whose plug-in ECE is exactly 0: 250 predictions at confidence 0.8, 200 of them
    right, and 250 at 0.6, 150 right (two equal-width bins, each exactly calibrated). A bootstrap
    resample is exactly calibrated in both bins in about 0.2 % of resamples, so the ECE's percentile
    interval lies above its estimate: the biased statistic's interval misses it."""
    n = 500
    targets = torch.arange(n) % C
    confidence = torch.where(torch.arange(n) < 250, 0.8, 0.6).double()
    right = torch.cat([torch.arange(250) < 200, torch.arange(250) < 150])
    predicted = torch.where(right, targets, (targets + 1) % C)
    probs = ((1 - confidence) / (C - 1))[:, None].repeat(1, C)
    probs[torch.arange(n), predicted] = confidence
    recorded = PredictionRecorder()
    recorded.log_probs, recorded.targets = probs.log().float(), targets
    recorded.scores = {"max_probability": confidence.float()}
    return recorded


def test_an_interval_that_misses_its_estimate_is_flagged_on_the_console_in_wandb_and_in_the_report(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("COLUMNS", "400")  # the console table on one line per row
    recorded = _exactly_calibrated()
    probs = recorded.log_probs.double().exp()
    ece = float(expected_calibration_error(probs, recorded.targets, n_bins=15))
    assert ece == pytest.approx(0.0, abs=1e-6)
    error = float((probs.argmax(1) != recorded.targets).double().mean())
    metrics = {
        "test/error": error,
        "test/nll": float(-probs.log()[torch.arange(500), recorded.targets].mean()),
        "test/ece": ece,
    }
    folder = write_run(tmp_path / "runs" / "dbsn1", MODELS["dbsn"], DATA["cifar10"], seed=1, error=None)
    results = prediction_results(
        None, recorded, metrics, "crafted", structure=False, statistics=Statistics(seed=0, resamples=400)
    )
    low, high = results.intervals["test/ece"]
    assert ece < low < high  # the crafted interval misses its estimate; the error's does not
    assert results.intervals["test/error"][0] <= error <= results.intervals["test/error"][1]

    logger = WandbLogger(offline=True, save_dir=str(folder), project="flagged")
    write_results(results, folder, [logger])
    logger.experiment.finish()
    wandb.teardown()  # the W&B service writes the run's file on its own time: stopped, it has written all of it

    # the console: the note on the ECE's row, and on no other
    printed = [line for line in capsys.readouterr().out.splitlines() if OUTSIDE_NOTE.strip("()") in line]
    assert len(printed) == 1 and "test/ece " in printed[0], printed
    # W&B: the flag in the run's summary, beside the interval
    (run_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    found = summary(run_file)
    assert found["test/ece/ci_misses_estimate"] == 1 and found["test/error/ci_misses_estimate"] == 0
    assert found["test/ece/ci_low"] == pytest.approx(low) and found["test/ece/ci_high"] == pytest.approx(high)
    # metrics.json keeps the interval as measured; the report built from the run shows the flag
    record = json.loads((folder / "metrics.json").read_text())
    assert record["intervals"]["test/ece"] == pytest.approx([low, high])
    build_report([tmp_path / "runs"], tmp_path / "report")
    table = (tmp_path / "report" / "table2_ece.md").read_text()
    (row,) = [line for line in table.splitlines() if line.startswith("| dbsn |")]
    assert f"0.0000 [{low:.4f}, {high:.4f}] {OUTSIDE_NOTE} (1)" in row
    assert OUTSIDE_NOTE in (tmp_path / "report" / "report.md").read_text()
    error_table = (tmp_path / "report" / "table1_error.md").read_text()
    assert OUTSIDE_NOTE not in error_table
