"""A run folder holds one run (dbsn.runtime.folder): a start in a folder that holds another run,
that a live run holds or that holds a user's files is refused in one line and changes no byte
there; a crash leaves no lock behind; a sweep refuses a bad job before its first job trains; a
comparison's folder holds one comparison; the files of a run name it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from dbsn.evaluation.runs import RUN_ID_KEY, read_run_record
from dbsn.runtime.checkpoint import CheckpointError, load_checkpoint
from dbsn.runtime.config import ConfigError
from dbsn.runtime.folder import LOCK_FILE, check_run_folder, claim_run_folder, config_digest
from dbsn.runtime.run import train
from dbsn.tools.compare import main as compare
from tests.support.configs import ROOT, compose_config
from tests.support.scripts import assert_one_line, run_python
from tests.support.scripts import digests as all_digests


def digests(folder) -> dict[str, str]:
    """The folder's bytes, but for its lock file, which names whoever holds the folder now."""
    return {k: v for k, v in all_digests(folder).items() if k != LOCK_FILE}


pytestmark = pytest.mark.slow

#: a run of seconds: two steps of one epoch, two members at test
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.enable_progress_bar=false"]
COMPARE = ["--methods", "map_fixed", "--epochs", "1", "--samples", "2", *SHORT]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """A finished one-method comparison; its `map_fixed` folder is a finished run."""
    out = tmp_path_factory.mktemp("compare") / "cmp"
    compare([*COMPARE, "--out", str(out)])
    return out


def _train_py(*args, cwd):
    return run_python(
        ROOT / "train.py",
        "experiment=quick",
        *SHORT,
        "model.prediction.n_samples=2",
        *args,
        cwd=cwd,
        timeout=300,
        check=False,
        env={"HYDRA_FULL_ERROR": "0"},
    )


def test_the_files_of_a_run_name_it(comparison):
    run = comparison / "map_fixed"
    record = read_run_record(run)
    assert record["status"] == "finished" and [e["event"] for e in record["history"]] == ["started", "finished"]
    assert json.loads((run / "metrics.json").read_text())["run_id"] == record["run_id"]
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")[RUN_ID_KEY] == record["run_id"]
    assert record["config_sha256"] == config_digest(run / "resolved_config.yaml")


def test_train_py_refuses_a_finished_runs_folder_and_changes_nothing(comparison, tmp_path):
    run = comparison / "map_fixed"
    before = digests(run)
    line = assert_one_line(
        _train_py(f"hydra.run.dir={run}", cwd=tmp_path),
        str(run),
        "holds run",
        read_run_record(run)["run_id"][:8],
        "resume=true",
        "new folder",
    )
    assert "finished" in line and digests(run) == before


def test_a_run_in_process_refuses_it_too_and_a_refused_resume_leaves_run_json(comparison):
    """The claim is in `train` itself: dbsn-compare and every other caller get it. A resume refused
    by a later check (here a checkpoint of another method) leaves the run's record as it was."""
    run = comparison / "map_fixed"
    before = digests(run)
    with pytest.raises(ConfigError, match="holds run .* continue it with resume=true"):
        train(compose_config("train", ["experiment=quick", *SHORT], run), run)
    with pytest.raises(CheckpointError, match="is a model dbsn.methods.MAP checkpoint, but this run's model is"):
        train(compose_config("train", ["experiment=quick", *SHORT, "resume=true"], run), run)  # another method
    assert digests(run) == before


def test_a_live_runs_folder_is_refused_and_a_crash_leaves_no_lock(comparison, tmp_path):
    """A second process in a folder that a live run holds is refused, naming the holder; a holder
    killed with SIGKILL leaves a folder that the next start may continue."""
    run = tmp_path / "held"
    shutil.copytree(comparison / "map_fixed", run)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from dbsn.runtime.folder import claim_run_folder; "
                f"f = claim_run_folder(Path({str(run)!r}), resume=True); print('held', flush=True); time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = digests(run)
        assert_one_line(
            _train_py(f"hydra.run.dir={run}", "resume=true", cwd=tmp_path), "in use by a live run", f"pid {holder.pid}"
        )
        with pytest.raises(ConfigError, match="in use by a live run"):
            claim_run_folder(run, resume=True)
        assert digests(run) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    folder = claim_run_folder(run, resume=True)  # the kernel released the dead holder's lock
    assert folder.mode == "continue"
    folder.release()


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("a user's notes")
    with pytest.raises(ConfigError, match=r"holds files that are not a run's \(notes.txt\)"):
        claim_run_folder(folder, resume=True)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]  # no lock file left
    assert check_run_folder(tmp_path / "new", resume=False) == "new" and not (tmp_path / "new").exists()


