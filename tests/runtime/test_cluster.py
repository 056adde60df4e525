"""The cluster code (dbsn.runtime.cluster): without a cluster, the SLURM request derived from the
trainer and the refusals before submission, the preemption callback and the error line of a
failed job; then the same code on a real SLURM cluster.

The real cluster is one the fixture stands up on this machine (one controller, two slurmd nodes,
munge; see tests/support/slurm_cluster.py), through the project's own entry points: a sweep
through `hydra/launcher=slurm`, a 2-node DDP run through `srun`, a requeued job that resumes to
the uninterrupted run's final state, and a sweep in which one job fails. Those tests are skipped,
with the reason, only where SLURM cannot be installed (not root or no apt); on CI (`CI` set)
that is a failure instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.runtime.cluster import (
    PreemptionRequeue,
    _has_features,
    _minutes,
    check_sweep,
    error_line,
    install_preemption_handler,
    job_overrides_with_resume,
    slurm_request,
)
from dbsn.runtime.config import ConfigError
from tests.support.configs import ROOT, compose_config
from tests.support.scripts import SUPPORT_ON_PATH
from tests.support.slurm_cluster import LocalSlurmCluster, ensure_slurm_installed


def _job(**trainer):
    return OmegaConf.create({"trainer": {"accelerator": "auto", "devices": 1, "num_nodes": 1, **trainer}})


UNSET = {"nodes": None, "tasks_per_node": None, "gpus_per_node": None}


def test_the_request_follows_the_trainer():
    assert slurm_request(_job(devices=4, num_nodes=2, accelerator="gpu"), UNSET) == {
        "nodes": 2,
        "tasks_per_node": 4,
        "gpus_per_node": 4,
    }
    assert slurm_request(_job(devices=4), UNSET)["gpus_per_node"] == 4  # "auto" on a GPU cluster: the GPUs
    assert slurm_request(_job(devices=2, accelerator="cpu"), UNSET) == {
        "nodes": 1,
        "tasks_per_node": 2,
        "gpus_per_node": None,
    }
    assert slurm_request(_job(devices=[0, 1]), UNSET)["tasks_per_node"] == 2
    assert slurm_request(_job(devices=4), {**UNSET, "gres": "gpu:a100:4"})["gpus_per_node"] is None
    # values the user set that agree are kept
    assert slurm_request(_job(devices=4, num_nodes=2), {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 8}) == {
        "nodes": 2,
        "tasks_per_node": 4,
        "gpus_per_node": 8,
    }


@pytest.mark.parametrize(
    "launcher, trainer, message",
    [
        ({"nodes": 1}, {"num_nodes": 2}, r"hydra\.launcher\.nodes=1 but trainer\.num_nodes=2"),
        ({"tasks_per_node": 1}, {"devices": 4}, r"hydra\.launcher\.tasks_per_node=1 but trainer\.devices=4"),
        (
            {"gpus_per_node": 2},
            {"devices": 4, "accelerator": "gpu"},
            r"hydra\.launcher\.gpus_per_node=2 but trainer\.devices=4",
        ),
        ({}, {"devices": "auto"}, r"trainer\.devices='auto': a SLURM job asks for a number of devices"),
        ({}, {"devices": -1}, r"trainer\.devices=-1"),
    ],
)
def test_a_request_that_contradicts_the_trainer_names_both_values(launcher, trainer, message):
    with pytest.raises(ConfigError, match=message):
        slurm_request(_job(**trainer), {**UNSET, **launcher})


def test_the_sweep_is_checked_job_by_job_before_submission(tmp_path):
    good = compose_config("train", ["experiment=quick"], tmp_path)
    bad = compose_config("train", ["experiment=quick", "model.train_samples=abc"], tmp_path)
    assert check_sweep([good, good], UNSET) == {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": None}
    with pytest.raises(
        ConfigError, match=r"sweep job #1 .*model\.train_samples='abc': expected int.*Nothing was submitted"
    ):
        check_sweep([good, bad], UNSET)
    missing = compose_config("train", ["experiment=quick", f"ckpt_path={tmp_path / 'nope.ckpt'}"], tmp_path)
    with pytest.raises(ConfigError, match=r"sweep job #0 .*Checkpoint not found"):
        check_sweep([missing], UNSET)
    two = compose_config("train", ["experiment=quick", "trainer.devices=2"], tmp_path)
    with pytest.raises(ConfigError, match="share one SLURM request.*separate sweeps"):
        check_sweep([good, two], UNSET)


@pytest.mark.parametrize(
    "constraint, fits",
    [
        (None, True),
        ("a100", True),
        ("v100", False),
        ("a100&ib", True),
        ("a100&v100", False),
        ("v100|a100&ib", True),
        ("v100|h100", False),
        ("[a100|v100]", True),
    ],
)  # brackets: not checked, SLURM decides
def test_a_constraint_is_matched_against_a_nodes_features(constraint, fits):
    assert _has_features({"a100", "ib"}, constraint) is fits


def test_slurm_time_limits_read_as_minutes():
    assert [_minutes(t) for t in ("30", "1:30:00", "2-00:00:00", "1-12", "2-12:30", "45:30", "INFINITE")] == [
        30.0,
        90.0,
        2880.0,
        2160.0,
        3630.0,
        45.5,
        None,
    ]


def test_training_jobs_resume_from_their_own_checkpoint():
    train_cfg = OmegaConf.create({"resume": False, "model": {}})
    assert job_overrides_with_resume(["seed=1"], train_cfg) == ["seed=1", "resume=true"]
    assert job_overrides_with_resume(["resume=false"], train_cfg) == ["resume=false"]  # the user's word stands
    assert job_overrides_with_resume(["seed=1"], OmegaConf.create({"ckpt_path": "x"})) == ["seed=1"]  # evaluate.py


def test_error_line_finds_the_exception_in_a_jobs_traceback():
    trace = (
        "Job (task=0) failed during processing with trace:\n----------------------\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in f\nValueError: data.train_subset=99999: expected a count\n'
        "----------------------\nYou can check full logs with 'job.stderr(0)'"
    )
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


# ---------------------------------------------------------------------- on a real SLURM cluster

# tiny digits runs: 256 training images (4 batches), S = 2, no per-epoch figures
TINY_RUN = [
    "experiment=quick",
    "data.train_subset=256",
    "model.prediction.n_samples=2",
    "model.prediction.samples_per_forward=2",
    "callbacks.structure_posterior.save_figures=false",
    "callbacks.structure_posterior.n_samples=10",
]
# the local cluster's jobs: one thread each, rendezvous on 127.0.0.1 (the node names do not resolve)
LAUNCHER = [
    "hydra/launcher=slurm",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=null",
    "hydra.launcher.timeout_min=30",
    "hydra.launcher.setup=['export MASTER_ADDR=127.0.0.1']",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_slurm_installed()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SLURM tests, but: {reason}")
        pytest.skip(reason)
    slurm = LocalSlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield slurm
    slurm.stop()


def _job_env(cluster) -> dict[str, str]:
    """The cluster's environment for a command and the jobs it submits: one thread each, and
    `tests.support` importable (the probe callbacks)."""
    return {**cluster.env, **SUPPORT_ON_PATH, "OMP_NUM_THREADS": "1"}


def _run(cluster, command: list[str], timeout: float, cwd=ROOT, check: bool = True) -> subprocess.CompletedProcess:
    """`command` against the local cluster (sbatch-launched sweeps, `srun`): on failure or a time-out
    the error shows the cluster's logs. (Not `run_python`: other commands than python, and the logs.)"""
    try:
        done = subprocess.run(command, cwd=cwd, env=_job_env(cluster), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"{' '.join(command)} took over {timeout} s:\n{err.stdout}\n{err.stderr}{cluster.logs()}"
        ) from err
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
            f"{done.stderr[-6000:]}{cluster.logs()}"
        )
    return done


