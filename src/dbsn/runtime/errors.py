"""Mistakes a user can make print one line, not a traceback.

The entry points (`train.py` / `dbsn-train`, `evaluate.py` / `dbsn-evaluate`, `report.py` /
`dbsn-report`, `dbsn-compare`, `dbsn-bench`, `refine.py`) run their body under
`one_line_errors`: an error of the kinds `user_errors()` lists, whose messages say what was
wrong and how to fix it, prints `Error: <message>` on stderr and exits with status 2. Every other
exception is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` shows the traceback of these
too.

A run whose files cannot be written (a full, read-only or failing disk) stops with `OutputError`,
one line of the same kind, saying what is intact and how to continue.

A run stopped by a signal (`RunInterrupted`, raised by `dbsn.runtime.signals`) prints
`Interrupted: <what stopped it, where its checkpoint is, how to resume>` and exits with 128 + the
signal's number.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path


class RunInterrupted(BaseException):
    """A run stopped by a signal. Like KeyboardInterrupt, not an `Exception`: nothing that handles
    errors (a sweep that goes on after a failed run) may swallow it.

    Attributes:
        signum: the signal's number; `exit_status` is 128 + signum, as a shell reports a process
            the signal killed.
        checkpoint: the run's last epoch-end checkpoint, what `resume=true` continues from (None:
            none was written yet, or the run writes none, as an evaluation).
        epochs_done: the epochs that checkpoint holds (None where unknown).
        max_epochs: the epochs the run trains (None where unknown).
        epoch: the epoch (from 1) in progress at the signal (None: not training).
        run_dir: the run folder.
    """

    def __init__(
        self,
        signum: int,
        run_dir: Path | None = None,
        checkpoint: Path | None = None,
        epochs_done: int | None = None,
        max_epochs: int | None = None,
        epoch: int | None = None,
    ) -> None:
        self.signum, self.run_dir, self.checkpoint, self.epochs_done = int(signum), run_dir, checkpoint, epochs_done
        self.max_epochs, self.epoch = max_epochs, epoch
        super().__init__(self._message())

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def _message(self) -> str:
        stopped = f"Stopped by {self.signal_name}"
        if self.run_dir is None:
            return f"{stopped} before the evaluation finished: run the same command again."
        resume = f"run the same command plus resume=true hydra.run.dir={self.run_dir}"
        if self.checkpoint is None:
            return f"{stopped} before the run's first checkpoint: to continue, {resume} (it starts from the beginning)."
        if self.epochs_done is None:
            return f"{stopped}: to continue from {self.checkpoint}, {resume}."
        if self.max_epochs and self.epochs_done >= self.max_epochs:
            return (
                f"{stopped} after training: {self.checkpoint} holds all {self.epochs_done} epochs; to finish, {resume} "
                "(it tests the model without training)."
            )
        of = f" of {self.max_epochs}" if self.max_epochs else ""
        redone = self.epochs_done + 1
        return (
            f"{stopped} in epoch {self.epoch or redone}{of}: {self.checkpoint} holds the first {self.epochs_done} "
            f"epoch{'' if self.epochs_done == 1 else 's'}; to continue, {resume} (from the start of epoch {redone}, "
            "as an uninterrupted run would)."
        )


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user can fix (imported when needed: the entry points import nothing heavy before
    Hydra has parsed the command line)."""
    from hydra.errors import ConfigCompositionException  # a tool's compose of a mistaken override

    from dbsn.data.base import CorruptDatasetError, DatasetNotFoundError
    from dbsn.evaluation.base import EvaluationError
    from dbsn.extensions import ExtensionError
    from dbsn.methods.step import NonFiniteLossError
    from dbsn.methods.temperature import NoValidationSplitError
    from dbsn.posthoc.base import PosthocError
    from dbsn.runtime.checkpoint import CheckpointError
    from dbsn.runtime.config import ConfigError
    from dbsn.runtime.disk import OutputError

    return (
        ConfigError,
        CheckpointError,
        DatasetNotFoundError,
        CorruptDatasetError,
        NoValidationSplitError,
        NonFiniteLossError,
        EvaluationError,
        PosthocError,
        OutputError,
        ExtensionError,
        ConfigCompositionException,
    )


def one_line(error: BaseException) -> str:
    """The error's message on one line (its lines joined), without the exception's class."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def one_line_errors(task):
    """Decorate an entry point's body: user errors print one line and exit with status 2; an
    interruption prints one line and exits with 128 + the signal's number."""

    @functools.wraps(task)
    def run(*args, **kwargs):
        try:
            return task(*args, **kwargs)
        except RunInterrupted as stop:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            try:
                print(f"Interrupted: {one_line(stop)}", file=sys.stderr, flush=True)
            except OSError:  # the terminal is gone (SIGHUP)
                pass
            sys.exit(stop.exit_status)
        except Exception as error:
            if not isinstance(error, user_errors()) or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"Error: {one_line(error)}", file=sys.stderr, flush=True)
            sys.exit(2)

    return run