def test_a_sweep_with_a_bad_later_job_is_refused_before_job_zero_trains(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_python(
        ROOT / "train.py",
        "-m",
        "experiment=quick",
        *SHORT,
        "model.optim.lr=0.1,-1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=300,
        check=False,
        env={"HYDRA_FULL_ERROR": "0"},
    )
    assert_one_line(result, "sweep job #1", "model.optim.lr=-1", "lr must be > 0", "No job was started")
    assert not sweep.exists()


def test_a_sweep_folder_that_holds_a_sweep_is_refused_without_resume(tmp_path):
    from dbsn.runtime.folder import check_sweep_folder

    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    with pytest.raises(ConfigError, match="holds another sweep .* resume=true"):
        check_sweep_folder(tmp_path, resume=False)
    check_sweep_folder(tmp_path, resume=True)


def test_compare_refuses_or_resumes_an_existing_comparison(comparison, monkeypatch):
    """Into a folder that holds a comparison: refused without --resume, every byte unchanged; with
    --resume a method that finished with the same settings is kept (nothing trains), and one that
    ran with other settings is refused."""
    before = digests(comparison)
    with pytest.raises(ConfigError, match="holds a comparison already .*--resume"):
        compare([*COMPARE, "--out", str(comparison)])
    assert digests(comparison) == before

    import dbsn.tools.compare as module

    def no_training(*args, **kwargs):
        raise AssertionError("a finished method trained again")

    monkeypatch.setattr(module, "train", no_training, raising=False)
    monkeypatch.setattr("dbsn.runtime.run.train", no_training)
    results = compare([*COMPARE, "--out", str(comparison), "--resume"])
    assert set(results) == {"map_fixed"}
    run = comparison / "map_fixed"
    kept = digests(run)
    with pytest.raises(ConfigError, match="finished run with other settings .*data.batch_size: 64 there, 32 here"):
        compare([*COMPARE, "--batch-size", "32", "--out", str(comparison), "--resume"])
    assert {k: v for k, v in digests(run).items() if not k.startswith(("evaluation", "report"))} == {
        k: v for k, v in kept.items() if not k.startswith(("evaluation", "report"))
    }


def test_resume_continues_the_same_run_and_records_it(comparison, tmp_path):
    run = tmp_path / "again"
    shutil.copytree(comparison / "map_fixed", run)
    first = read_run_record(run)
    cfg = OmegaConf.load(run / "resolved_config.yaml")  # the run's own settings, continued
    cfg.resume = True
    train(cfg, run)
    record = read_run_record(run)
    assert record["run_id"] == first["run_id"] and record["status"] == "finished"
    assert [e["event"] for e in record["history"]] == ["started", "finished", "resumed", "finished"]
    assert json.loads((run / "metrics.json").read_text())["run_id"] == first["run_id"]


def _mounted(folder, options: str):
    """`folder` as a tmpfs mounted with `options` (needs root, as on CI; the test is skipped elsewhere)."""
    folder.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("mounting a small or read-only file system needs root")
    return folder


@pytest.fixture
def read_only_folder(tmp_path):
    yield _mounted(tmp_path / "ro", "ro,size=1m")
    subprocess.run(["umount", str(tmp_path / "ro")], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A disk of 256 KiB: room for a run's small files, not for its first checkpoint (~0.5 MB)."""
    yield _mounted(tmp_path / "small", "size=256k")
    subprocess.run(["umount", str(tmp_path / "small")], check=True)


def test_a_read_only_output_disk_is_refused_in_one_line(read_only_folder, tmp_path):
    assert_one_line(
        _train_py(f"hydra.run.dir={read_only_folder / 'run'}", cwd=tmp_path),
        "read-only file system",
        "choose a writable folder",
    )
    assert not any(read_only_folder.iterdir())


def test_a_full_output_disk_stops_the_run_in_one_line(small_disk, tmp_path):
    """The first checkpoint does not fit: one line names the file and the full disk, no partial
    checkpoint is left, and run.json says the run failed."""
    run = small_disk / "run"
    assert_one_line(
        _train_py(f"hydra.run.dir={run}", cwd=tmp_path),
        "Could not write the checkpoint",
        "the disk is full",
        "resume=true",
    )
    assert read_run_record(run)["status"] == "failed"
    assert not [p for p in (run / "checkpoints").glob("*") if p.name.startswith(".")]  # no temporary file left
