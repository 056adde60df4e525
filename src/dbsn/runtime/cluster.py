"""SLURM: what `hydra/launcher=slurm` submits, and what a job does on the cluster.

Submission (the login node, `python train.py -m hydra/launcher=slurm ...`): `submit_sweep`
composes and checks every job's config (schema and types, `ckpt_path`, and the SLURM request
against the trainer: `nodes` = `trainer.num_nodes`, `tasks_per_node` = `trainer.devices`, enough
GPUs per node) and refuses the sweep before anything is submitted when one is wrong. It submits
one submitit job array, waits for all jobs (a failed job does not stop the others), writes each
job's `slurm.json`, prints the failures with their logs and builds the sweep's report.

On the cluster every SLURM task runs the same Hydra job into the same `<sweep>/<job>` folder
(Lightning's `SLURMEnvironment` gives the ranks), with `resume=true`, so a requeued job continues
from its own `checkpoints/last.ckpt`. Preemption: submitit signals USR2 `signal_delay_s` before the
end and requeues from its handler; `install_preemption_handler` puts `PreemptionRequeue` in front:
training goes on to the end of the epoch, whose checkpoint is written, then requeues; if the grace
period runs out first, it requeues from the previous epoch's checkpoint. Any other SIGTERM stops
the run as an interruption (`dbsn.runtime.signals`). User guide: docs/cluster.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from dbsn.evaluation.runs import SLURM_FILE
from dbsn.runtime.config import ConfigError

GPU_ACCELERATORS = ("auto", "gpu", "cuda")  # on a GPU cluster, "auto" means the GPUs


# ---------------------------------------------------------------------- the request
def devices_per_node(trainer: DictConfig) -> int:
    """`trainer.devices` as a count; a SLURM request needs a number, not "auto" or -1."""
    devices = trainer.get("devices", 1)
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    try:
        count = int(devices)
    except (TypeError, ValueError):
        count = -1
    if count < 1:
        raise ConfigError(
            f"trainer.devices={devices!r}: a SLURM job asks for a number of devices per node; "
            "give it, e.g. trainer.devices=4 (one SLURM task each)."
        )
    return count


def slurm_request(job: DictConfig, launcher: dict[str, Any]) -> dict[str, Any]:
    """`nodes`, `tasks_per_node` and `gpus_per_node` for one job: the launcher's values where
    the user set them, else the trainer's; a mismatch that Lightning would refuse on the cluster
    is refused here, naming both values."""
    trainer = job.trainer
    devices, num_nodes = devices_per_node(trainer), int(trainer.get("num_nodes", 1))
    gpu = str(trainer.get("accelerator", "auto")) in GPU_ACCELERATORS
    nodes, tasks, gpus = launcher.get("nodes"), launcher.get("tasks_per_node"), launcher.get("gpus_per_node")
    if nodes is not None and int(nodes) != num_nodes:
        raise ConfigError(
            f"hydra.launcher.nodes={nodes} but trainer.num_nodes={num_nodes}: the run needs one "
            "SLURM node per trainer node. Leave hydra.launcher.nodes unset (it follows "
            "trainer.num_nodes) or make them equal."
        )
    if tasks is not None and int(tasks) != devices:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={tasks} but trainer.devices={devices}: Lightning's "
            "SLURMEnvironment needs one SLURM task per device. Leave hydra.launcher.tasks_per_node "
            "unset (it follows trainer.devices) or make them equal."
        )
    if launcher.get("gres"):
        gpus = None  # the cluster's own GPU spelling (e.g. gres=gpu:a100:4) replaces --gpus-per-node
    elif gpus is None:
        gpus = devices if gpu else None
    elif gpu and int(gpus) < devices:
        raise ConfigError(
            f"hydra.launcher.gpus_per_node={gpus} but trainer.devices={devices} on "
            f"accelerator={trainer.get('accelerator')}: each device needs its own GPU. Leave "
            "hydra.launcher.gpus_per_node unset (it follows trainer.devices) or raise it."
        )
    return {"nodes": num_nodes, "tasks_per_node": devices, "gpus_per_node": gpus}


def check_sweep(configs: Sequence[DictConfig], launcher: dict[str, Any]) -> dict[str, Any]:
    """Check every job of a sweep before submission (`dbsn.runtime.preflight.check_job`, without
    what asks this machine's hardware: the jobs run on the cluster's); return the SLURM request
    they share."""
    from dbsn.runtime.preflight import check_job

    requests = []
    for num, job in enumerate(configs):
        try:
            if "model" in job and "data" in job:  # a train.py job
                check_job(job, on_this_machine=False)
            requests.append(slurm_request(job, launcher))
        except Exception as err:
            overrides = " ".join(job.hydra.overrides.task) if "hydra" in job else ""
            raise ConfigError(
                f"sweep job #{num} ({overrides or 'no overrides'}): {err} Nothing was submitted."
            ) from err
    distinct = {json.dumps(r, sort_keys=True) for r in requests}
    if len(distinct) > 1:
        first, other = requests[0], next(r for r in requests if r != requests[0])
        raise ConfigError(
            f"the jobs of one sweep share one SLURM request, but they ask for {first} and {other} "
            "(trainer.num_nodes / trainer.devices differ between jobs): submit them as separate "
            "sweeps. Nothing was submitted."
        )
    return requests[0]


# ---------------------------------------------------------------------- what the partition offers
#: why a pending job will never start, by squeue's reason code
NEVER_CLEARS = {
    "PartitionConfig": "its request exceeds what the partition allows or its nodes have",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit exceeds the partition's",
    "BadConstraints": "no node has the requested features",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than its QOS allows",
    "QOSMaxGRESPerJob": "it asks for more GPUs than its QOS allows",
    "QOSMaxMemoryPerJob": "it asks for more memory than its QOS allows",
    "QOSMaxWallDurationPerJobLimit": "its time limit exceeds its QOS's",
}


def _command(*args: str) -> str | None:
    """A SLURM command's stdout, or None where it cannot run."""
    import subprocess

    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _gpu_count(gres: str) -> int:
    """GPUs in a gres string like 'gpu:a100:4(S:0-1),gpu:2' (0 for '(null)')."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[\w-]+)?:(\d+)", gres or ""))


def partition_nodes(partition: str | None) -> tuple[str, list[dict[str, Any]], dict[str, str]] | None:
    """(partition, its nodes' CPUs / memory (MB) / GPUs / features, its limits) from sinfo and
    scontrol; None where SLURM does not answer."""
    if partition is None:
        listing = _command("sinfo", "-h", "-o", "%P")
        defaults = [p.strip().rstrip("*") for p in (listing or "").split() if p.strip().endswith("*")]
        if not defaults:
            return None
        partition = defaults[0]
    rows = _command("sinfo", "-h", "-N", "-p", partition, "-o", "%N|%c|%m|%G|%f")
    if not rows:
        return None
    nodes = {}
    for row in rows.splitlines():
        name, cpus, memory, gres, features = (row.split("|") + [""] * 5)[:5]
        if not cpus.strip().isdigit():
            continue
        nodes[name.strip()] = {
            "name": name.strip(),
            "cpus": int(cpus),
            "memory_mb": int(re.sub(r"\D", "", memory) or 0),
            "gpus": _gpu_count(gres),
            "features": set(features.strip().split(",")),
        }
    described = _command("scontrol", "show", "partition", partition, "-o") or ""
    limits = dict(item.split("=", 1) for item in described.split() if "=" in item)
    return partition, list(nodes.values()), limits


def _minutes(limit: str) -> float | None:
    """A SLURM time limit in minutes; None for INFINITE. SLURM's forms: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds."""
    if not limit or limit.upper() in ("INFINITE", "UNLIMITED"):
        return None
    days, dash, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if dash:  # hours first
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return 1440 * int(days or 0) + 60 * hours + minutes + seconds / 60


def _has_features(features: set[str], constraint: str | None) -> bool:
    """Whether a node with `features` satisfies `--constraint`: a feature, or features joined by
    `&` (all) and `|` (any, `&` binding tighter). Other syntax (brackets, counts) is not
    checked: every node is taken to satisfy it, and SLURM decides."""
    if not constraint:
        return True
    if not re.fullmatch(r"[\w.:-]+(?:[&|][\w.:-]+)*", constraint):
        return True
    return any(all(f in features for f in alternative.split("&")) for alternative in constraint.split("|"))


def check_partition(params: dict[str, Any]) -> None:
    """Refuse a request that no node of the partition can satisfy (it would pend forever,
    `PENDING (PartitionConfig)`), naming what is asked, what the nodes have, and the overrides
    that fit. Nothing is checked where sinfo does not answer (say, a login node without it)."""
    found = partition_nodes(params.get("partition"))
    if found is None:
        print("Note: sinfo did not answer; the SLURM request was not checked against the partition.", flush=True)
        return
    partition, nodes, limits = found
    tasks = int(params.get("tasks_per_node") or 1)
    gpus = int(params.get("gpus_per_node") or 0) or _gpu_count(str(params.get("gres") or ""))
    if params.get("cpus_per_task"):
        cpus = tasks * int(params["cpus_per_task"])
    elif params.get("cpus_per_gpu") and gpus:
        cpus = gpus * int(params["cpus_per_gpu"])
    else:
        cpus = tasks
    if params.get("mem_gb") is not None:
        memory = int(float(params["mem_gb"]) * 1024)
    elif params.get("mem_per_cpu") is not None:
        memory = int(float(re.sub(r"[^\d.]", "", str(params["mem_per_cpu"])) or 0)) * cpus
    else:
        memory = 0
    wanted = int(params.get("nodes") or 1)
    constraint = params.get("constraint")
    usable = [n for n in nodes if _has_features(n["features"], constraint)]
    fitting = [n for n in usable if n["cpus"] >= cpus and n["memory_mb"] >= memory and n["gpus"] >= gpus]
    problems = []
    if len(fitting) < wanted:
        biggest = max(usable or nodes, key=lambda n: (n["gpus"] >= gpus, n["cpus"], n["memory_mb"]))
        fixes = []
        if cpus > biggest["cpus"] and params.get("cpus_per_task"):
            fixes.append(f"hydra.launcher.cpus_per_task={max(biggest['cpus'] // tasks, 1)}")
        if memory > biggest["memory_mb"]:
            fixes.append(
                f"hydra.launcher.mem_gb={max(biggest['memory_mb'] // 1024, 1) if biggest['memory_mb'] >= 1024 else 'null'}"
            )
        if gpus > biggest["gpus"]:
            fixes.append(
                f"trainer.devices={biggest['gpus']}"
                if biggest["gpus"]
                else "another partition (hydra.launcher.partition=...) with GPUs"
            )
        if len(usable) < wanted:
            fixes.append(f"trainer.num_nodes={len(usable)}")
        problems.append(
            f"each job asks for {wanted} node(s) with {cpus} CPUs ({tasks} task(s) x {cpus // max(tasks, 1)}), "
            f"{memory} MB of memory and {gpus} GPU(s) each, but {'only ' + str(len(fitting)) if fitting else 'none'} of "
            f"the {len(usable)} node(s) of partition '{partition}'{' with feature ' + constraint if constraint else ''} "
            f"can give that (the largest: {biggest['cpus']} CPUs, {biggest['memory_mb']} MB, {biggest['gpus']} GPUs)."
            + (f" Fits with: {' '.join(fixes)}." if fixes else "")
        )
    max_minutes = _minutes(limits.get("MaxTime", ""))
    if max_minutes is not None and float(params.get("timeout_min") or 0) > max_minutes:
        problems.append(
            f"hydra.launcher.timeout_min={params.get('timeout_min')} exceeds partition '{partition}''s "
            f"MaxTime of {limits['MaxTime']}. Fits with: hydra.launcher.timeout_min={int(max_minutes)}."
        )
    if problems:
        raise ConfigError("The SLURM request would pend forever: " + " ".join(problems) + " Nothing was submitted.")


def pending_reasons(job_ids: Sequence[str]) -> dict[str, str]:
    """squeue's reason for every pending job of `job_ids` ({} where squeue does not answer)."""
    listing = (
        _command(
            "squeue",
            "-h",
            "-t",
            "PENDING",
            "-r",
            "-o",
            "%i|%r",
            "-j",
            ",".join(sorted({job_id.split("_")[0] for job_id in job_ids})),
        )
        or ""
    )
    reasons = {}
    for line in listing.splitlines():
        job_id, _, reason = line.partition("|")
        if job_id.strip() in job_ids:
            reasons[job_id.strip()] = reason.strip()
    return reasons


def wait_for(jobs: list, poll_s: float = 30.0, say: Callable[[str], None] = print) -> None:
    """Wait until every job has ended; say once about each job pending for a reason that will
    never clear (it would otherwise hold the sweep forever without a word)."""
    said: set[tuple[str, str]] = set()
    while not all(job.done() for job in jobs):
        for job_id, reason in pending_reasons([job.job_id for job in jobs]).items():
            code = reason.strip("()").split(",")[0]
            if code in NEVER_CLEARS and (job_id, code) not in said:
                said.add((job_id, code))
                say(
                    f"Job {job_id} is pending ({code}): {NEVER_CLEARS[code]}; it will not start. Cancel it "
                    f"(scancel {job_id.split('_')[0]}) and submit with a request that fits (`sinfo -N -l` shows the nodes)."
                )
        time.sleep(poll_s)


# ---------------------------------------------------------------------- submission
def submit_sweep(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    """The body of the `slurm` launcher's `launch` (see the module docstring)."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, filter_overrides

    from dbsn.runtime.sweep import check_jobs, compose_jobs
    from dbsn.runtime.turns import runs_per_process

    config = launcher.config
    size = runs_per_process(launcher.params.get("runs_per_process", 1))
    if size > 1:
        raise ConfigError(
            f"hydra.launcher.runs_per_process={size}: several runs per process are run by the local launcher "
            "only, not yet as SLURM jobs; leave it at 1 with hydra/launcher=slurm. Nothing was submitted."
        )
    sweep_dir = Path(str(config.hydra.sweep.dir))
    configs, run_dirs = compose_jobs(launcher, job_overrides, initial_job_idx)
    from dbsn.evaluation.report import ReportError, check_sweep_report_folder

    try:
        check_jobs(configs, run_dirs, initial_job_idx)  # every job's config and folder, before anything is submitted
        check_sweep_report_folder(sweep_dir)  # where the report goes when the jobs have ended
    except (ConfigError, ReportError) as err:
        raise ConfigError(f"{err} Nothing was submitted.") from err
    params = dict(launcher.params)
    params.pop("runs_per_process", None)  # 1: what submitit runs anyway
    params.update(check_sweep(configs, params))
    poll_s = params.pop("poll_s", None)
    poll_s = 30.0 if poll_s is None else max(float(poll_s), 0.1)
    if params.pop("check_partition", True):
        check_partition(params)

    executor = submitit.AutoExecutor(
        folder=params.pop("submitit_folder"), cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    shared = {
        "timeout_min",
        "cpus_per_task",
        "gpus_per_node",
        "tasks_per_node",
        "mem_gb",
        "nodes",
        "name",
        "stderr_to_stdout",
    }
    executor.update_parameters(**{k if k in shared else f"slurm_{k}": v for k, v in params.items() if v is not None})
    sweep_dir.mkdir(parents=True, exist_ok=True)
    arguments = []
    for idx, overrides in enumerate(job_overrides):
        num = initial_job_idx + idx
        print(f"  #{num}: {' '.join(filter_overrides(overrides))}", flush=True)
        arguments.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
    jobs = executor.map_array(launcher, *zip(*arguments))
    print(
        f"Submitted {len(jobs)} SLURM job(s) ({jobs[0].job_id.split('_')[0]}, array of {len(jobs)}); "
        f"sweep folder {sweep_dir}; SLURM logs in {executor.folder}",
        flush=True,
    )

    wait_for(jobs, poll_s, lambda line: print(line, flush=True))
    results, failures = [], []
    for job, overrides, run_dir in zip(jobs, job_overrides, run_dirs):
        try:
            result = job.results()[0]
        except Exception as err:  # killed, timed out too often, node failure: the job ended without a result
            result = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=err)
        failed = result.status != JobStatus.COMPLETED
        facts = {
            "job_id": job.job_id,
            "status": "failed" if failed else "completed",
            "stdout": str(job.paths.stdout),
            "overrides": list(overrides),
        }
        if job.paths.stderr.is_file():
            facts["stderr"] = str(job.paths.stderr)
        if failed:
            facts["error"] = error_line(result._return_value)
            failures.append((run_dir, facts))
        write_job_facts(run_dir, facts)
        results.append(result)
    for run_dir, facts in failures:
        print(
            f"FAILED job {facts['job_id']} ({' '.join(facts['overrides'])}): {facts['error']}\n"
            f"  run folder {run_dir}\n  SLURM log  {facts['stdout']}",
            flush=True,
        )
    if "model" in config:  # a training sweep: its tables
        from dbsn.evaluation.report import build_sweep_report

        report = build_sweep_report(sweep_dir, reference=str((config.get("report") or {}).get("reference") or "dbsn"))
        for line in report.summary:
            print(line, flush=True)
        print(
            f"{len(jobs) - len(failures)} of {len(jobs)} jobs finished; report: {report.out / 'report.md'}", flush=True
        )
    return results


def error_line(error: BaseException) -> str:
    """The line that says what went wrong: the exception line of a job's traceback (submitit
    wraps the job's traceback into its own error), else the error itself."""
    text = str(error)
    raised = [
        line.strip()
        for line in text.splitlines()
        if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b(:|$)", line.strip())
    ]
    return (
        raised[-1] if raised else f"{type(error).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
    )[:1000]


def write_job_facts(run_dir: Path, facts: dict[str, Any]) -> None:
    """Merge `facts` into `<run_dir>/slurm.json` (written by the job when it starts, and by the
    launcher when it has finished)."""
    path = Path(run_dir) / SLURM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.is_file() else {}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({**old, **facts}, indent=2) + "\n")
    os.replace(tmp, path)


def job_facts() -> dict[str, Any] | None:
    """This SLURM job: ids, node list, restarts and (under submitit) its log files; None outside SLURM."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    env = os.environ
    array = env.get("SLURM_ARRAY_JOB_ID")
    facts = {
        "job_id": f"{array}_{env['SLURM_ARRAY_TASK_ID']}" if array else env["SLURM_JOB_ID"],
        "nodes": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
        "num_nodes": int(env.get("SLURM_NNODES", 1)),
        "tasks": int(env.get("SLURM_NTASKS", 1)),
        "restarts": int(env.get("SLURM_RESTART_COUNT", 0)),
    }
    try:
        import submitit

        paths = submitit.JobEnvironment().paths
        facts["stdout"] = str(paths.stdout).replace("%t", "0")
        if Path(str(paths.stderr).replace("%t", "0")).is_file():
            facts["stderr"] = str(paths.stderr).replace("%t", "0")
    except RuntimeError:  # not started by submitit (sbatch/srun by hand)
        pass
    return facts


# ---------------------------------------------------------------------- in the job
def limit_threads_to_allocation() -> None:
    """PyTorch sizes its thread pool by the node's cores, not by the job's share of them: on a
    shared node that oversubscribes the cores, and oversubscribed CPU runs slow down many times over.
    Use `--cpus-per-task` threads unless OMP_NUM_THREADS says otherwise."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus and cpus.isdigit() and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(int(cpus))


def job_overrides_with_resume(overrides: Sequence[str], config: DictConfig) -> list[str]:
    """A training job on the cluster resumes from its own last.ckpt when requeued."""
    overrides = list(overrides)
    if "resume" in config and not any(o.split("=", 1)[0].lstrip("+~") == "resume" for o in overrides):
        overrides.append("resume=true")
    return overrides


class PreemptionRequeue(pl.Callback):
    """Requeue the job at the next epoch boundary after submitit's preemption/time-out signal (see
    the module docstring), or when the grace period runs out, whichever comes first."""

    active: PreemptionRequeue | None = None  # the one installed in this process

    def __init__(self, requeue: Callable[[], None], grace_s: float) -> None:
        self.requeue, self.grace_s = requeue, grace_s
        self.signalled_at: float | None = None
        self.fitting = False

    def signalled(self, signum, frame) -> None:
        print(
            f"Preemption signal {signal.Signals(signum).name}: requeueing after this epoch's checkpoint "
            f"(or in {self.grace_s:.0f} s)",
            flush=True,
        )
        self.signalled_at = time.monotonic()
        if not self.fitting:  # testing or reporting: nothing to wait for
            self.requeue()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.fitting = True

    def on_fit_end(self, trainer, pl_module) -> None:
        self.fitting = False

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.signalled_at is not None:  # the previous epoch's last.ckpt is on disk
            self.requeue()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.signalled_at is not None and time.monotonic() - self.signalled_at > self.grace_s:
            self.requeue()


def install_preemption_handler(grace_s: float) -> None:
    """In a submitit job: route submitit's USR2 through `PreemptionRequeue` (call after submitit
    installed its handlers, i.e. inside the job's function)."""
    previous = signal.getsignal(signal.SIGUSR2)
    if not callable(previous):
        return

    def requeue() -> None:
        from dbsn.runtime.signals import requeueing

        callback.signalled_at = None  # once: on ranks other than 0 submitit's handler returns
        with requeueing():  # the SIGTERM that SLURM sends the requeued job is expected, not an interruption
            previous(signal.SIGUSR2, None)  # rank 0: checkpoint the submission, scontrol requeue, exit

    callback = PreemptionRequeue(requeue, grace_s)
    signal.signal(signal.SIGUSR2, callback.signalled)
    PreemptionRequeue.active = callback
