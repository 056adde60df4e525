"""Several training runs in one process: `train_group(cfgs, output_dirs)`, and a sweep's jobs in
groups of R with `python train.py -m seed=0,1,2,3 hydra.launcher.runs_per_process=4`.

Off by default (`hydra.launcher.runs_per_process: 1`): one run per process, as before. What a group
is for: on one GPU, the paper's step leaves the device mostly idle between small kernels, and R
independent runs (the paper's seeds) can fill it together. Each run is `dbsn.runtime.run.train`
as it is, on its own thread, in its own run folder; on CUDA each thread's current stream is a
stream of its own, so its kernels (and its CUDA graph's replays) go there and may overlap with
the other runs' while the host moves on. docs/performance.md has what this gained on a GPU.

**Each run equals its solo run.** The runs take turns: exactly one run's Python runs at a time,
and a run hands the turn to the next at the end of each training batch (`TurnCallback`, in
every run's trainer through `turn_callbacks`), or when it ends, error or not. At every hand-over
the process-wide state a run reads is saved for the run that leaves and put back for the one
that arrives (`ProcessState`): the random generators (torch's CPU generator, NumPy's, Python's
`random`, and on CUDA each device's default generator), the environment variables (Lightning's
`PL_GLOBAL_SEED`, Hydra's `env_set`), the working directory, Hydra's config singleton (`.hydra/`
files, `origin_of`, the log file's name) and the root logger's handlers (each run's `train.log`).
So every run draws exactly its own random stream and does the same operations as alone, and on
the CPU it ends bit for bit where its solo run ends (a test compares the metrics and the final
weights). Which run signals reach: `dbsn.runtime.signals` keeps the run under way per thread.

On CUDA the default generator is switched by its state object (`graphsafe_set_state`), not by
copying seed and offset: a CUDA graph captured by a run then holds that run's own generator
state, and its replays advance that run's offset only. Not covered, and not testable on a CPU:
whether a run's graph replays on its own stream overlap in a real training (a run that
synchronises its stream while it holds the turn, to read its loss, lets the others launch only
after), and whether the graph-safe generator states give each run its solo random numbers on a
GPU (they should; a GPU test must compare one run of a group with its solo run). The peak memory a
run reports (`reset_peak_memory`) is the group's, the device's.

Signals: handlers belong to the main thread, so a group installs its own there (`_Relay`):
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
import os
import random
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from omegaconf import DictConfig

from dbsn.runtime.config import ConfigError
from dbsn.runtime.errors import RunInterrupted

__all__ = [
    "Outcome",
    "ProcessState",
    "TurnCallback",
    "Turns",
    "check_group",
    "run_group",
    "runs_per_process",
    "train_group",
    "turn_callbacks",
]


# ---------------------------------------------------------------------- what a run reads of the process
def _cuda_generators() -> list[torch.Generator]:
    """Each device's default CUDA generator, where CUDA is initialised (never initialises it)."""
    return list(torch.cuda.default_generators) if torch.cuda.is_initialized() else []


