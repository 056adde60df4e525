"""Files that belong together name their run (dbsn.evaluation.identity), and the report checks that
they agree: run.json's run_id is metrics.json's, each checkpoint's and its evaluation's, and
run.json's config digest is resolved_config.yaml's. A run whose files disagree is listed with the
reason and left out of the tables; a run without run.json is accepted unchecked. Hand-made runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dbsn.evaluation.identity import checkpoint_identity, examine, same_checkpoint
from dbsn.evaluation.report import build_report
from tests.support.fakeruns import DATA, MODELS, name_run, write_checkpoint, write_run

A, B = "a" * 32, "b" * 32


def runs(tmp_path: Path) -> dict[str, Path]:
    """Three dbsn seeds that name themselves, each with a checkpoint."""
    found = {}
    for seed in (1, 2, 3):
        folder = name_run(
            write_run(tmp_path / "runs" / str(seed), MODELS["dbsn"], DATA["cifar10"], seed, 0.05 * seed), f"{seed}" * 32
        )
        write_checkpoint(folder / "checkpoints" / "last.ckpt", f"{seed}" * 32, epoch=9, global_step=90)
        found[str(seed)] = folder
    return found


def table_cell(tmp_path: Path) -> str:
    table = (tmp_path / "report" / "table1_error.md").read_text()
    return next(line for line in table.splitlines() if line.startswith("| dbsn |"))


def test_runs_whose_files_agree_are_pooled(tmp_path):
    found = runs(tmp_path)
    assert all(examine(folder) == (None, None) for folder in found.values())
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    assert len(report.with_status("ok")) == 3 and table_cell(tmp_path).endswith("(3) |")


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("metrics", "metrics.json is of run bbbbbbbb, not of this folder's run 22222222"),
        ("config", "resolved_config.yaml is not the config run 22222222 recorded"),
        ("checkpoint", "checkpoints/epoch003.ckpt belongs to run bbbbbbbb, not to this folder's run 22222222"),
        ("unnamed checkpoint", "checkpoints/epoch003.ckpt names no run"),
        ("evaluation", "evaluation/metrics.json is of run bbbbbbbb"),
    ],
)
def test_a_run_whose_files_disagree_is_listed_with_the_reason_and_left_out(tmp_path, fault, reason):
    run = runs(tmp_path)["2"]
    if fault == "metrics":  # another run's metrics.json copied in
        (run / "metrics.json").write_text(json.dumps({**json.loads((run / "metrics.json").read_text()), "run_id": B}))
    elif fault == "config":
        (run / "resolved_config.yaml").write_text((run / "resolved_config.yaml").read_text() + "extra: 1\n")
    elif fault in ("checkpoint", "unnamed checkpoint"):
        write_checkpoint(run / "checkpoints" / "epoch003.ckpt", B if fault == "checkpoint" else None, epoch=3)
    else:
        (run / "evaluation").mkdir()
        (run / "evaluation" / "metrics.json").write_text(json.dumps({"checkpoints": ["x"], "run_id": B}))
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    left_out = report.with_status("inconsistent")
    assert [r.path.name for r in left_out] == ["2"] and reason in left_out[0].note
    assert table_cell(tmp_path).endswith("(2) |")  # seeds 1 and 3
    text = (tmp_path / "report" / "report.md").read_text()
    assert "**inconsistent**" in text and reason in text and "1 inconsistent" in text


def test_a_run_without_run_json_is_accepted_unchecked(tmp_path):
    folder = write_run(tmp_path / "runs" / "old", MODELS["dbsn"], DATA["cifar10"], 1, 0.05)
    write_checkpoint(folder / "checkpoints" / "last.ckpt", None)
    assert examine(folder) == (None, None)
    assert len(build_report([tmp_path / "runs"], tmp_path / "report").with_status("ok")) == 1


def test_a_posthoc_run_answers_to_its_training_run(tmp_path):
    run = runs(tmp_path)["1"]
    posthoc = run / "posthoc" / "temperature"
    posthoc.mkdir(parents=True)
    (posthoc / "resolved_config.yaml").write_text((run / "resolved_config.yaml").read_text() + "posthoc: temperature\n")
    record = {
        "metrics": {"test/error": 0.05},
        "seed": 1,
        "posthoc": "temperature",
        "checkpoints": ["x"],
        "run_id": "1" * 32,
    }
    (posthoc / "metrics.json").write_text(json.dumps(record))
    assert examine(posthoc) == (None, None)
    (posthoc / "metrics.json").write_text(json.dumps({**record, "run_id": B}))
    assert "metrics.json is of run bbbbbbbb, not of this folder's run 11111111" in examine(posthoc)[0]


def test_an_evaluation_of_an_earlier_checkpoint_of_the_run_is_named_in_the_notes(tmp_path):
    run = runs(tmp_path)["1"]
    (run / "evaluation").mkdir()
    earlier = {
        "path": str(run / "checkpoints" / "last.ckpt"),
        "run_id": "1" * 32,
        "epoch": 3,
        "global_step": 30,
        "digest": None,
    }
    (run / "evaluation" / "metrics.json").write_text(
        json.dumps({"checkpoints": [earlier["path"]], "run_id": "1" * 32, "evaluated": [earlier]})
    )
    assert examine(run)[0] is None and "no longer among the run's checkpoints" in examine(run)[1]
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    assert len(report.with_status("ok")) == 3
    assert any("no longer among the run's checkpoints" in w for w in report.warnings)


def test_same_checkpoint_by_digest_else_by_run_and_step(tmp_path):
    path = write_checkpoint(tmp_path / "x.ckpt", A, epoch=3, global_step=30)
    base = checkpoint_identity(path, {"dbsn_run_id": A, "epoch": 3, "global_step": 30})
    digest = {"algorithm": "sha256", "tensors": "1"}
    assert same_checkpoint(base, dict(base, path="/moved/x.ckpt"))  # the run moved: the same checkpoint
    assert not same_checkpoint(base, dict(base, global_step=31)) and not same_checkpoint(base, dict(base, run_id=B))
    assert same_checkpoint(dict(base, digest=digest), dict(base, digest=digest))
    assert not same_checkpoint(dict(base, digest=digest), dict(base, digest={**digest, "tensors": "2"}))
    # digests of different algorithms are not compared: run id and step decide
    assert same_checkpoint(dict(base, digest=digest), dict(base, digest={"algorithm": "other", "tensors": "2"}))
    unnamed = dict(base, run_id=None)
    assert same_checkpoint(unnamed, dict(unnamed)) and not same_checkpoint(unnamed, dict(unnamed, path="/else.ckpt"))


def test_a_posthoc_evaluation_of_an_earlier_checkpoint_is_named_in_the_notes(tmp_path):
    run = runs(tmp_path)["1"]
    posthoc = run / "posthoc" / "temperature"
    posthoc.mkdir(parents=True)
    (posthoc / "resolved_config.yaml").write_text((run / "resolved_config.yaml").read_text() + "posthoc: temperature\n")
    earlier = {"path": str(run / "checkpoints" / "last.ckpt"), "run_id": "1" * 32, "epoch": 3, "global_step": 30}
    (posthoc / "metrics.json").write_text(
        json.dumps(
            {
                "metrics": {"test/error": 0.05},
                "seed": 1,
                "posthoc": "temperature",
                "checkpoints": ["x"],
                "run_id": "1" * 32,
                "evaluated": [earlier],
            }
        )
    )
    assert examine(posthoc)[0] is None and "its evaluation is of" in examine(posthoc)[1]
    (posthoc / "metrics.json").write_text(
        json.dumps(
            {
                **json.loads((posthoc / "metrics.json").read_text()),
                "evaluated": [dict(earlier, epoch=9, global_step=90)],
            }
        )
    )
    assert examine(posthoc) == (None, None)


def test_a_run_that_adopted_an_older_folder_accepts_its_unnamed_files(tmp_path):
    """`resume=true` in a folder written before runs named themselves adopts it (run.json's first
    event is "adopted"): its earlier checkpoints and metrics.json name no run and still agree, while
    a checkpoint of another run is still a disagreement."""
    run = runs(tmp_path)["2"]
    record = json.loads((run / "run.json").read_text())
    write_checkpoint(run / "checkpoints" / "epoch003.ckpt", None, epoch=3)
    (run / "metrics.json").write_text(
        json.dumps({k: v for k, v in json.loads((run / "metrics.json").read_text()).items() if k != "run_id"})
    )
    assert "names no run" in examine(run)[0]
    (run / "run.json").write_text(json.dumps({**record, "history": [{"event": "adopted", "at": "then"}]}))
    assert examine(run) == (None, None)
    write_checkpoint(run / "checkpoints" / "epoch004.ckpt", B, epoch=4)
    assert "belongs to run bbbbbbbb" in examine(run)[0]
