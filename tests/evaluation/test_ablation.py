"""The MC-sample ablation's results files and figure (dbsn.evaluation.ablation)."""

from __future__ import annotations

import json
import math

import pytest

from dbsn.evaluation.ablation import ablation_figure
from dbsn.evaluation.results import write_results
from dbsn.evaluation.test_pass import ablation_results


def test_write_and_plot(tmp_path):
    rows = [{"n_samples": s, "error": 0.1 / s, "nll": 1 / s, "brier": 0.2, "ece": 0.05 * math.log(s + 1)} for s in (1, 2, 4)]
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