@dataclass
class ProcessState:
    """The process-wide state a run reads, saved for a run when it hands over its turn and put back
    when it gets the turn again (see the module docstring)."""

    torch_rng: torch.Tensor
    cuda_rng: list[torch.Generator]  # the default generators' state objects (graph-safe), one per device
    numpy_rng: Any
    python_rng: Any
    environ: dict[str, str]
    cwd: str
    hydra: Any
    log_handlers: list[logging.Handler]
    log_level: int

    @classmethod
    def capture(cls) -> ProcessState:
        from hydra.core.hydra_config import HydraConfig

        root = logging.getLogger()
        return cls(
            torch_rng=torch.get_rng_state(),
            cuda_rng=[g.graphsafe_get_state() for g in _cuda_generators()],
            numpy_rng=np.random.get_state(),
            python_rng=random.getstate(),
            environ=dict(os.environ),
            cwd=os.getcwd(),
            hydra=HydraConfig.instance().cfg,
            log_handlers=list(root.handlers),
            log_level=root.level,
        )

    def for_a_run(self) -> ProcessState:
        """A copy a new run starts from: the same values, and CUDA generator states of its own (each
        run's graphs must hold its own state, `graphsafe_set_state`)."""
        return ProcessState(
            **{**self.__dict__, "cuda_rng": [g.clone_state() for g in self.cuda_rng], "environ": dict(self.environ)}
        )

    def restore(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        torch.set_rng_state(self.torch_rng)
        for generator, state in zip(_cuda_generators(), self.cuda_rng):
            generator.graphsafe_set_state(state)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        for key in [k for k in os.environ if k not in self.environ]:
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        HydraConfig.instance().cfg = self.hydra
        root = logging.getLogger()
        root.handlers[:] = self.log_handlers
        root.setLevel(self.log_level)


# ---------------------------------------------------------------------- taking turns
class Turns:
    """Round-robin turns among `count` runs, each on its own thread: `begin(i)` waits for run i's
    first turn, `pass_on(i)` hands the turn to the next run in the rotation and waits for it to
    come back, `end(i)` takes run i out of the rotation. Run i's `ProcessState` is saved when it
    hands over and put back when the turn comes back. `order`: which run had each turn (a test
    reads it)."""

    def __init__(self, count: int, start: ProcessState) -> None:
        self._cond = threading.Condition()
        self._rotation = list(range(count))
        self._holder: int | None = 0 if count else None
        self._states = [start.for_a_run() for _ in range(count)]
        self.order: list[int] = []

    def _arrive(self, run: int) -> None:
        self._cond.wait_for(lambda: self._holder == run)
        self._states[run].restore()
        self.order.append(run)

    def begin(self, run: int) -> None:
        with self._cond:
            self._arrive(run)

    def pass_on(self, run: int) -> None:
        with self._cond:
            following = self._rotation[(self._rotation.index(run) + 1) % len(self._rotation)]
            if following == run:  # the last run still going: nothing to hand over
                return
            self._states[run] = ProcessState.capture()
            self._holder = following
            self._cond.notify_all()
            self._arrive(run)

    def end(self, run: int) -> None:
        with self._cond:
            if run not in self._rotation:
                return
            at = self._rotation.index(run)
            self._rotation.remove(run)
            if self._holder == run:
                self._holder = self._rotation[at % len(self._rotation)] if self._rotation else None
            self._cond.notify_all()


class TurnCallback(pl.Callback):
    """Hands the turn to the next run of the group at the end of every training batch."""

    def __init__(self, turns: Turns, run: int) -> None:
        self.turns, self.run = turns, run

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.turns.pass_on(self.run)


_THREAD = threading.local()  # the group and run index of a run's thread


def turn_callbacks() -> list[pl.Callback]:
    """`TurnCallback` for this thread's run of a group, as a list to add to a trainer's callbacks
    ([] outside a group)."""
    turn = getattr(_THREAD, "turn", None)
    return [] if turn is None else [TurnCallback(*turn)]


# ---------------------------------------------------------------------- signals
class _Relay:
    """The group's handlers of `dbsn.runtime.signals.INTERRUPTING` in the main thread (see the module
    docstring); outside the main thread nothing is installed, as for a run alone."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def handle(self, signum: int, frame) -> None:
        from dbsn.runtime.signals import _STATE, live_runs

        if _STATE.leaving:
            return
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"{name} again: the group of runs stops at once.\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        try:
            os.write(2, f"{name} received: every run of the group stops after its batch (again: at once).\n".encode())
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        for run in live_runs():
            run.request(signum)

    def __enter__(self) -> _Relay:
        from dbsn.runtime.signals import INTERRUPTING

        if threading.current_thread() is threading.main_thread():
            for signum in INTERRUPTING:
                previous = signal.getsignal(signum)
                if previous != signal.SIG_IGN:  # nohup: the user asked to ignore it
                    self._previous[signum] = previous
                    signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


# ---------------------------------------------------------------------- running a group
@dataclass
class Outcome:
    """What one run of a group returned, or the exception that ended it."""

    value: Any = None
    error: BaseException | None = None


def run_group(tasks: Sequence[Callable[[], Any]], *, cuda: bool = False, turns: list | None = None) -> list[Outcome]:
    """Run `tasks` (each one run, e.g. `train` on its config and folder) together in this process, a
    thread each, taking turns (see the module docstring); returns when every one has ended, one
    `Outcome` each, in order. `cuda`: give each run a CUDA stream of its own. `turns`: a list that
    receives which run had each turn."""
    if cuda:
        torch.cuda.init()  # before the state is captured: every run then gets CUDA generator states of its own
    start = ProcessState.capture()
    schedule = Turns(len(tasks), start)
    streams = [torch.cuda.Stream() for _ in tasks] if cuda else [None] * len(tasks)
    outcomes = [Outcome() for _ in tasks]

    def body(run: int) -> None:
        _THREAD.turn = (schedule, run)
        try:
            schedule.begin(run)
            if relay.signum is not None:  # stopped before it started
                raise RunInterrupted(relay.signum)
            with torch.cuda.stream(streams[run]) if streams[run] is not None else nullcontext():
                outcomes[run].value = tasks[run]()
        except BaseException as err:  # noqa: BLE001 - kept for the caller; the other runs go on
            outcomes[run].error = err
        finally:
            _THREAD.turn = None
            schedule.end(run)

    # daemon threads: a second signal ends the process without waiting for them
    threads = [threading.Thread(target=body, args=(i,), name=f"dbsn-run-{i}", daemon=True) for i in range(len(tasks))]
    with _Relay() as relay:
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            if cuda:
                torch.cuda.synchronize()
            start.restore()
    if turns is not None:
        turns.extend(schedule.order)
    return outcomes


def runs_per_process(value: Any, where: str = "hydra.launcher.runs_per_process") -> int:
    """R, checked: a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{where}={value}: the number of runs that train together in one process must be a whole number "
            "of at least 1 (1: one run per process, the default; e.g. 4 for four seeds on one GPU)."
        )
    return value


