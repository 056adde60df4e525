"""A signal that stops a run is reported as a fault (dbsn.runtime.signals): SIGTERM (a scheduler,
`kill`), SIGINT (Ctrl-C) and SIGHUP (the terminal closed) end `train.py` with 128 + the signal's
number and one line that says where the checkpoint is and how to resume; the resumed run ends
bit-equal to an uninterrupted one (weights, optimiser states and test metrics), because the
signal rolls back to the last epoch-end checkpoint.

The signals are sent by the run to itself at a chosen batch (`tests.support.fault_probe.SignalAt`),
so each lands at the same point every time. One uninterrupted run is the reference for all.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch

import dbsn.runtime.run
from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.runtime.signals import Interruptions, RunInterrupted, SignalWatch, requeueing
from tests.support.configs import ROOT, TINY, compose_config
from tests.support.fault_probe import SignalAt
from tests.support.scripts import SUPPORT_ON_PATH, run_python

EPOCHS = 3
# 128 digits in 4 batches, a validation split (DBSN draws structures there too), S = 4
RUN = [
    "data=digits",
    "data.train_subset=128",
    "data.batch_size=32",
    "data.val_size=32",
    *TINY,
    "model.prediction.val_samples=2",
    f"trainer.max_epochs={EPOCHS}",
    "seed=1",
    "callbacks.structure_posterior.save_figures=false",
    "callbacks.structure_posterior.n_samples=10",
]


def _probe(folder, **where) -> list[str]:
    """The probe's overrides: a signal at `where`, sent once per run folder (a marker file beside it)."""
    return [
        "+callbacks.signal._target_=tests.support.fault_probe.SignalAt",
        f"+callbacks.signal.once_file={folder.parent / (folder.name + '.signalled')}",
        *[f"+callbacks.signal.{key}={value}" for key, value in where.items()],
    ]


def _final(folder) -> tuple[dict, dict]:
    return load_checkpoint(folder / "checkpoints" / "last.ckpt"), json.loads((folder / "metrics.json").read_text())


def _assert_same_run(reference, folder) -> None:
    (ref_ckpt, ref_metrics), (ckpt, metrics) = reference, _final(folder)
    assert ckpt["epoch"] == ref_ckpt["epoch"] == EPOCHS - 1 and ckpt["global_step"] == ref_ckpt["global_step"]
    assert ckpt["state_dict"].keys() == ref_ckpt["state_dict"].keys()
    different = [k for k, v in ref_ckpt["state_dict"].items() if not torch.equal(v, ckpt["state_dict"][k])]
    assert different == []
    for ours, theirs in zip(ckpt["optimizer_states"], ref_ckpt["optimizer_states"], strict=True):
        for key, state in theirs["state"].items():
            assert all(
                torch.equal(state[k], ours["state"][key][k]) for k in state if isinstance(state[k], torch.Tensor)
            )
    assert metrics["metrics"] == ref_metrics["metrics"]  # every test metric, to the last bit


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (the same config as every interrupted one: its probe never fires)."""
    folder = tmp_path_factory.mktemp("straight") / "run"
    (folder.parent / "run.signalled").touch()
    dbsn.runtime.run.train(compose_config("train", [*RUN, *_probe(folder, epoch=1, batch=2)], folder), folder)
    return _final(folder)


def _train_with(folder, monkeypatch, probe: SignalAt, extra=()) -> RunInterrupted:
    """`train` in this process with `probe` among its callbacks; returns the interruption it raised."""
    build_trainer = dbsn.runtime.run.build_trainer
    with monkeypatch.context() as patch:
        patch.setattr(
            dbsn.runtime.run,
            "build_trainer",
            lambda cfg, out, callbacks=(), loggers=(): build_trainer(cfg, out, [*callbacks, probe], loggers),
        )
        with pytest.raises(RunInterrupted) as stopped:
            dbsn.runtime.run.train(compose_config("train", [*RUN, *extra], folder), folder)
    return stopped.value


@pytest.mark.slow
def test_sigterm_mid_epoch_exits_non_zero_and_the_resumed_run_equals_the_uninterrupted_one(reference, tmp_path):
    folder = tmp_path / "run"
    probe = _probe(folder, epoch=1, batch=2)  # the third batch of the second epoch
    done = run_python(ROOT / "train.py", *RUN, *probe, f"hydra.run.dir={folder}", env=SUPPORT_ON_PATH, check=False)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    last = folder / "checkpoints" / "last.ckpt"
    assert done.stderr.strip().splitlines()[-1] == (
        f"Interrupted: Stopped by SIGTERM in epoch 2 of {EPOCHS}: {last} holds the first 1 epoch; to continue, run the "
        f"same command plus resume=true hydra.run.dir={folder} (from the start of epoch 2, as an uninterrupted run would)."
    )
    assert "Traceback" not in done.stderr
    assert load_checkpoint(last)["epoch"] == 0  # rolled back to the end of the first epoch
    assert not (folder / "metrics.json").exists()  # nothing says it finished

    dbsn.runtime.run.train(compose_config("train", [*RUN, *probe, "resume=true"], folder), folder)
    _assert_same_run(reference, folder)


@pytest.mark.slow
def test_ctrl_c_twice_stops_at_once_and_the_handlers_are_restored(reference, tmp_path, monkeypatch):
    """SIGINT: the first stops after the batch, the second at once (here both at one batch); the
    run's handlers leave with it."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stop = _train_with(tmp_path, monkeypatch, SignalAt("SIGINT", epoch=1, batch=1, times=2))
    assert stop.signum == signal.SIGINT and stop.exit_status == 130
    assert stop.checkpoint == tmp_path / "checkpoints" / "last.ckpt" and stop.epochs_done == 1
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.fixture
def sighup_not_ignored():
    """SIGHUP at its default for the test: under `nohup` it starts ignored, and a run then rightly
    leaves it alone (`signals.py`), so a test that sends it would see nothing happen."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


@pytest.mark.slow
@pytest.mark.usefixtures("sighup_not_ignored")
def test_sighup_while_testing_resumes_to_the_test_pass_alone(reference, tmp_path, monkeypatch):
    """A signal after training (in the test pass): the checkpoint holds every epoch; resume=true
    trains nothing and writes the uninterrupted run's metrics."""
    stop = _train_with(tmp_path, monkeypatch, SignalAt("SIGHUP", stage="test", batch=0))
    assert stop.signum == signal.SIGHUP and stop.exit_status == 129
    assert (
        stop.epochs_done == EPOCHS and "after training" in str(stop) and "tests the model without training" in str(stop)
    )
    steps = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"]
    dbsn.runtime.run.train(compose_config("train", [*RUN, "resume=true"], tmp_path), tmp_path)
    assert load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == steps
    _assert_same_run(reference, tmp_path)


