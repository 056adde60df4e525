"""Progress lines without a terminal (dbsn.runtime.progress.LineProgress): step, loss, throughput
and time left.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from dbsn.runtime.progress import LineProgress


def _trainer(done: int, epoch: int, loss: float | None = 2.5):
    progress = SimpleNamespace(total=SimpleNamespace(completed=done))
    return SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        num_training_batches=10,
        max_epochs=5,
        max_steps=-1,
        current_epoch=epoch,
        progress_bar_metrics={} if loss is None else {"train/loss_step": loss},
    )


def test_progress_lines_give_step_loss_throughput_and_time_left(monkeypatch, capsys):
    clock = iter([100.0, 100.0, 110.0, 110.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    progress = LineProgress(every_s=300)
    progress.on_train_start(_trainer(10, 1), None)  # resumed after one epoch of 10 batches
    progress._examples = 640
    progress.print_line(_trainer(20, 1))  # 10 batches in 10 s; 30 left
    assert (
        capsys.readouterr().out.strip()
        == "epoch 2/5 | step 20/50 | train/loss 2.5 | 64 img/s | elapsed 0:00:10 | left 0:00:30"
    )
    progress.disable()
    progress.print_line(_trainer(20, 1))
    assert capsys.readouterr().out == ""  # ranks other than 0


def test_a_test_pass_says_when_it_starts_how_far_it_is_every_few_minutes_and_when_it_ends(monkeypatch, capsys):
    clock = iter([0.0, 100.0, 400.0, 450.0, 1200.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    trainer, method = SimpleNamespace(num_test_batches=[40]), SimpleNamespace(num_members=100_000)
    progress = LineProgress(every_s=300)
    progress.on_test_start(trainer, method)
    for batch_idx in (0, 9, 10):  # at 100 s (too soon), at 400 s (10 of 40 done), at 450 s (too soon)
        progress.on_test_batch_end(trainer, method, None, None, batch_idx)
    progress.on_test_end(trainer, method)
    assert capsys.readouterr().out.splitlines() == [
        "test: 40 batches, S = 100000 members each",
        "test: batch 10/40 | elapsed 0:06:40 | left 0:20:00",
        "test: 40 batches done in 0:20:00",
    ]
