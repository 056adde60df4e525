"""Signals that stop a run are reported as what they are: an interruption, with a non-zero exit status.

What each signal does while `train` (or `evaluate`) runs under `interruptible`:

- SIGTERM (a scheduler, `kill`, `scancel`, SLURM's time limit), SIGINT (Ctrl-C) and SIGHUP (the
  terminal closed; left alone when ignored at start, as under `nohup`) stop the run: in a
  Lightning loop at the end of the batch in progress (under DDP on every rank together, through
  Lightning's SIGTERM flag that rank 0 broadcasts each step), anywhere else at once. A second
  signal stops at once. `RunInterrupted` then leaves `train`; the entry points print its one line
  and exit with 128 + the signal's number (143, 130, 129).
- Several runs in one process (`dbsn.runtime.group`), a thread each: handlers belong to the main
  thread, so the group installs its own there and asks every run under way (`live_runs`) to stop
  the same way (`Interruptions.request`); each thread knows its own run (`current_watch`).
- SIGUSR1 is left to Lightning (its SLURM auto-requeue) or to its default.
- SIGUSR2 is submitit's preemption signal: `dbsn.runtime.cluster.PreemptionRequeue` finishes the
  epoch and requeues; the SIGTERM that SLURM then sends is expected, not an interruption.

No checkpoint is written at the signal: the run rolls back to its last epoch-end checkpoint, which
`resume=true` continues bit for bit (a mid-epoch checkpoint could not: Lightning does not restore
the loader's position, the epoch's accumulators or the random state mid-epoch). At most the epoch
in progress is lost; no file of the run depends on when the process stops after its last
checkpoint, so the disk holds the same bytes as after a `kill -9` at that moment.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path
from types import FrameType

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from dbsn.evaluation.runs import last_checkpoint
from dbsn.runtime.errors import RunInterrupted

__all__ = ["INTERRUPTING", "RunInterrupted", "SignalWatch", "interruptible", "live_runs", "requeueing"]

#: the signals that stop a run, with what usually sends them
INTERRUPTING = {signal.SIGTERM: "a scheduler or kill", signal.SIGINT: "Ctrl-C", signal.SIGHUP: "the terminal closed"}


def _epochs_in(path: Path) -> int | None:
    """How many epochs a checkpoint holds (its 0-based `epoch` + 1), read without its tensors."""
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return int(checkpoint["epoch"]) + 1
    except Exception:  # noqa: BLE001 - a message detail: unknown rather than a second fault
        return None


class SignalWatch(pl.Callback):
    """Knows the trainer while a Lightning loop runs, so that a signal there ends the batch in
    progress first: it keeps Lightning's stop flag set after every batch and at every loop start
    (Lightning clears the flag when a loop starts; its loops check it after each batch, and under DDP
    rank 0 broadcasts it before each training step), and stops at the end of a loop that finished
    without checking it (a signal during the last batch).

    When a loop starts it takes SIGTERM back from Lightning, whose handler broadcasts to the other
    ranks from inside the handler: a rank signalled while the others wait in a collective of the
    step would then wait forever. Here the handler only sets the flag (and passes SIGTERM on to the
    ranks this process started, as Lightning's does); the ranks meet at the next step's broadcast."""

    def __init__(self, interruptions: Interruptions) -> None:
        self.interruptions = interruptions
        self.trainer: pl.Trainer | None = None
        self.max_epochs: int | None = None

    def _flag(self, trainer) -> None:
        if self.interruptions.signum is not None and hasattr(trainer, "_signal_connector"):
            trainer._signal_connector.received_sigterm = True

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.trainer = trainer
        if stage == "fit" and trainer.max_epochs and trainer.max_epochs > 0:
            self.max_epochs = trainer.max_epochs

    def _take_sigterm(self) -> None:
        if threading.current_thread() is threading.main_thread() and signal.SIGTERM in self.interruptions.installed:
            signal.signal(signal.SIGTERM, self.interruptions.handle)  # Lightning puts its own back at the loop's end

    def on_train_start(self, trainer, pl_module) -> None:
        self._take_sigterm()
        self._flag(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._take_sigterm()
        self._flag(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._take_sigterm()
        self._flag(trainer)

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        self._flag(trainer)

    def on_validation_batch_end(self, trainer, *args, **kwargs) -> None:
        self._flag(trainer)

    def on_test_batch_end(self, trainer, *args, **kwargs) -> None:
        self._flag(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._flag(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.trainer = None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.trainer = None  # a loop that ended normally: Lightning calls teardown only then
        if self.interruptions.signum is not None:
            raise self.interruptions.interrupted()


class _State:
    leaving = False  # set while submitit requeues: the SIGTERM SLURM then sends is expected


_STATE = _State()


class requeueing:
    """While a requeue is under way (`dbsn.runtime.cluster`), signals are not interruptions: the
    process is leaving and will be started again. On a normal exit (submitit's handler returns on
    ranks other than 0, which go on) signals count again."""

    def __enter__(self) -> None:
        _STATE.leaving = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            _STATE.leaving = False


class Interruptions:
    """Installs the handlers of `INTERRUPTING` for the duration of a run (see the module docstring).

    Args:
        run_dir: the run folder whose `last.ckpt` a resume continues from (None: an evaluation,
            nothing to resume).
    """

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.watch = SignalWatch(self)
        self.signum: int | None = None
        self.epoch: int | None = None  # the epoch (from 1) training was in at the signal
        self._previous: dict[int, object] = {}

    @property
    def installed(self) -> set[int]:
        """The signals whose handler this is (not those ignored at the start)."""
        return set(self._previous)

    def interrupted(self, signum: int | None = None) -> RunInterrupted:
        signum = signum or self.signum or signal.SIGTERM
        checkpoint = None if self.run_dir is None else last_checkpoint(self.run_dir)
        if checkpoint is None or not checkpoint.is_file():
            return RunInterrupted(signum, self.run_dir, None)
        return RunInterrupted(
            signum, self.run_dir, checkpoint, _epochs_in(checkpoint), self.watch.max_epochs, self.epoch
        )

    def _say(self, text: str) -> None:
        try:  # not print(): the signal may have interrupted a write to the same stream
            os.write(2, (text + "\n").encode())
        except OSError:  # the terminal is gone (SIGHUP)
            pass

    def request(self, signum: int) -> None:
        """Ask the run to stop without raising here: from another thread (the signal handler of a group of
        runs in one process, `dbsn.runtime.group`). It stops at the end of the batch in progress, or at
        the start of its next Lightning loop, as a first signal does."""
        self.signum = self.signum or signum
        trainer = self.watch.trainer
        if self.epoch is None and trainer is not None and trainer.training:
            self.epoch = trainer.current_epoch + 1
        if trainer is not None and hasattr(trainer, "_signal_connector"):
            trainer._signal_connector.received_sigterm = True

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if _STATE.leaving:
            return
        trainer = self.watch.trainer
        if self.epoch is None and trainer is not None and trainer.training:
            self.epoch = trainer.current_epoch + 1
        if trainer is not None and hasattr(trainer, "_signal_connector"):
            if self.signum is None:
                self.signum = signum
                # Lightning's loops check this flag after every batch (under DDP rank 0 broadcasts it) and raise
                # SIGTERMException; `__exit__` turns that into RunInterrupted.
                trainer._signal_connector.received_sigterm = True
                launcher = getattr(trainer.strategy, "launcher", None)
                if signum == signal.SIGTERM and getattr(launcher, "procs", None):
                    launcher.kill(signum)  # the DDP ranks this process started (a terminal's signals reach them itself)
                if trainer.global_rank == 0:
                    self._say(f"{signal.Signals(signum).name} received: stopping after this batch (again: at once).")
                return
            if trainer.global_rank != 0:
                return  # a DDP rank stops with rank 0, at the step they share: a repeat is the same stop
        self.signum = self.signum or signum
        raise self.interrupted(signum)

    def __enter__(self) -> Interruptions:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers belong to the main thread; elsewhere the defaults stay
        for signum in INTERRUPTING:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:  # nohup, or a background job: the user asked to ignore it
                continue
            self._previous[signum] = previous
            signal.signal(signum, self.handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if isinstance(exc, SIGTERMException):
            raise self.interrupted() from None


def interruptible(task=None, *, resumable: bool = True):
    """Decorate a run's body `task(cfg, output_dir, ...)`: signals stop it as `RunInterrupted` (see
    the module docstring). `resumable`: a training run, resumed from `<output_dir>/checkpoints/last.ckpt`;
    else an evaluation, started again. The body adds `current_watch()` to its trainer's callbacks
    so that a signal inside a Lightning loop ends the batch first."""
    if task is None:
        return functools.partial(interruptible, resumable=resumable)

    @functools.wraps(task)
    def run(cfg, output_dir, *args, **kwargs):
        interruptions = Interruptions(Path(output_dir) if resumable else None)
        outer = getattr(_CURRENT, "run", None)
        _CURRENT.run = interruptions
        _LIVE.append(interruptions)
        try:
            with interruptions:
                return task(cfg, output_dir, *args, **kwargs)
        finally:
            _CURRENT.run = outer
            _LIVE.remove(interruptions)

    return run


#: the run under way in each thread (several runs of a group share one process, a thread each)
_CURRENT = threading.local()
#: every run under way in this process, in the order they started
_LIVE: list[Interruptions] = []


def current_watch() -> list[pl.Callback]:
    """The callback of this thread's run under way (`interruptible`), as a list to add to a trainer's
    callbacks ([] outside one)."""
    current = getattr(_CURRENT, "run", None)
    return [] if current is None else [current.watch]


def live_runs() -> list[Interruptions]:
    """The runs under way in this process (`interruptible`), each thread's; a group's signal handler asks
    each of them to stop (`Interruptions.request`)."""
    return list(_LIVE)