# ---------------------------------------------------------------------- the handlers themselves
def test_outside_a_lightning_loop_a_signal_stops_at_once(tmp_path):
    with pytest.raises(RunInterrupted, match="before the run's first checkpoint") as stopped:
        with Interruptions(tmp_path):
            signal.raise_signal(signal.SIGTERM)
            raise AssertionError("still running after SIGTERM")
    assert stopped.value.exit_status == 143
    with pytest.raises(RunInterrupted, match="before the evaluation finished: run the same command again"):
        with Interruptions(None):
            signal.raise_signal(signal.SIGINT)


def test_an_ignored_sighup_stays_ignored(tmp_path):
    """Under nohup SIGHUP is ignored from the start: the user asked for it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Interruptions(tmp_path):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)  # nothing happens
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_signal_during_the_last_batch_stops_when_the_loop_ends(tmp_path):
    """Lightning checks its flag after every batch but the last: the loop's normal end stops it."""
    interruptions = Interruptions(tmp_path)
    interruptions.signum = signal.SIGTERM
    with pytest.raises(RunInterrupted):
        SignalWatch(interruptions).teardown(None, None, "test")


def test_a_ddp_child_stopped_by_a_signal_exits_non_zero(monkeypatch, tmp_path):
    from dbsn.runtime import child

    def stopped(cfg, run_dir):
        raise RunInterrupted(signal.SIGTERM, run_dir)

    monkeypatch.setattr(dbsn.runtime.run, "train", stopped)
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(SystemExit) as exit_:
        child.main([str(tmp_path / "config.yaml"), str(tmp_path)])
    assert exit_.value.code == 143


def test_the_entry_points_exit_with_128_plus_the_signal(capsys):
    from dbsn.runtime.errors import one_line_errors

    def body():
        raise RunInterrupted(signal.SIGINT, None)

    with pytest.raises(SystemExit) as exit_:
        one_line_errors(body)()
    assert exit_.value.code == 130
    assert (
        capsys.readouterr().err
        == "Interrupted: Stopped by SIGINT before the evaluation finished: run the same command again.\n"
    )


def test_the_sigterm_of_a_requeue_is_expected_on_the_rank_that_leaves(tmp_path):
    """submitit requeues from rank 0 and exits; SLURM then sends SIGTERM, which is no interruption.
    On the other ranks submitit's handler returns and they go on: a later SIGTERM counts again."""
    with Interruptions(tmp_path):
        with pytest.raises(SystemExit):
            with requeueing():
                sys.exit(-1)  # rank 0: submitit's handler exits
        signal.raise_signal(signal.SIGTERM)  # ignored: the process is leaving
    import dbsn.runtime.signals as signals

    signals._STATE.leaving = False
    with pytest.raises(RunInterrupted):
        with Interruptions(tmp_path):
            with requeueing():
                pass  # ranks > 0: submitit's handler returns
            signal.raise_signal(signal.SIGTERM)
