"""Mistakes a user can make print one line, not a traceback.

The entry points (`train.py` / `dbsn-train`, `evaluate.py` / `dbsn-evaluate`, `report.py` /
`dbsn-report`, `dbsn-compare`, `dbsn-bench`, `refine.py`) run their body under
`one_line_errors`: an error of the kinds `user_errors()` lists, whose messages say what was
wrong and how to fix it, prints `Error: <message>` on stderr and exits with status 2. Every other
exception is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` shows the traceback of these
too.

A run stopped by a signal (`dbsn.runtime.signals.RunInterrupted`) prints `Interrupted: <what
stopped it, where its checkpoint is, how to resume>` and exits with 128 + the signal's number.
"""

from __future__ import annotations

import functools
import os
import sys


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user can fix (imported when needed: the entry points import nothing heavy before
    Hydra has parsed the command line)."""
    from dbsn.data.base import CorruptDatasetError, DatasetNotFoundError
    from dbsn.evaluation.base import EvaluationError
    from dbsn.methods.step import NonFiniteLossError
    from dbsn.methods.temperature import NoValidationSplitError
    from dbsn.posthoc.base import PosthocError
    from dbsn.runtime.checkpoint import CheckpointError
    from dbsn.runtime.config import ConfigError

    return (ConfigError, CheckpointError, DatasetNotFoundError, CorruptDatasetError, NoValidationSplitError,
            NonFiniteLossError, EvaluationError, PosthocError)


def one_line(error: BaseException) -> str:
    """The error's message on one line (its lines joined), without the exception's class."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def one_line_errors(task):
    """Decorate an entry point's body: user errors print one line and exit with status 2; an
    interruption prints one line and exits with 128 + the signal's number."""

    @functools.wraps(task)
    def run(*args, **kwargs):
        from dbsn.runtime.signals import RunInterrupted

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
