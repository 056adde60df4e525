"""The command lines a user types (dbsn.runtime.cli, through train.py): multirun, multi-process
DDP, W&B offline.
"""

from __future__ import annotations

import json

import pytest

from tests.support.configs import ROOT, TINY
from tests.support.scripts import run_python
from tests.support.wandb_records import config_keys, logged_values

pytestmark = pytest.mark.slow


QUICK = ["experiment=quick", *TINY, "trainer.max_epochs=1", "data.batch_size=128"]


def test_multirun_writes_one_folder_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    run_python(ROOT / "train.py", "-m", *QUICK, "seed=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    records = [json.loads((job / "metrics.json").read_text()) for job in jobs]
    assert [r["seed"] for r in records] == [1, 2]
    assert all("test/ece" in r["metrics"] for r in records)


def test_ddp_two_cpu_processes_one_run_folder(tmp_path):
    run_dir = tmp_path / "outputs" / "ddp"
    run_python(
        ROOT / "train.py",
        *QUICK,
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "trainer.limit_train_batches=3",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    record = json.loads((run_dir / "metrics.json").read_text())
    assert record["world_size"] == 2
    assert set(record["metrics"]) >= {"test/error", "test/nll", "test/brier", "test/ece"}
    # one run folder, one metrics file, no stray Hydra folders from the child process
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["ddp"]
    assert len(list(tmp_path.rglob("metrics.json"))) == 1
    assert len(list(run_dir.glob("csv/version_*"))) == 1


def test_wandb_offline_records_test_ece(tmp_path):
    run_dir = tmp_path / "run"
    run_python(
        ROOT / "train.py",
        *QUICK,
        "logger=wandb",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    expected = json.loads((run_dir / "metrics.json").read_text())["metrics"]["test/ece"]
    runs = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(run_dir.rglob("*"))[:50]
    logged = logged_values(runs[0])
    assert logged["test/ece"] == pytest.approx(expected, rel=1e-6)
    assert logged["test/reliability_diagram/_type"] == "images/separated"
    # the suite's numbers and figures reach W&B too
    assert logged["test/mutual_information"] == pytest.approx(
        json.loads((run_dir / "metrics.json").read_text())["metrics"]["test/mutual_information"], rel=1e-6
    )
    assert "structure/edge_entropy_mean" in logged
    assert logged["structure/heatmap/_type"] == "images/separated"
    assert logged["test/sample_ablation/_type"] == "images/separated"
    assert {"model", "data", "trainer", "seed"} <= config_keys(runs[0])


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """The W&B run id is made on the first start and kept in the run folder; a resumed (or
    requeued) run logs into the same W&B run (resume="allow") instead of opening a new one."""
    from tests.support.wandb_records import read_records

    run_dir = tmp_path / "run"
    common = [ROOT / "train.py", *QUICK, "logger=wandb", "test=false", f"hydra.run.dir={run_dir}"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_python(*common, "trainer.max_epochs=1", cwd=tmp_path, env=env)
    run_id = (run_dir / "wandb_id").read_text().strip()
    run_python(
        *common, "trainer.max_epochs=2", "resume=true", "resume_changes=[trainer.max_epochs]", cwd=tmp_path, env=env
    )
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files), files
    ids = {r.run.run_id for f in files for r in read_records(f) if r.WhichOneof("record_type") == "run"}
    assert ids == {run_id}
    assert (run_dir / "wandb_id").read_text().strip() == run_id
