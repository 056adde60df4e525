"""Callbacks the structure-parallel tests (tests/methods/test_base.py) add through the config
(`+callbacks.grads._target_=tests.support.grad_probe.SaveFirstGradients`, with
`scripts.SUPPORT_ON_PATH` in the run's environment): what each rank's first optimiser step sees,
and a deliberately wrong KL weight to show that the comparison would catch one."""

from pathlib import Path

import lightning.pytorch as pl
import torch


class SaveFirstGradients(pl.Callback):
    """Each rank saves every parameter's gradient (θ's included) at its first optimiser step,
    after DDP's all-reduce and before any optimiser has used it."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.saved = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.saved:
            return
        self.saved = True
        self.folder.mkdir(parents=True, exist_ok=True)
        grads = {name: p.grad.detach().clone() for name, p in pl_module.named_parameters() if p.grad is not None}
        torch.save(grads, self.folder / f"rank{trainer.global_rank}.pt")


class KLOnEveryRank(pl.Callback):
    """A wrong structure-parallel step: every rank counts its KL world-size times (as if the
    ranks' KLs were to be summed, not averaged with the gradients)."""

    def on_train_start(self, trainer, pl_module) -> None:
        original = pl_module.local_training_structures

        def wrong():
            alpha, kl = original()
            return alpha, kl * trainer.world_size

        pl_module.local_training_structures = wrong
