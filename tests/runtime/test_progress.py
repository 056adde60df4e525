"""Progress lines without a terminal (dbsn.runtime.progress.LineProgress): step, loss, throughput
and time left.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from dbsn.runtime.progress import LineProgress


def _trainer(done: int, epoch: int, loss: float | None = 2.5):
    progress = SimpleNamespace(total=SimpleNamespace(completed=done))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                           num_training_batches=10, max_epochs=5, max_steps=-1, current_epoch=epoch,
                           progress_bar_metrics={} if loss is None else {"train/loss_step": loss})


def test_progress_lines_give_step_loss_throughput_and_time_left(monkeypatch, capsys):
    clock = iter([100.0, 100.0, 110.0, 110.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    progress = LineProgress(every_s=300)
    progress.on_train_start(_trainer(10, 1), None)  # resumed after one epoch of 10 batches
    progress._examples = 640
    progress.print_line(_trainer(20, 1))  # 10 batches in 10 s; 30 left
    assert capsys.readouterr().out.strip() == \
        "epoch 2/5 | step 20/50 | train/loss 2.5 | 64 img/s | elapsed 0:00:10 | left 0:00:30"
    progress.disable()
    progress.print_line(_trainer(20, 1))
    assert capsys.readouterr().out == ""  # ranks other than 0
