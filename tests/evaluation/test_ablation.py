"""The MC-sample ablation's results files and figure (dbsn.evaluation.ablation)."""

from __future__ import annotations

import json
import math

import pytest

from dbsn.evaluation.ablation import ablation_figure
from dbsn.evaluation.results import write_results
from dbsn.evaluation.test_pass import ablation_results


def test_write_and_plot(tmp_path):
    rows = [
        {"n_samples": s, "error": 0.1 / s, "nll": 1 / s, "brier": 0.2, "ece": 0.05 * math.log(s + 1)} for s in (1, 2, 4)
    ]
    write_results(ablation_results(rows, "DBSN"), tmp_path)
    csv_path, json_path = tmp_path / "ablation" / "results.csv", tmp_path / "ablation" / "results.json"
    assert json.loads(json_path.read_text()) == rows
    lines = csv_path.read_text().splitlines()
    assert lines[0] == "n_samples,error,nll,brier,ece" and len(lines) == 4
    figure = ablation_figure({"DBSN": rows, "MC dropout": rows})
    error_ax = figure.axes[0]
    assert error_ax.get_xlabel() == "Monte Carlo samples S" and error_ax.get_xscale() == "log"
    assert [line.get_label() for line in error_ax.get_lines()] == ["DBSN", "MC dropout"]
    assert list(error_ax.get_lines()[0].get_ydata()) == pytest.approx([10.0, 5.0, 2.5])


def test_each_kept_sizes_calibrated_nll_is_kept_example_by_example_and_written(tmp_path):
    """A deep ensemble's ablation keeps its ensembles: each size's calibrated NLL (test-time cross-
    validation) goes into its row and, example by example, into `CALIBRATED_NLL_FILE`, whose means
    are the rows' values: what the deep-ensemble equivalent's interval reads."""
    import numpy as np
    import torch

    from dbsn.evaluation.ablation import CALIBRATED_NLL_FILE
    from dbsn.evaluation.recorder import PredictionRecorder
    from dbsn.evaluation.statistics import calibrate
    from dbsn.evaluation.test_pass import add_calibrated_ablation
    from dbsn.metrics.ablation import SampleAblation

    g = torch.Generator().manual_seed(0)
    members, targets = torch.randn(3, 200, 4, generator=g).log_softmax(-1), torch.randint(4, (200,), generator=g)
    recorded = PredictionRecorder(SampleAblation(4, n_samples=3, keep=True))
    recorded.ablation.update(members, targets)
    recorded.ablation_rows, recorded.targets = recorded.ablation.compute(), targets
    add_calibrated_ablation(recorded, seed=5)
    per_example = recorded.calibrated_ablation
    assert per_example.shape == (3, 200)
    for row, log_probs, nll in zip(recorded.ablation_rows, recorded.ablation.kept, per_example):
        calibrated, _ = calibrate(log_probs.double(), targets, seed=5)
        assert torch.allclose(nll, -calibrated.gather(1, targets[:, None])[:, 0])
        assert row["calibrated_nll"] == pytest.approx(float(nll.mean()))
    write_results(ablation_results(recorded.ablation_rows, "DE", per_example), tmp_path)
    with np.load(tmp_path / CALIBRATED_NLL_FILE) as saved:
        assert saved["sizes"].tolist() == [1, 2, 3]
        assert np.allclose(saved["nll"], per_example.numpy(), rtol=1e-6)
