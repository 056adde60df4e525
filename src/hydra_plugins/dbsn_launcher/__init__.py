"""dbsn's SLURM launcher for Hydra: `python train.py -m hydra/launcher=slurm ...` (conf/hydra/launcher/slurm.yaml).

Hydra only instantiates launchers that live in the `hydra_plugins` namespace, so this thin
subclass of hydra-submitit-launcher's `SlurmLauncher` lives here; the work is in
`dbsn.runtime.cluster`, imported lazily (Hydra imports every plugin module at start-up).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


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

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict) -> Any:
        from dbsn.runtime.cluster import install_preemption_handler, job_overrides_with_resume, limit_threads_to_allocation

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
