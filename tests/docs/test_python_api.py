"""docs/python-api.md runs: its Python blocks in order in one namespace, its `python train.py` line as
written, in a folder of its own; so does the tutorial on scoring one's own predictions
(docs/tutorials/score-predictions.md), whose blocks are Python only."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from tests.support.configs import ROOT
from tests.support.scripts import run_python

PAGE = ROOT / "docs" / "python-api.md"
TUTORIAL = ROOT / "docs" / "tutorials" / "score-predictions.md"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```$", re.S | re.M)


def test_the_page_has_a_block_for_each_part():
    kinds = [kind for kind, _ in BLOCK.findall(PAGE.read_text())]
    assert kinds.count("python") >= 5 and kinds.count("bash") == 1


@pytest.mark.slow
def test_the_tutorial_runs_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for kind, code in BLOCK.findall(PAGE.read_text()):
        if kind == "bash":
            words = shlex.split(code)
            assert words[:2] == ["python", "train.py"]
            run_python(
                ROOT / "train.py",
                *words[2:],
                cwd=tmp_path,
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
            )
        else:
            exec(compile(code, str(PAGE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "test error" in printed and "regression − DBSN, NLL" in printed and "map_fixed digits" in printed
    assert namespace["tested"]["test/error"] < 0.9 and namespace["run"].status == "ok"
    assert set(namespace["paired"]) >= {"error", "NLL", "CE²", "calibrated NLL"}


def test_the_scoring_tutorial_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """Seconds: logistic regressions on the 8x8 digits, no dbsn model, no training run."""
    monkeypatch.chdir(tmp_path)
    blocks = BLOCK.findall(TUTORIAL.read_text())
    assert [kind for kind, _ in blocks] == ["python"] * 4
    namespace: dict = {}
    for _, code in blocks:
        exec(compile(code, str(TUTORIAL), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "yours − baseline, NLL" in printed and "CE² yours − baseline, seed 0" in printed
    assert set(namespace["paired"]) == {"error", "NLL", "Brier", "CE²", "calibrated NLL", "calibrated CE²"}
    assert all(len(result["seeds"]) == 3 for result in namespace["paired"].values())
    for estimate in namespace["found"].values():
        assert estimate.low <= estimate.value <= estimate.high
