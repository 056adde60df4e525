"""Several training runs in one process: `train_group(cfgs, output_dirs)`, and a sweep's jobs in
groups of R with `python train.py -m seed=0,1,2,3 hydra.launcher.runs_per_process=4`.

Off by default (`hydra.launcher.runs_per_process: 1`): one run per process, as before. What a group
is for: on one GPU, the paper's step leaves the device mostly idle between small kernels, and R
independent runs (the paper's seeds) can fill it together. Each run is `dbsn.runtime.run.train`
as it is, on its own thread, in its own run folder; on CUDA each thread's current stream is a
stream of its own, so its kernels (and its CUDA graph's replays) go there and may overlap with
the other runs' while the host moves on. docs/performance.md has what this gained on a GPU.

**Each run equals its solo run.** The runs take turns: exactly one run's Python runs at a time,
and a run hands the turn to the next at the end of each training batch (`dbsn.runtime.turns`:
`TurnCallback`, in every run's trainer), or when it ends, error or not. At every hand-over
the process-wide state a run reads is saved for the run that leaves and put back for the one
that arrives (`turns.ProcessState`): the random generators (torch's CPU generator, NumPy's, Python's
`random`, and on CUDA each device's default generator), the environment variables (Lightning's
`PL_GLOBAL_SEED`, Hydra's `env_set`), the working directory, Hydra's config singleton (`.hydra/`
files, `origin_of`, the log file's name) and the root logger's handlers (each run's `train.log`).
So every run draws exactly its own random stream and does the same operations as alone, and on
the CPU it ends bit for bit where its solo run ends (a test compares the metrics and the final
weights). Which run signals reach: `dbsn.runtime.signals` keeps the run under way per thread.

On CUDA the default generator is switched by its state object (`graphsafe_set_state`), not by
copying seed and offset: a CUDA graph captured by a run then holds that run's own generator
state, and its replays advance that run's offset only. (A replay writes the seed and offset into
tensors of the state it was captured with, on its stream: runs sharing one state would race on
them.) Not covered, and not testable on a CPU:
whether a run's graph replays on its own stream overlap in a real training (a run that
synchronises its stream while it holds the turn, to read its loss, lets the others launch only
after), and whether the graph-safe generator states give each run its solo random numbers on a
GPU (they should; a GPU test must compare one run of a group with its solo run). Untested in a
group: `torch.compile` (compiled on several threads) and data-loader worker processes (forked from
a process with several threads). The peak memory a run reports (`reset_peak_memory`) is the
group's, the device's.

Signals: handlers belong to the main thread, so a group installs its own there (`turns._Relay`):
SIGTERM, SIGINT or SIGHUP asks every run to stop at the end of its batch in progress (or at the
start of its next Lightning loop), as a signal stops a run alone (`dbsn.runtime.signals`); each
leaves as `RunInterrupted`, resumable from its last epoch-end checkpoint. A second signal ends
the process at once (exit 128 + the signal's number): every run folder is then as after a
`kill -9`, which `resume=true` continues exactly. Refused in a group, in one line: DDP or several
nodes (`trainer.devices` > 1, `trainer.num_nodes` > 1, a `ddp` strategy), two runs in one folder.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig

from dbsn.runtime.turns import check_group, run_group, runs_per_process

__all__ = ["check_group", "launch_groups", "run_group", "runs_per_process", "train_group"]


def _wants_cuda(cfgs: Sequence[DictConfig]) -> bool:
    from dbsn.runtime.build import device_of

    return torch.cuda.is_available() and any(device_of(cfg.trainer).type == "cuda" for cfg in cfgs)


def train_group(
    cfgs: Sequence[DictConfig], output_dirs: Sequence[str | Path], *, turns: list | None = None
) -> list[dict[str, float]]:
    """`dbsn.runtime.run.train(cfg, output_dir)` for every pair, together in this process (see the
    module docstring): each run in its own folder, each equal to its solo run. Returns each run's test
    metrics, in order; when a run failed, raises the first run's error once every run has ended
    (the others' folders are complete). `turns`: a list that receives which run had each turn."""
    from dbsn.runtime.run import train

    output_dirs = [Path(d) for d in output_dirs]
    check_group(cfgs, output_dirs)
    tasks = [functools.partial(train, cfg, folder, "output_dir") for cfg, folder in zip(cfgs, output_dirs)]
    outcomes = run_group(tasks, cuda=_wants_cuda(cfgs), turns=turns)
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
    return [outcome.value for outcome in outcomes]


# ---------------------------------------------------------------------- a sweep's jobs in groups
def launch_groups(
    launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, size: int, configs: Sequence[DictConfig]
) -> list:
    """The local launcher's `launch` for `runs_per_process` = `size` > 1: Hydra's basic launcher, with
    consecutive jobs in groups of `size` that each run together in this process (`run_group`).
    Every job runs through Hydra's `run_job` as it would alone: its own run folder, `.hydra/` files
    and metrics.json. `configs`: the jobs as composed and checked first (`dbsn.runtime.sweep`)."""
    from hydra.core.utils import configure_log, filter_overrides, run_job, setup_globals
    from omegaconf import open_dict

    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(__name__)
    log.info(f"Launching {len(job_overrides)} jobs locally, {size} per process")
    returns: list = []
    for first in range(0, len(job_overrides), size):
        group = list(range(first, min(first + size, len(job_overrides))))
        jobs = []
        for idx in group:
            num = initial_job_idx + idx
            log.info(f"\t#{num} : {' '.join(filter_overrides(job_overrides[idx]))}")
            job = launcher.hydra_context.config_loader.load_sweep_config(config, list(job_overrides[idx]))
            with open_dict(job):
                job.hydra.job.id = num
                job.hydra.job.num = num
            jobs.append(job)
        # the console's logging, once for the group (each job's would close the others' log files)
        configure_log(jobs[0].hydra.job_logging, jobs[0].hydra.verbose)
        tasks = [
            functools.partial(
                run_job,
                hydra_context=launcher.hydra_context,
                task_function=launcher.task_function,
                config=job,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
                configure_logging=False,
            )
            for job in jobs
        ]
        outcomes = run_group(tasks, cuda=_wants_cuda([configs[idx] for idx in group]))
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
        stop = next((o.error for o in outcomes if o.error is not None), None)
        if stop is not None:  # what ends a job's process (an entry point's exit, Ctrl-C): after the whole group
            raise stop
        returns.extend(outcome.value for outcome in outcomes)
    return returns
