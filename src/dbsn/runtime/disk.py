"""A run's files that cannot be written: `OutputError` says so in one line.

Below every other runtime module (it imports none), so that the checkpoint writer, the run and
the entry points' error handling (`dbsn.runtime.errors`) can all use it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["OutputError", "disk_problem"]


class OutputError(RuntimeError):
    """The run's files could not be written: a full, read-only or failing disk. The message names
    the file and the disk's state, and says what is intact and how to continue."""


#: what an OSError's errno says about the disk it wrote to
_DISK_PROBLEMS = {
    28: "the disk is full",
    122: "the disk quota is exceeded",
    30: "the file system is read-only",
    5: "the disk reported an input/output error",
}


def disk_problem(error: BaseException, folder: Path) -> str | None:
    """Why writing into `folder` failed, in words, where the disk is to blame: an OSError of a full,
    read-only or failing disk, or (torch's zip writer reports a failed write as a RuntimeError) any
    failed write into a folder whose disk has less than 1 MiB free; None otherwise."""
    errno = getattr(error, "errno", None)
    if isinstance(error, OSError) and errno in _DISK_PROBLEMS:
        return _DISK_PROBLEMS[errno]
    if isinstance(error, (OSError, RuntimeError)):
        try:
            stats = os.statvfs(next(p for p in (Path(folder), *Path(folder).parents) if p.exists()))
        except (OSError, StopIteration):
            return None
        if stats.f_bavail * stats.f_frsize < 2**20:
            return f"the disk is full ({stats.f_bavail * stats.f_frsize:,} bytes free)"
    return None
