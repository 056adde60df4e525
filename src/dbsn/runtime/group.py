"""Several training runs in one process: `train_group(cfgs, output_dirs)`, and a sweep's jobs in
groups of R with `python train.py -m seed=0,1,2,3 hydra.launcher.runs_per_process=4`.

Off by default (R = 1). What a group is for: on one GPU the paper's step leaves the device mostly
idle between small kernels, and R independent runs (the paper's seeds) can fill it together. Each
run is `dbsn.runtime.run.train` as it is, on its own thread, in its own run folder, on CUDA with a
stream of its own, so its kernels and CUDA-graph replays may overlap with the other runs'.

Each run equals its solo run: the runs take turns, one training batch each (`dbsn.runtime.turns`),
and at every hand-over the process-wide state a run reads (the random generators, on CUDA each
device's generator state object; environment variables; the working directory; Hydra's config
singleton; the root logger's handlers; torch's global switches) is saved for the run that leaves
and restored for the one that arrives. On the CPU a grouped run ends bit for bit where its solo run ends (tested). Signals
reach every run of the group through the main thread (`turns._Relay`). Refused in one line: DDP
or several nodes in a group, W&B logging, two runs in one folder. What a GPU must still show
(overlap in a real training, each graphed run's random numbers) and the figures: docs/training.md
("Several runs in one process").
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
