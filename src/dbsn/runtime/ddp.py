"""Single-node multi-device DDP that plays well with Hydra.

Lightning's default DDP launcher starts ranks 1..N-1 by re-running `sys.argv`. Under Hydra that
re-runs the command line, which (a) in a multirun (`-m seed=1,2,3`) starts a whole new sweep in
every child and (b) makes extra output folders. Here rank 0 writes the resolved run config to
its output folder and starts each child as `python -m dbsn.runtime.child <config> <output dir>`: the
children run the same `dbsn.runtime.run.train` on the same config and folder, and never touch Hydra.

When processes are created externally (SLURM, torchrun), Lightning does not launch children and
this launcher is not involved: there, give every task the same `hydra.run.dir`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from dbsn.evaluation.runs import CONFIG_FILE


class _ConfigFileLauncher(_SubprocessScriptLauncher):
    def __init__(self, *args, run_dir: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run_dir = run_dir

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            NODE_RANK=str(env.node_rank()),
            LOCAL_RANK=str(env.local_rank()),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        command = [sys.executable, "-m", "dbsn.runtime.child", str(self.run_dir / CONFIG_FILE), str(self.run_dir)]
        for local_rank in range(1, self.num_processes):
            child_env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            self.procs.append(subprocess.Popen(command, env=child_env))

    def launch(self, function, *args, trainer=None, **kwargs):
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _launch_process_observer(self.procs)
        return function(*args, **kwargs)


class RunDirDDPStrategy(DDPStrategy):
    """DDP whose child processes are started from the saved run config (see module docstring)."""

    def __init__(self, run_dir: str | Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run_dir = Path(run_dir)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = _ConfigFileLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, run_dir=self.run_dir
            )
