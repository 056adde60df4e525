"""What a run's training consumed, counted as it trains: optimiser steps and training images seen
(`TrainingBudget`), recorded in metrics.json's `budget` beside the epochs and the wall time, so that
every row of the report can say what its runs cost (`report.sections.budget`).

A step is one training batch: every method steps each of its optimisers once a batch (a deep
ensemble's members step together, DBSN's weights and θ together), so runs with several optimisers
count their batches, not `trainer.global_step`. An image seen is one training example the step
drew from the data, over all ranks (`Method.examples_per_step`: each data-parallel rank draws its
own batch, structure-parallel ranks share one); the repetitions inside a step (BatchEnsemble's and
Masksembles' M copies, MIMO's r) and the members of an ensemble that all see it count once.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["TrainingBudget"]


def _rows(batch) -> int:
    """The examples in a training batch: an (inputs, targets) pair, a mapping or a tensor."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return int(len(batch))


class TrainingBudget(pl.Callback):
    """Counts the steps and the training images of a fit (module docstring). The counts are kept in
    checkpoints, so a resumed run adds its steps to those before the interruption.

    Attributes:
        steps: training batches stepped on (one optimiser step of every optimiser each).
        images: training examples drawn, over all ranks.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.images = 0
        self.counted_from_start = True  # False: resumed from a checkpoint that kept no counts (an older version's)
        self._loaded = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > 0 and not self._loaded:
            self.counted_from_start = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        rows = _rows(batch)
        per_step = getattr(pl_module, "examples_per_step", None)
        self.steps += 1
        self.images += int(per_step(rows)) if per_step is not None else rows * trainer.world_size

    def record(self, datamodule: Any = None) -> dict[str, int | None]:
        """metrics.json's `budget`: the steps, the images seen (None where a resume from an older
        checkpoint lost the counts before it), and the training split they came from
        (`train_images`: its size, after any validation split was held out) with the batch."""
        try:
            train_images = int(datamodule.num_train) if datamodule is not None else None
        except (AttributeError, RuntimeError, TypeError):  # a data module that does not say, or not set up
            train_images = None
        batch_size = getattr(datamodule, "batch_size", None)
        known = self.counted_from_start
        return {
            "steps": self.steps if known else None,
            "images": self.images if known else None,
            "train_images": train_images,
            "batch_size": int(batch_size) if isinstance(batch_size, int) else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "images": self.images}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict.get("steps", 0))
        self.images = int(state_dict.get("images", 0))
        self._loaded = True
