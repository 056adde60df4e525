"""Every job of a sweep is composed and checked before the first one starts.

Otherwise `python train.py -m model.optim.lr=0.1,-1` would train job 0 to its end before job 1's
learning rate was refused. Both launchers (conf/hydra/launcher/: `local`, the default, and `slurm`)
call `compose_jobs` and `check_jobs` first: each job's config is composed as it will run, checked
as `train.py` checks a single run (`dbsn.runtime.preflight.check_job`), and its run folder as
`train.py` checks its own (`dbsn.runtime.folder.check_run_folder`); one bad job refuses the whole
sweep in one line, before anything is trained or submitted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from dbsn.runtime.config import ConfigError

__all__ = ["check_jobs", "compose_jobs", "job_name", "refuse"]


def compose_jobs(
    launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
) -> tuple[list[DictConfig], list[Path]]:
    """Each job's config, resolved as it will run (its `${hydra:...}` values included), and its run
    folder `<sweep dir>/<subdir>`."""
    from hydra.core.hydra_config import HydraConfig

    config = launcher.config
    sweep_dir = Path(str(config.hydra.sweep.dir))
    configs, run_dirs = [], []
    hydra_config = HydraConfig.instance().cfg
    try:
        for idx, overrides in enumerate(job_overrides):
            job = launcher.hydra_context.config_loader.load_sweep_config(config, list(overrides))
            with open_dict(job.hydra):
                job.hydra.job.num = initial_job_idx + idx
                run_dirs.append(sweep_dir / str(job.hydra.sweep.subdir))
                job.hydra.runtime.output_dir = str(run_dirs[-1].absolute())
            HydraConfig.instance().set_config(job)  # the job's ${hydra:...} values resolve as they will in it
            configs.append(OmegaConf.create(OmegaConf.to_container(job, resolve=True)))
    finally:
        HydraConfig.instance().cfg = hydra_config
    return configs, run_dirs


def job_name(num: int, job: DictConfig) -> str:
    overrides = " ".join(job.hydra.overrides.task) if "hydra" in job else ""
    return f"sweep job #{num} ({overrides or 'no overrides'})"


def check_jobs(configs: Sequence[DictConfig], run_dirs: Sequence[Path], initial_job_idx: int = 0) -> None:
    """Refuse the sweep (`ConfigError`, one line naming the job) if any job's config is wrong or its
    run folder may not be used (another run's, a live run's, or shared with another job)."""
    from dbsn.runtime.folder import check_run_folder
    from dbsn.runtime.preflight import check_job

    seen: dict[Path, int] = {}
    for idx, (job, run_dir) in enumerate(zip(configs, run_dirs)):
        num = initial_job_idx + idx
        key = Path(run_dir).absolute()
        if key in seen:
            raise ConfigError(
                f"sweep jobs #{seen[key]} and #{num} would both run in {run_dir}: give every job its own "
                "folder (hydra.sweep.subdir, by default the job's number)."
            )
        seen[key] = num
        try:
            if "model" in job and "data" in job:  # a train.py job
                check_job(job, output_dir=run_dir)
                check_run_folder(
                    run_dir,
                    resume=bool(job.get("resume")),
                    ckpt_path=job.get("ckpt_path"),
                    where=f"the job's folder hydra.sweep.dir/{Path(run_dir).name}",
                )
        except ConfigError as err:
            raise ConfigError(f"{job_name(num, job)}: {err}") from err
        except Exception as err:  # a user error of another kind (a checkpoint, a data set): the same line
            from dbsn.runtime.errors import user_errors

            if not isinstance(err, user_errors()):
                raise
            raise ConfigError(f"{job_name(num, job)}: {err}") from err


def refuse(err: BaseException, what: str) -> None:
    """Print a refused sweep's one line and exit with status 2 (a launcher's errors reach Hydra's
    traceback otherwise); HYDRA_FULL_ERROR=1 raises instead."""
    import os

    from dbsn.runtime.errors import one_line

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    line = one_line(err).rstrip()
    print(f"Error: {line}{'' if line.endswith(('.', '!', '?')) else '.'} {what}", file=sys.stderr, flush=True)
    sys.exit(2)