def _train(*overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *overrides]


@pytest.mark.slow
def test_a_sweep_runs_as_slurm_jobs_and_ends_with_a_report(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    done = _run(
        cluster,
        _train("-m", *LAUNCHER, *TINY_RUN, "trainer.max_epochs=1", "seed=1,2,3", f"hydra.sweep.dir={sweep}"),
        timeout=300,
    )
    assert "3 of 3 jobs finished" in done.stdout, done.stdout
    runs = sorted(p.parent for p in sweep.glob("*/metrics.json"))
    assert [r.name for r in runs] == ["0", "1", "2"]
    seeds, job_ids = set(), set()
    for run in runs:
        record = json.loads((run / "metrics.json").read_text())
        seeds.add(record["seed"])
        assert record["slurm"]["job_id"].split("_")[1] == run.name  # the array task that ran it
        job_ids.add(record["slurm"]["job_id"])
        facts = json.loads((run / "slurm.json").read_text())
        assert facts["status"] == "completed" and Path(facts["stdout"]).is_file()
        assert "epoch 1/1 | step 4/4 | train/loss" in Path(facts["stdout"]).read_text()  # plain progress lines
    assert seeds == {1, 2, 3} and len(job_ids) == 3
    report = (sweep / "report" / "report.md").read_text()
    assert "3 runs — 3 ok, 0 failed, 0 missing" in report
    assert "| dbsn |" in (sweep / "report" / "table1_error.md").read_text()


@pytest.mark.slow
def test_a_failed_job_does_not_stop_the_others_and_is_reported_with_its_log(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    # the middle job fails in the job, on the cluster, where no check before submission can see it
    done = _run(
        cluster,
        _train(
            "-m",
            *LAUNCHER,
            *TINY_RUN,
            "trainer.max_epochs=1",
            "seed=1,2,3",
            "+callbacks.fail._target_=tests.support.cluster_probe.FailInJob",
            "+callbacks.fail.seed=${seed}",
            "+callbacks.fail.fail_seed=2",
            f"hydra.sweep.dir={sweep}",
        ),
        timeout=300,
        check=False,
    )
    failure = "injected failure in the job of seed 2"
    assert done.returncode != 0  # the sweep command says that a job failed ...
    assert "2 of 3 jobs finished" in done.stdout, done.stdout + done.stderr
    assert (sweep / "0" / "metrics.json").is_file() and (sweep / "2" / "metrics.json").is_file()  # ... the others ran
    facts = json.loads((sweep / "1" / "slurm.json").read_text())
    assert facts["status"] == "failed" and failure in facts["error"]
    assert failure in Path(facts["stdout"]).read_text()  # the error is in the job's SLURM log
    assert f"SLURM log  {facts['stdout']}" in done.stdout
    report = (sweep / "report" / "report.md").read_text()
    assert "3 runs — 2 ok, 1 failed, 0 missing" in report
    section = report.split("## Runs not included", 1)[1]
    assert failure in section and f"SLURM log: `{facts['stdout']}`" in section


@pytest.mark.slow
def test_two_nodes_through_srun_train_one_run_with_world_size_two(cluster, tmp_path):
    run = tmp_path / "run"
    probe = tmp_path / "probe"
    command = [
        "srun",
        "-N2",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        *_train(
            *TINY_RUN,
            "trainer.max_epochs=1",
            "trainer.num_nodes=2",
            "trainer.devices=1",
            "trainer.strategy=ddp",
            "model.train_samples=2",
            f"hydra.run.dir={run}",
            "+callbacks.probe._target_=tests.support.cluster_probe.RecordRankStructures",
            f"+callbacks.probe.folder={probe}",
        ),
    ]
    env_run = _run(cluster, ["env", "MASTER_ADDR=127.0.0.1", *command], timeout=300)
    record = json.loads((run / "metrics.json").read_text())
    assert record["world_size"] == 2 and record["parallel"] == "structure"
    assert record["slurm"]["num_nodes"] == 2 and record["slurm"]["nodes"] == "n[1-2]"
    # both ranks trained in the one folder; each evaluated its own one of the T = 2 structures
    ranks = {int(p.stem.removeprefix("rank")): torch.load(p) for p in probe.glob("rank*.pt")}
    assert sorted(ranks) == [0, 1], env_run.stdout
    assert ranks[0]["alpha"].shape[0] == ranks[1]["alpha"].shape[0] == 1
    assert not torch.allclose(ranks[0]["alpha"], ranks[1]["alpha"])
    assert ranks[0]["node"] != ranks[1]["node"]  # SLURM_NODEID 0 and 1
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("run", "probe")] == []  # no other folders


#: how each stopped job of the requeue test is stopped, by its task_name (job 0, "through", runs through)
STOPS = {"requeued": "scontrol requeue", "preempted": "preemption signal"}


@pytest.mark.slow
def test_a_requeued_or_preempted_job_resumes_to_the_uninterrupted_runs_final_state(cluster, tmp_path):
    """Three identical jobs in one sweep (only task_name differs); after its first epoch's
    checkpoint, job 1 is stopped by `scontrol requeue` (SLURM kills and requeues it) and job 2 by
    the preemption signal submitit gets before a time limit or preemption (USR2: the job finishes
    the epoch it is in, writes its checkpoint and requeues itself). Each resumes from its own
    last.ckpt and ends with the same weights and θ as job 0, which ran through. (One sweep for
    both stops: the cluster runs the three jobs side by side.)"""
    sweep = tmp_path / "sweep"
    epochs = 6
    command = _train(
        "-m",
        *LAUNCHER,
        *TINY_RUN,
        f"trainer.max_epochs={epochs}",
        "seed=5",
        f"task_name=through,{','.join(STOPS)}",
        f"hydra.sweep.dir={sweep}",
    )
    sweeping = subprocess.Popen(
        command, cwd=ROOT, env=_job_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    epoch_at_stop = {}
    try:
        deadline = time.time() + 300
        while len(epoch_at_stop) < len(STOPS):
            for index, name in enumerate(STOPS, start=1):
                job = sweep / str(index)
                if name in epoch_at_stop or not (job / "checkpoints" / "last.ckpt").is_file():
                    continue
                job_id = json.loads((job / "slurm.json").read_text())["job_id"]
                epoch_at_stop[name] = load_checkpoint(job / "checkpoints" / "last.ckpt")["epoch"]
                action = (
                    ["scontrol", "requeue", job_id]
                    if STOPS[name] == "scontrol requeue"
                    else ["scancel", "--signal=USR2", job_id]
                )
                subprocess.run(action, env=cluster.env, check=True, capture_output=True)
            assert time.time() < deadline and sweeping.poll() is None, (
                f"jobs wrote no checkpoint: {sorted(set(STOPS) - set(epoch_at_stop))}"
            )
            time.sleep(0.2)
        out, _ = sweeping.communicate(timeout=400)
    finally:
        if sweeping.poll() is None:
            sweeping.kill()
    assert sweeping.returncode == 0, out + cluster.logs()
    through = load_checkpoint(sweep / "0" / "checkpoints" / "last.ckpt")
    for index, (name, stop) in enumerate(STOPS.items(), start=1):
        stopped = sweep / str(index)
        assert epoch_at_stop[name] < epochs - 2, (name, epoch_at_stop)  # it was stopped well before the end
        facts = json.loads((stopped / "slurm.json").read_text())
        assert facts["restarts"] >= 1, name  # SLURM_RESTART_COUNT of the run that finished
        log = Path(facts["stdout"]).read_text()
        before, resumed_part = log.split(
            f"Resuming from this run's own checkpoint {stopped / 'checkpoints' / 'last.ckpt'}"
        )
        # progress lines count epochs from 1; the checkpoint's "epoch" from 0
        first_resumed_epoch = int(resumed_part.split("\nepoch ", 1)[1].split("/", 1)[0])
        last_epoch_before = max(
            int(line.split("/", 1)[0].removeprefix("epoch "))
            for line in before.splitlines()
            if line.startswith("epoch ")
        )
        if stop == "preemption signal":
            assert "Preemption signal SIGUSR2: requeueing after this epoch's checkpoint" in before
            # the epoch in progress at the signal was finished and saved before the job stopped
            assert first_resumed_epoch >= epoch_at_stop[name] + 3, (epoch_at_stop, first_resumed_epoch)
        else:
            # continued, not restarted: the first epoch after the requeue follows the checkpointed
            # one (a run from scratch ends bit-identical too, so the final state alone cannot tell)
            assert epoch_at_stop[name] + 2 <= first_resumed_epoch <= last_epoch_before + 1, (
                epoch_at_stop,
                first_resumed_epoch,
            )
        resumed = load_checkpoint(stopped / "checkpoints" / "last.ckpt")
        assert through["epoch"] == resumed["epoch"] == epochs - 1 and through["global_step"] == resumed["global_step"]
        assert through["state_dict"].keys() == resumed["state_dict"].keys()
        for key, value in through["state_dict"].items():
            assert torch.equal(value, resumed["state_dict"][key]), (name, key)
        assert torch.equal(through["state_dict"]["structure.theta"], resumed["state_dict"]["structure.theta"])


@pytest.mark.slow
def test_a_launcher_request_that_contradicts_the_trainer_is_refused_before_submission(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    done = _run(
        cluster,
        _train(
            "-m",
            *LAUNCHER,
            *TINY_RUN,
            "trainer.devices=2",
            "hydra.launcher.tasks_per_node=1",
            f"hydra.sweep.dir={sweep}",
        ),
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "hydra.launcher.tasks_per_node=1 but trainer.devices=2" in done.stderr
    assert "Nothing was submitted" in done.stderr
    assert "Traceback" not in done.stderr  # the user's mistake, said plainly
    queue = subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout
    assert not queue.strip() and not (sweep / ".submitit").exists()


@pytest.mark.slow
def test_a_request_no_node_can_satisfy_is_refused_with_the_numbers_and_the_fix(cluster, tmp_path):
    """The launcher's defaults (8 CPUs per task, 32 GB) on this cluster's 2-CPU, 4000 MB nodes
    would pend forever: refused before submission, with what the nodes have and the overrides
    that fit."""
    sweep = tmp_path / "sweep"
    done = _run(
        cluster,
        _train(
            "-m",
            *[o for o in LAUNCHER if "cpus_per_task" not in o and "mem_gb" not in o],
            *TINY_RUN,
            f"hydra.sweep.dir={sweep}",
        ),
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: ") and "would pend forever" in line and "Traceback" not in done.stderr
    assert "8 CPUs" in line and "32768 MB" in line and f"largest: {cluster.cpus} CPUs, 4000 MB" in line, line
    assert f"hydra.launcher.cpus_per_task={cluster.cpus}" in line and "hydra.launcher.mem_gb=3" in line, line
    assert "Nothing was submitted" in line
    assert not subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_a_job_pending_for_a_reason_that_never_clears_is_reported_while_waiting(cluster, tmp_path):
    """With the check off, the same request is submitted and pends; the waiting sweep says so,
    with the reason and what to do, instead of waiting without a word. The test then cancels it."""
    sweep = tmp_path / "sweep"
    command = _train(
        "-m",
        *[o for o in LAUNCHER if "cpus_per_task" not in o],
        "hydra.launcher.cpus_per_task=8",
        "hydra.launcher.check_partition=false",
        "hydra.launcher.poll_s=1",
        *TINY_RUN,
        f"hydra.sweep.dir={sweep}",
    )
    sweeping = subprocess.Popen(
        command, cwd=ROOT, env=_job_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, rest = [], ""
    watchdog = threading.Timer(180, sweeping.kill)  # a sweep that never says it stays stuck here otherwise
    watchdog.start()
    try:
        for line in sweeping.stdout:
            lines.append(line)
            if " is pending (" in line:
                break
        subprocess.run(["scancel", "-u", os.environ.get("USER", "root")], env=cluster.env, capture_output=True)
        rest, _ = sweeping.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if sweeping.poll() is None:
            sweeping.kill()
    output = "".join(lines) + (rest or "")
    assert "Submitted 1 SLURM job(s)" in output, output
    pending = next(line for line in output.splitlines() if " is pending (" in line)
    assert "will not start" in pending and "scancel" in pending, pending
    assert sweeping.returncode != 0 and "0 of 1 jobs finished" in output, output
