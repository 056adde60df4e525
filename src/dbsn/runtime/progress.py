"""Progress for logs that are not a terminal (SLURM output files, `nohup`, CI).

A progress bar redraws one line with carriage returns; in a file that leaves either nothing
readable or megabytes of half-lines. When stdout is not a terminal, the runtime replaces the
configured bar by `LineProgress`: a plain line at the end of every epoch, and every `every_s`
seconds within long epochs, with the step, the loss, the throughput and the time left; in a test
pass (which can run for hours at a large S), a line when it starts, every `every_s` seconds with
the batches done and the time left, and when it ends.
"""

from __future__ import annotations

import time
from datetime import timedelta

from lightning.pytorch.callbacks import ProgressBar


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class LineProgress(ProgressBar):
    """One line per epoch (and every `every_s` seconds inside an epoch):

    `epoch 3/100 | step 1200/39000 | train/loss 0.512 | 310 img/s | elapsed 0:12:03 | left 7:50:10`

    Throughput and time left are measured over the steps of this process (a resumed run does
    not count the time before its restart)."""

    def __init__(self, every_s: float = 300.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._enabled = True
        self._start = self._last = 0.0
        self._first_step = 0
        self._examples = 0
        self._test_start = self._test_last = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = self._last = time.monotonic()
        self._first_step, self._examples = _batches_done(trainer), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._examples += _batch_size(batch)
        if time.monotonic() - self._last >= self.every_s:
            self.print_line(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.print_line(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._test_start = self._test_last = time.monotonic()
        if self._enabled:
            members = getattr(pl_module, "num_members", None)
            print(
                f"test: {_test_batches(trainer)} batches" + (f", S = {members} members each" if members else ""),
                flush=True,
            )

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        now = time.monotonic()
        if now - self._test_last >= self.every_s:
            self._test_last = now
            if self._enabled:
                print(self.test_line(trainer, batch_idx + 1, now), flush=True)

    def test_line(self, trainer, done: int, now: float) -> str:
        """`test: batch 120/450 | elapsed 0:05:00 | left 0:13:45`"""
        total, elapsed = _test_batches(trainer), now - self._test_start
        left = f" | left {_duration(elapsed / done * max(total - done, 0))}" if done and total else ""
        return f"test: batch {done}/{total} | elapsed {_duration(elapsed)}{left}"

    def on_test_end(self, trainer, pl_module) -> None:
        if self._enabled:
            elapsed = _duration(time.monotonic() - self._test_start)
            print(f"test: {_test_batches(trainer)} batches done in {elapsed}", flush=True)

    def line(self, trainer) -> str:
        now = time.monotonic()
        done = _batches_done(trainer)
        elapsed, steps = now - self._start, done - self._first_step
        total = _batches_total(trainer)
        parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"]
        parts.append(f"step {done}" + (f"/{int(total)}" if total != float("inf") else ""))
        metrics = trainer.progress_bar_metrics
        loss = metrics.get("train/loss_step", metrics.get("train/loss"))
        if loss is not None:
            parts.append(f"train/loss {float(loss):.4g}")
        if elapsed > 0 and self._examples:
            parts.append(f"{self._examples / elapsed:.0f} img/s")
        parts.append(f"elapsed {_duration(elapsed)}")
        if steps > 0 and total != float("inf"):
            parts.append(f"left {_duration(elapsed / steps * max(total - done, 0))}")
        return " | ".join(parts)

    def print_line(self, trainer) -> None:
        self._last = time.monotonic()
        if self._enabled:
            print(self.line(trainer), flush=True)


def _batches_done(trainer) -> int:
    """Training batches done over all epochs (a step here is a batch: methods that step two
    optimisers per batch count it once), resumed epochs included."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.completed)


def _batches_total(trainer) -> float:
    if trainer.max_epochs is None or trainer.max_epochs < 0 or trainer.num_training_batches == float("inf"):
        return float("inf")
    total = trainer.num_training_batches * trainer.max_epochs
    return min(total, trainer.max_steps) if trainer.max_steps and trainer.max_steps > 0 else total


def _test_batches(trainer) -> int:
    return int(sum(trainer.num_test_batches)) if trainer.num_test_batches else 0


def _batch_size(batch) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(getattr(first, "shape", [0])[0]) if hasattr(first, "shape") else 0