def check_group(cfgs: Sequence[DictConfig], output_dirs: Sequence[Path], names: Sequence[str] | None = None) -> None:
    """Refuse, in one line, a group its runs cannot share one process in: DDP or several nodes, two
    runs in one folder. `names`: how a message names each run (a sweep's job)."""
    from dbsn.runtime.build import num_devices

    names = list(names) if names is not None else [f"run #{i} of the group" for i in range(len(cfgs))]
    if len(cfgs) != len(output_dirs):
        raise ConfigError(
            f"a group of runs needs one folder per config: {len(cfgs)} configs, {len(output_dirs)} folders."
        )
    seen: dict[Path, str] = {}
    for cfg, folder, name in zip(cfgs, output_dirs, names):
        trainer = cfg.get("trainer") or {}
        try:
            devices = num_devices(trainer.get("devices", 1), str(trainer.get("accelerator", "auto")))
        except (TypeError, ValueError):
            devices = 1
        nodes = int(trainer.get("num_nodes", 1) or 1)
        strategy = str(trainer.get("strategy", "auto"))
        if devices > 1 or nodes > 1 or "ddp" in strategy:
            raise ConfigError(
                f"{name}: trainer.devices={trainer.get('devices', 1)}, trainer.num_nodes={nodes}, "
                f"trainer.strategy={strategy}: several runs in one process train on one device each; DDP runs "
                "one per process (leave hydra.launcher.runs_per_process=1, or trainer.devices=1)."
            )
        key = Path(folder).absolute()
        if key in seen:
            raise ConfigError(f"{seen[key]} and {name} would both run in {folder}: give every run its own folder.")
        seen[key] = name


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
