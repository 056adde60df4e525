"""dbsn's launchers for Hydra: `python train.py -m ...` runs its jobs one after another on this
machine (`local`, conf/hydra/launcher/local.yaml, the default), `-m hydra/launcher=slurm ...` submits
them to SLURM (conf/hydra/launcher/slurm.yaml). Both compose and check every job, its config and its
run folder, before the first one starts (`dbsn.runtime.sweep`).

Hydra only instantiates launchers that live in the `hydra_plugins` namespace, so these thin
subclasses of Hydra's `BasicLauncher` and hydra-submitit-launcher's `SlurmLauncher` live here; the
work is in `dbsn.runtime`, imported lazily (Hydra imports every plugin module at start-up).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


class DBSNLocalLauncher(BasicLauncher):
    """Hydra's basic launcher (the jobs one after another in this process), after every job's
    config and run folder were checked (`dbsn.runtime.sweep.check_jobs`): one bad job refuses the
    sweep before job 0 trains, and a sweep folder this start made is removed. With
    `runs_per_process` R > 1, consecutive jobs train R at a time, together in this process
    (`dbsn.runtime.group`), each in its own run folder as alone."""

    def __init__(self, runs_per_process: int = 1) -> None:
        super().__init__()
        self.runs_per_process = runs_per_process

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from pathlib import Path

        from dbsn.runtime.config import ConfigError
        from dbsn.runtime.folder import remove_new_sweep_folder
        from dbsn.runtime.group import launch_groups
        from dbsn.runtime.sweep import check_jobs, compose_jobs, job_name, refuse
        from dbsn.runtime.turns import check_group, runs_per_process

        try:
            size = runs_per_process(self.runs_per_process)
            configs, run_dirs = compose_jobs(self, job_overrides, initial_job_idx)
            check_jobs(configs, run_dirs, initial_job_idx)
            if size > 1:
                check_group(configs, run_dirs, [job_name(initial_job_idx + i, c) for i, c in enumerate(configs)])
        except ConfigError as err:
            remove_new_sweep_folder(Path(str(self.config.hydra.sweep.dir)))
            refuse(err, "No job was started.")
        if size > 1:
            return launch_groups(self, job_overrides, initial_job_idx, size, configs)
        return super().launch(job_overrides, initial_job_idx)


class DBSNSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher, plus: every job checked and the SLURM request
    derived from the trainer before submission; all jobs awaited (a failed one does not stop the
    others), failures listed with their logs, the sweep's report built; in the job, `resume=true`
    and the preemption handler that requeues from an epoch's checkpoint."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from dbsn.runtime.cluster import submit_sweep
        from dbsn.runtime.config import ConfigError

        try:
            return submit_sweep(self, job_overrides, initial_job_idx)
        except ConfigError as err:  # the user's input, found before submission: the message, no traceback
            print(f"Error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    def __call__(
        self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str, singleton_state: dict
    ) -> Any:
        from dbsn.runtime.cluster import (
            install_preemption_handler,
            job_overrides_with_resume,
            limit_threads_to_allocation,
        )

        limit_threads_to_allocation()
        delay = float(self.params.get("signal_delay_s") or 0)
        install_preemption_handler(grace_s=max(delay - 30.0, delay / 2))
        overrides = job_overrides_with_resume(sweep_overrides, self.config)
        result = super().__call__(overrides, job_dir_key, job_num, job_id, singleton_state)
        if isinstance(result._return_value, BaseException):
            # Hydra caught the job's exception; raise it so that it is in the job's log with its
            # traceback and SLURM and submitit see the job as failed
            raise result._return_value
        return result
