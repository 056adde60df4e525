"""A callback the cluster tests (tests/runtime/test_cluster.py) add through the config
(`+callbacks.probe._target_=tests.support.cluster_probe.RecordRankStructures`, with
`scripts.SUPPORT_ON_PATH` in the jobs' environment): each rank saves the training structures it
evaluated in its first step, with its node id."""

import os
from pathlib import Path

import lightning.pytorch as pl
import torch


class RecordRankStructures(pl.Callback):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer, pl_module) -> None:
        original = pl_module.local_training_structures
        path = self.folder / f"rank{trainer.global_rank}.pt"

        def recording():
            alpha, kl = original()
            if not path.exists():
                self.folder.mkdir(parents=True, exist_ok=True)
                torch.save({"alpha": alpha.detach().clone(), "node": os.environ.get("SLURM_NODEID")}, path)
            return alpha, kl

        pl_module.local_training_structures = recording
