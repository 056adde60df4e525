"""A callback that sends this process a signal at a chosen point of a run, for the fault-injection
tests (`+callbacks.signal._target_=tests.support.fault_probe.SignalAt`, or added in process)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl


class SignalAt(pl.Callback):
    """`os.kill(own pid, signum)` when batch `batch` of epoch `epoch` (both from 0) of `stage`
    ("train" or "test") starts, `times` times in a row. With `once_file`, only in a process that
    finds no such file (it is created): a resumed run is not signalled again."""

    def __init__(
        self,
        signum: int | str = "SIGTERM",
        epoch: int = 0,
        batch: int = 0,
        stage: str = "train",
        times: int = 1,
        once_file: str | None = None,
    ) -> None:
        self.signum = getattr(signal, signum) if isinstance(signum, str) else signal.Signals(signum)
        self.epoch, self.batch, self.stage, self.times = epoch, batch, stage, times
        self.once_file = None if once_file is None else Path(once_file)
        self.sent = 0

    def _maybe_send(self, trainer, batch_idx: int) -> None:
        if self.sent or batch_idx != self.batch or (self.stage == "train" and trainer.current_epoch != self.epoch):
            return
        if self.once_file is not None:
            if self.once_file.exists():
                return
            self.once_file.touch()
        for _ in range(self.times):
            self.sent += 1
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.stage == "train":
            self._maybe_send(trainer, batch_idx)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.stage == "test":
            self._maybe_send(trainer, batch_idx)
