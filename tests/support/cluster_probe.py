"""Callbacks the cluster tests (tests/runtime/test_cluster.py) add through the config
(`+callbacks.probe._target_=tests.support.cluster_probe.RecordRankStructures`, with
`scripts.SUPPORT_ON_PATH` in the jobs' environment): each rank saves the training structures it
evaluated in its first step, with its node id; `FailInJob` fails one job of a sweep."""

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


class FailInJob(pl.Callback):
    """Fails the job whose `seed` is `fail_seed` when its fit starts: a fault only the job itself
    meets (no check before submission can see it)."""

    def __init__(self, seed: int, fail_seed: int) -> None:
        self.seed, self.fail_seed = seed, fail_seed

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.seed == self.fail_seed:
            raise RuntimeError(f"injected failure in the job of seed {self.seed}")
