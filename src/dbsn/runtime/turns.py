"""How the runs of a group take turns in one process (`dbsn.runtime.group` says what a group is and
why each run equals its solo run): `run_group` runs tasks a thread each, one at a time, handing the
turn over at the end of every training batch (`TurnCallback`) and swapping the process-wide state a
run reads (`ProcessState`); `_Relay` passes a signal on to every run. `runs_per_process` and
`check_group` refuse what a group cannot run, in one line. Nothing here imports the run itself
(`dbsn.runtime.run` adds `turn_callbacks()` to its trainer's callbacks).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import warnings
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
    "turn_callbacks",
]


# ---------------------------------------------------------------------- what a run reads of the process
def _cuda_generators() -> list[torch.Generator]:
    """Each device's default CUDA generator, where CUDA is initialised (never initialises it)."""
    return list(torch.cuda.default_generators) if torch.cuda.is_initialized() else []


def _switches() -> tuple:
    """torch's process-wide switches that a run's Trainer (``benchmark``, ``deterministic``), its
    precision or its method may set: cuDNN's benchmark and determinism, deterministic algorithms
    (and warn-only), the float32 matmul precision, the default dtype."""
    return (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        torch.get_default_dtype(),
    )


def _set_switches(switches: tuple) -> None:
    benchmark, cudnn_deterministic, deterministic, warn_only, matmul, dtype = switches
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.deterministic = cudnn_deterministic
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_float32_matmul_precision(matmul)
    torch.set_default_dtype(dtype)


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
    switches: tuple  # torch's global switches a Trainer or a method sets (`_switches`)
    warning_filters: list

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
            switches=_switches(),
            warning_filters=list(warnings.filters),
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
        _set_switches(self.switches)
        warnings.filters[:] = self.warning_filters


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
        logger = str((cfg.get("logger") or {}).get("wandb", {}).get("_target_", "")) if cfg.get("logger") else ""
        if "Wandb" in logger:
            raise ConfigError(
                f"{name}: logger=wandb: W&B keeps one run per process (a second wandb.init finishes the first), so "
                "grouped runs cannot each log to their own; use logger=csv (the default) in a group, or leave "
                "hydra.launcher.runs_per_process=1."
            )
        key = Path(folder).absolute()
        if key in seen:
            raise ConfigError(f"{seen[key]} and {name} would both run in {folder}: give every run its own folder.")
        seen[key] = name
