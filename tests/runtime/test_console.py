"""What a run prints (dbsn.runtime.console): each Lightning message once, no product tips."""

from __future__ import annotations

import logging

from dbsn.runtime.console import LIGHTNING_LOGGERS, quiet_console


def _tiny_module(lr):
    """A one-layer LightningModule trained with SGD at learning rate `lr` (a float or a tensor)."""
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Tiny()


def test_lightning_messages_reach_the_console_once_and_tips_not_at_all(capfd):
    import lightning.pytorch  # noqa: F401 - adds Lightning's own console handlers

    root = logging.getLogger()
    handler = logging.StreamHandler()  # stands in for the console handler Hydra configures
    root.addHandler(handler)
    saved = {
        name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate) for name in LIGHTNING_LOGGERS
    }
    try:
        quiet_console()
        quiet_console()  # twice changes nothing
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        rank_zero.warning("GPU available: False, used: False")
        rank_zero.warning("💡 Tip: For seamless cloud logging, try litlogger")
        rank_zero.warning("Trainer already configured with model summary callbacks: [<class 'RichSummary'>]. Skipping")
        err = capfd.readouterr().err
        assert err.count("GPU available: False, used: False") == 1
        assert "💡" not in err and "litlogger" not in err and "already configured" not in err
        assert sum(type(f).__name__ == "_NoTips" for f in rank_zero.filters) == 1
    finally:
        root.removeHandler(handler)
        for name, (handlers, propagate) in saved.items():
            logging.getLogger(name).handlers[:] = handlers
            logging.getLogger(name).propagate = propagate


def test_the_model_summary_has_no_flops_and_keeps_the_rest(tmp_path, capsys, caplog):
    """A fit's summary (rich or plain) lists the modules and parameters without Lightning's FLOPs,
    which it counts only from an `example_input_array` and so printed as 0 for every run."""
    import torch
    from lightning.pytorch.callbacks import RichProgressBar
    from omegaconf import OmegaConf

    from dbsn.runtime.build import build_trainer

    caplog.set_level(logging.INFO)
    logging.getLogger("lightning.pytorch").propagate = True
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), batch_size=4)
    for callbacks in ([RichProgressBar()], []):
        trainer = build_trainer(
            OmegaConf.create(
                {
                    "accelerator": "cpu",
                    "max_steps": 1,
                    "enable_checkpointing": False,
                    "enable_progress_bar": bool(callbacks),
                }
            ),
            tmp_path,
            callbacks,
        )
        trainer.fit(_tiny_module(0.1), data)
        out = capsys.readouterr().out + caplog.text
        caplog.clear()
        assert "Linear" in out and "Total params" in out, out
        assert "flops" not in out.lower(), out


def test_a_learning_rate_that_is_a_tensor_is_monitored_without_a_warning(tmp_path, recwarn):
    """Under the CUDA graph every learning rate is a tensor the schedule writes in place; Lightning's
    LearningRateMonitor copied it with torch.tensor() and warned on every GPU run of the paper's
    experiment (seen on an H200). Here the same on a CPU: the rate still reaches the logger."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    quiet_console()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LearningRateMonitor()],
        logger=CSVLogger(tmp_path),
    )
    trainer.fit(_tiny_module(torch.tensor(0.25)), data)
    assert not [w for w in recwarn if "copy construct from a tensor" in str(w.message)]
    assert trainer.callback_metrics["lr-SGD"].item() == 0.25
