"""Progress of an evaluation's loops: a bar on a terminal, plain lines in a log file.

tqdm redraws one line with carriage returns; in a SLURM output file or `nohup.out` the redraws
run together into one long line. `progress` gives tqdm where stderr is a terminal and, elsewhere,
`LineBar`: a line when a loop starts, one at every tenth of it (and at least one every `every_s`
seconds of a slow loop), and one when it ends, each with the count and the time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, TextIO

from tqdm.auto import tqdm

__all__ = ["LineBar", "progress"]


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class LineBar:
    """tqdm's interface (iteration, `update`, a context manager) writing whole lines to `file`."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        total: int | None = None,
        desc: str = "",
        file: TextIO | None = None,
        every_s: float = 60.0,
    ) -> None:
        self.iterable, self.desc, self.file, self.every_s = iterable, desc, file or sys.stderr, every_s
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n = 0
        self._start = self._last = time.perf_counter()
        self._next_tenth = 1
        self._closed = False
        self._say(f"{self.desc}: started" + (f", {self.total} steps" if self.total else ""))

    def _say(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        tenth = self.total and self.n * 10 >= self._next_tenth * self.total and self.n < self.total
        if tenth or now - self._last >= self.every_s:
            if self.total:
                self._next_tenth = self.n * 10 // self.total + 1
            elapsed = now - self._start
            left = f" | left {_duration(elapsed / self.n * (self.total - self.n))}" if self.total else ""
            self._say(
                f"{self.desc}: {self.n}{f'/{self.total}' if self.total else ''} | elapsed {_duration(elapsed)}{left}"
            )
            self._last = now

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._say(f"{self.desc}: done, {self.n} steps in {_duration(time.perf_counter() - self._start)}")

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self) -> LineBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", enabled: bool = True):
    """A progress bar over `iterable` (or one to `update` by hand up to `total`): tqdm on a
    terminal, `LineBar` in a log file, nothing when not `enabled`."""
    if not enabled or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, disable=not enabled)
    return LineBar(iterable, total=total, desc=desc)
