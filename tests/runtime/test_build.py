"""Building the trainer (dbsn.runtime.build): without a terminal the progress bar becomes lines; without a logger no learning-rate monitor."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar

from dbsn.runtime.build import build_trainer
from dbsn.runtime.progress import LineProgress
from tests.support.configs import compose_config


def test_without_a_terminal_the_progress_bar_becomes_lines(tmp_path, monkeypatch):
    cfg = compose_config("train", ["experiment=quick"], tmp_path)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    trainer = build_trainer(cfg.trainer, tmp_path, callbacks=[RichProgressBar()])
    assert isinstance(trainer.progress_bar_callback, LineProgress)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    trainer = build_trainer(cfg.trainer, tmp_path, callbacks=[RichProgressBar()])
    assert isinstance(trainer.progress_bar_callback, RichProgressBar)


def test_without_a_logger_the_learning_rate_monitor_is_left_out(tmp_path):
    """logger=none: Lightning refuses to start with a LearningRateMonitor and no logger."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    cfg = compose_config("train", ["experiment=quick", "logger=none"], tmp_path)
    alone = build_trainer(cfg.trainer, tmp_path, callbacks=[LearningRateMonitor()])
    assert not any(isinstance(cb, LearningRateMonitor) for cb in alone.callbacks)
    logged = build_trainer(cfg.trainer, tmp_path, callbacks=[LearningRateMonitor()], loggers=[CSVLogger(tmp_path)])
    assert any(isinstance(cb, LearningRateMonitor) for cb in logged.callbacks)
