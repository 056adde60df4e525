"""The cluster code without a cluster: the SLURM request derived from the trainer and the refusals
before submission, the preemption callback, progress lines without a terminal, the error line
of a failed job. (The same code on a real SLURM cluster: test_slurm.py.)"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
from configs import compose_config
from lightning.pytorch.callbacks import RichProgressBar
from omegaconf import OmegaConf

from dbsn.runtime.cluster import (PreemptionRequeue, _has_features, _minutes, check_sweep, error_line, install_preemption_handler,
                                  job_overrides_with_resume, slurm_request)
from dbsn.runtime.config import ConfigError
from dbsn.runtime.progress import LineProgress
from dbsn.runtime.build import build_trainer


def _job(**trainer):
    return OmegaConf.create({"trainer": {"accelerator": "auto", "devices": 1, "num_nodes": 1, **trainer}})


UNSET = {"nodes": None, "tasks_per_node": None, "gpus_per_node": None}


def test_the_request_follows_the_trainer():
    assert slurm_request(_job(devices=4, num_nodes=2, accelerator="gpu"), UNSET) == \
        {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4}
    assert slurm_request(_job(devices=4), UNSET)["gpus_per_node"] == 4  # "auto" on a GPU cluster: the GPUs
    assert slurm_request(_job(devices=2, accelerator="cpu"), UNSET) == {"nodes": 1, "tasks_per_node": 2, "gpus_per_node": None}
    assert slurm_request(_job(devices=[0, 1]), UNSET)["tasks_per_node"] == 2
    assert slurm_request(_job(devices=4), {**UNSET, "gres": "gpu:a100:4"})["gpus_per_node"] is None
    # values the user set that agree are kept
    assert slurm_request(_job(devices=4, num_nodes=2), {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 8}) == \
        {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 8}


@pytest.mark.parametrize("launcher, trainer, message", [
    ({"nodes": 1}, {"num_nodes": 2}, r"hydra\.launcher\.nodes=1 but trainer\.num_nodes=2"),
    ({"tasks_per_node": 1}, {"devices": 4}, r"hydra\.launcher\.tasks_per_node=1 but trainer\.devices=4"),
    ({"gpus_per_node": 2}, {"devices": 4, "accelerator": "gpu"}, r"hydra\.launcher\.gpus_per_node=2 but trainer\.devices=4"),
    ({}, {"devices": "auto"}, r"trainer\.devices='auto': a SLURM job asks for a number of devices"),
    ({}, {"devices": -1}, r"trainer\.devices=-1"),
])
def test_a_request_that_contradicts_the_trainer_names_both_values(launcher, trainer, message):
    with pytest.raises(ConfigError, match=message):
        slurm_request(_job(**trainer), {**UNSET, **launcher})


def test_the_sweep_is_checked_job_by_job_before_submission(tmp_path):
    good = compose_config("train", ["experiment=quick"], tmp_path)
    bad = compose_config("train", ["experiment=quick", "model.train_samples=abc"], tmp_path)
    assert check_sweep([good, good], UNSET) == {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": None}
    with pytest.raises(ConfigError, match=r"sweep job #1 .*model\.train_samples='abc': expected int.*Nothing was submitted"):
        check_sweep([good, bad], UNSET)
    missing = compose_config("train", ["experiment=quick", f"ckpt_path={tmp_path / 'nope.ckpt'}"], tmp_path)
    with pytest.raises(ConfigError, match=r"sweep job #0 .*Checkpoint not found"):
        check_sweep([missing], UNSET)
    two = compose_config("train", ["experiment=quick", "trainer.devices=2"], tmp_path)
    with pytest.raises(ConfigError, match="share one SLURM request.*separate sweeps"):
        check_sweep([good, two], UNSET)


@pytest.mark.parametrize("constraint, fits", [(None, True), ("a100", True), ("v100", False), ("a100&ib", True),
                                              ("a100&v100", False), ("v100|a100&ib", True), ("v100|h100", False),
                                              ("[a100|v100]", True)])  # brackets: not checked, SLURM decides
def test_a_constraint_is_matched_against_a_nodes_features(constraint, fits):
    assert _has_features({"a100", "ib"}, constraint) is fits


def test_slurm_time_limits_read_as_minutes():
    assert [_minutes(t) for t in ("30", "1:30:00", "2-00:00:00", "1-12", "2-12:30", "45:30", "INFINITE")] == [
        30.0, 90.0, 2880.0, 2160.0, 3630.0, 45.5, None]


def test_training_jobs_resume_from_their_own_checkpoint():
    train_cfg = OmegaConf.create({"resume": False, "model": {}})
    assert job_overrides_with_resume(["seed=1"], train_cfg) == ["seed=1", "resume=true"]
    assert job_overrides_with_resume(["resume=false"], train_cfg) == ["resume=false"]  # the user's word stands
    assert job_overrides_with_resume(["seed=1"], OmegaConf.create({"ckpt_path": "x"})) == ["seed=1"]  # evaluate.py


def test_error_line_finds_the_exception_in_a_jobs_traceback():
    trace = ("Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call last):\n"
             '  File "x.py", line 3, in f\nValueError: data.train_subset=99999: expected a count\n'
             "----------------------\nYou can check full logs with 'job.stderr(0)'")
    assert error_line(RuntimeError(trace)) == "ValueError: data.train_subset=99999: expected a count"
    assert error_line(KeyError("k")) == "KeyError: 'k'"


def test_preemption_requeues_at_the_next_epoch_start_or_when_the_grace_period_ends():
    calls = []
    callback = PreemptionRequeue(lambda: calls.append(time.monotonic()), grace_s=60)
    callback.on_fit_start(None, None)
    callback.signalled(signal.SIGUSR2, None)
    callback.on_train_batch_end(None, None, None, None, 0)
    assert calls == []  # the epoch goes on: its checkpoint is written at its end
    callback.on_train_epoch_start(None, None)
    assert len(calls) == 1  # the next epoch start: the finished epoch's last.ckpt is on disk

    late = PreemptionRequeue(lambda: calls.append("late"), grace_s=0.0)
    late.on_fit_start(None, None)
    late.signalled(signal.SIGUSR2, None)
    time.sleep(0.01)
    late.on_train_batch_end(None, None, None, None, 3)
    assert calls[-1] == "late"  # the grace period ran out mid-epoch: requeue from the previous checkpoint

    idle = PreemptionRequeue(lambda: calls.append("idle"), grace_s=60)
    idle.signalled(signal.SIGUSR2, None)  # not fitting (testing, reporting): nothing to wait for
    assert calls[-1] == "idle"


def test_the_handler_wraps_submitits_and_calls_it_once(monkeypatch):
    submitit_calls = []
    old = signal.signal(signal.SIGUSR2, lambda signum, frame: submitit_calls.append(signum))
    monkeypatch.setattr(PreemptionRequeue, "active", None)
    try:
        install_preemption_handler(grace_s=60)
        callback = PreemptionRequeue.active
        callback.on_fit_start(None, None)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert callback.signalled_at is not None and submitit_calls == []
        callback.on_train_epoch_start(None, None)
        callback.on_train_epoch_start(None, None)
        assert submitit_calls == [signal.SIGUSR2]  # once (on ranks > 0 submitit's handler returns)
    finally:
        signal.signal(signal.SIGUSR2, old)


def _trainer(done: int, epoch: int, loss: float | None = 2.5):
    progress = SimpleNamespace(total=SimpleNamespace(completed=done))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                           num_training_batches=10, max_epochs=5, max_steps=-1, current_epoch=epoch,
                           progress_bar_metrics={} if loss is None else {"train/loss_step": loss})


def test_progress_lines_give_step_loss_throughput_and_time_left(monkeypatch, capsys):
    clock = iter([100.0, 100.0, 110.0, 110.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    progress = LineProgress(every_s=300)
    progress.on_train_start(_trainer(10, 1), None)  # resumed after one epoch of 10 batches
    progress._examples = 640
    progress.print_line(_trainer(20, 1))  # 10 batches in 10 s; 30 left
    assert capsys.readouterr().out.strip() == \
        "epoch 2/5 | step 20/50 | train/loss 2.5 | 64 img/s | elapsed 0:00:10 | left 0:00:30"
    progress.disable()
    progress.print_line(_trainer(20, 1))
    assert capsys.readouterr().out == ""  # ranks other than 0


def test_without_a_terminal_the_progress_bar_becomes_lines(tmp_path, monkeypatch):
    cfg = compose_config("train", ["experiment=quick"], tmp_path)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    trainer = build_trainer(cfg.trainer, tmp_path, callbacks=[RichProgressBar()])
    assert isinstance(trainer.progress_bar_callback, LineProgress)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    trainer = build_trainer(cfg.trainer, tmp_path, callbacks=[RichProgressBar()])
    assert isinstance(trainer.progress_bar_callback, RichProgressBar)
