"""The cluster path on a real SLURM cluster that the fixture stands up on this machine (one
controller, two slurmd nodes, munge; see slurm_cluster.py), through the project's own entry
points: a sweep through `hydra/launcher=slurm`, a 2-node DDP run through `srun`, a requeued job
that resumes to the uninterrupted run's final state, and a sweep in which one job fails.

Skipped, with the reason, only where SLURM cannot be installed (not root or no apt); on CI
(`CI` set) that is a failure instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import LocalSlurmCluster, ensure_slurm_installed

from dbsn.runtime.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# tiny digits runs: 256 training images (4 batches), S = 2, no per-epoch figures
TINY_RUN = ["experiment=quick", "data.train_subset=256", "model.prediction.n_samples=2", "model.prediction.samples_per_forward=2",
            "callbacks.structure_posterior.save_figures=false", "callbacks.structure_posterior.n_samples=10"]
# the local cluster's jobs: one thread each, rendezvous on 127.0.0.1 (the node names do not resolve)
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=null",
            "hydra.launcher.timeout_min=30", "hydra.launcher.setup=['export MASTER_ADDR=127.0.0.1']"]


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


def _run(cluster, command: list[str], timeout: float, cwd=ROOT, check: bool = True) -> subprocess.CompletedProcess:
    env = {**cluster.env, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{' '.join(command)} took over {timeout} s:\n{err.stdout}\n{err.stderr}{cluster.logs()}") from err
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                             f"{done.stderr[-6000:]}{cluster.logs()}")
    return done


def _train(*overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *overrides]


def test_a_sweep_runs_as_slurm_jobs_and_ends_with_a_report(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    done = _run(cluster, _train("-m", *LAUNCHER, *TINY_RUN, "trainer.max_epochs=1", "seed=1,2,3",
                                f"hydra.sweep.dir={sweep}"), timeout=300)
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


def test_a_failed_job_does_not_stop_the_others_and_is_reported_with_its_log(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    # the middle job asks for more training images than there are: it fails in the job, on the cluster
    done = _run(cluster, _train("-m", *LAUNCHER, *[o for o in TINY_RUN if "train_subset" not in o],
                                "trainer.max_epochs=1", "data.train_subset=128,99999,256", f"hydra.sweep.dir={sweep}"),
                timeout=300, check=False)
    assert done.returncode != 0  # the sweep command says that a job failed ...
    assert "2 of 3 jobs finished" in done.stdout, done.stdout + done.stderr
    assert (sweep / "0" / "metrics.json").is_file() and (sweep / "2" / "metrics.json").is_file()  # ... the others ran
    facts = json.loads((sweep / "1" / "slurm.json").read_text())
    assert facts["status"] == "failed" and "data.train_subset=99999" in facts["error"]
    assert "data.train_subset=99999" in Path(facts["stdout"]).read_text()  # the error is in the job's SLURM log
    assert f"SLURM log  {facts['stdout']}" in done.stdout
    report = (sweep / "report" / "report.md").read_text()
    assert "3 runs — 2 ok, 1 failed, 0 missing" in report
    section = report.split("## Runs not included", 1)[1]
    assert "data.train_subset=99999" in section and f"SLURM log: `{facts['stdout']}`" in section


def test_two_nodes_through_srun_train_one_run_with_world_size_two(cluster, tmp_path):
    run = tmp_path / "run"
    probe = tmp_path / "probe"
    command = ["srun", "-N2", "--ntasks-per-node=1", "--cpus-per-task=1", *_train(
        *TINY_RUN, "trainer.max_epochs=1", "trainer.num_nodes=2", "trainer.devices=1", "trainer.strategy=ddp",
        "model.train_samples=2", f"hydra.run.dir={run}",
        "+callbacks.probe._target_=cluster_probe.RecordRankStructures", f"+callbacks.probe.folder={probe}")]
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


@pytest.mark.parametrize("stop", ["scontrol requeue", "preemption signal"])
def test_a_requeued_job_resumes_to_the_uninterrupted_runs_final_state(cluster, tmp_path, stop):
    """Two identical jobs in one sweep (only task_name differs); job 1 is stopped after its first
    epoch's checkpoint, either by `scontrol requeue` (SLURM kills and requeues it) or by the
    preemption signal submitit gets before a time limit or preemption (USR2): the job finishes
    the epoch it is in, writes its checkpoint and requeues itself. Either way it resumes from its
    own last.ckpt and ends with the same weights and θ as job 0, which ran through."""
    sweep = tmp_path / "sweep"
    epochs = 6
    command = _train("-m", *LAUNCHER, *TINY_RUN, f"trainer.max_epochs={epochs}", "seed=5", "task_name=through,requeued",
                     f"hydra.sweep.dir={sweep}")
    env = {**cluster.env, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    sweeping = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        requeued = sweep / "1"
        deadline = time.time() + 240
        while not (requeued / "checkpoints" / "last.ckpt").is_file():
            assert time.time() < deadline and sweeping.poll() is None, "job 1 wrote no checkpoint"
            time.sleep(0.2)
        job_id = json.loads((requeued / "slurm.json").read_text())["job_id"]
        epoch_at_stop = load_checkpoint(requeued / "checkpoints" / "last.ckpt")["epoch"]
        action = ["scontrol", "requeue", job_id] if stop == "scontrol requeue" else ["scancel", "--signal=USR2", job_id]
        subprocess.run(action, env=cluster.env, check=True, capture_output=True)
        out, _ = sweeping.communicate(timeout=300)
    finally:
        if sweeping.poll() is None:
            sweeping.kill()
    assert sweeping.returncode == 0, out + cluster.logs()
    assert epoch_at_stop < epochs - 2  # it was stopped well before the end
    facts = json.loads((requeued / "slurm.json").read_text())
    assert facts["restarts"] >= 1  # SLURM_RESTART_COUNT of the run that finished
    log = Path(facts["stdout"]).read_text()
    before, resumed_part = log.split(f"Resuming from this run's own checkpoint {requeued / 'checkpoints' / 'last.ckpt'}")
    # progress lines count epochs from 1; the checkpoint's "epoch" from 0
    first_resumed_epoch = int(resumed_part.split("\nepoch ", 1)[1].split("/", 1)[0])
    last_epoch_before = max(int(line.split("/", 1)[0].removeprefix("epoch ")) for line in before.splitlines()
                            if line.startswith("epoch "))
    if stop == "preemption signal":
        assert "Preemption signal SIGUSR2: requeueing after this epoch's checkpoint" in before
        # the epoch in progress at the signal was finished and saved before the job stopped
        assert first_resumed_epoch >= epoch_at_stop + 3, (epoch_at_stop, first_resumed_epoch)
    else:
        # continued, not restarted: the first epoch after the requeue follows the checkpointed
        # one (a run from scratch ends bit-identical too, so the final state alone cannot tell)
        assert epoch_at_stop + 2 <= first_resumed_epoch <= last_epoch_before + 1, (epoch_at_stop, first_resumed_epoch)
    through = load_checkpoint(sweep / "0" / "checkpoints" / "last.ckpt")
    resumed = load_checkpoint(requeued / "checkpoints" / "last.ckpt")
    assert through["epoch"] == resumed["epoch"] == epochs - 1 and through["global_step"] == resumed["global_step"]
    assert through["state_dict"].keys() == resumed["state_dict"].keys()
    for key, value in through["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    assert torch.equal(through["state_dict"]["structure.theta"], resumed["state_dict"]["structure.theta"])


def test_a_launcher_request_that_contradicts_the_trainer_is_refused_before_submission(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    done = _run(cluster, _train("-m", *LAUNCHER, *TINY_RUN, "trainer.devices=2", "hydra.launcher.tasks_per_node=1",
                                f"hydra.sweep.dir={sweep}"), timeout=120, check=False)
    assert done.returncode == 2
    assert "hydra.launcher.tasks_per_node=1 but trainer.devices=2" in done.stderr
    assert "Nothing was submitted" in done.stderr
    assert "Traceback" not in done.stderr  # the user's mistake, said plainly
    queue = subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout
    assert not queue.strip() and not (sweep / ".submitit").exists()


def test_a_request_no_node_can_satisfy_is_refused_with_the_numbers_and_the_fix(cluster, tmp_path):
    """The launcher's defaults (8 CPUs per task, 32 GB) on this cluster's 2-CPU, 4000 MB nodes
    would pend forever: refused before submission, with what the nodes have and the overrides
    that fit."""
    sweep = tmp_path / "sweep"
    done = _run(cluster, _train("-m", *[o for o in LAUNCHER if "cpus_per_task" not in o and "mem_gb" not in o],
                                *TINY_RUN, f"hydra.sweep.dir={sweep}"), timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: ") and "would pend forever" in line and "Traceback" not in done.stderr
    assert "8 CPUs" in line and "32768 MB" in line and f"largest: {cluster.cpus} CPUs, 4000 MB" in line, line
    assert f"hydra.launcher.cpus_per_task={cluster.cpus}" in line and "hydra.launcher.mem_gb=3" in line, line
    assert "Nothing was submitted" in line
    assert not subprocess.run(["squeue", "-h"], env=cluster.env, capture_output=True, text=True).stdout.strip()


def test_a_job_pending_for_a_reason_that_never_clears_is_reported_while_waiting(cluster, tmp_path):
    """With the check off, the same request is submitted and pends; the waiting sweep says so,
    with the reason and what to do, instead of waiting without a word. The test then cancels it."""
    sweep = tmp_path / "sweep"
    command = _train("-m", *[o for o in LAUNCHER if "cpus_per_task" not in o], "hydra.launcher.cpus_per_task=8",
                     "hydra.launcher.check_partition=false", "hydra.launcher.poll_s=1", *TINY_RUN,
                     f"hydra.sweep.dir={sweep}")
    env = {**cluster.env, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    sweeping = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
