"""A run's training budget (dbsn.evaluation.budget.TrainingBudget): steps and images over all ranks,
kept through a checkpoint, unknown after a resume that lost them. Training runs that record it:
tests/runtime/test_run.py (resumed), tests/methods/test_csgmcmc.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dbsn.evaluation.budget import TrainingBudget


class _Module:
    """`Method.examples_per_step` of a run on `world_size` ranks, data- or structure-parallel."""

    def __init__(self, world_size: int, parallel: str) -> None:
        self.world_size, self.parallel = world_size, parallel

    def examples_per_step(self, batch_size: int) -> int:
        return batch_size * (self.world_size if self.parallel == "data" else 1)


def _batch(rows: int):
    return torch.zeros(rows, 3, 4, 4), torch.zeros(rows, dtype=torch.long)


def test_steps_and_images_over_all_ranks():
    for parallel, per_step in (("data", 4 * 32), ("structure", 32)):
        budget, trainer = TrainingBudget(), SimpleNamespace(world_size=4, global_step=0)
        budget.on_train_start(trainer, _Module(4, parallel))
        for i in range(5):
            budget.on_train_batch_end(trainer, _Module(4, parallel), None, _batch(32), i)
        budget.on_train_batch_end(trainer, _Module(4, parallel), None, _batch(7), 5)  # a last, smaller batch
        datamodule = SimpleNamespace(num_train=45_000, batch_size=32)
        assert budget.record(datamodule) == {
            "steps": 6,
            "images": 5 * per_step + per_step * 7 // 32,
            "train_images": 45_000,
            "batch_size": 32,
        }
    plain = TrainingBudget()  # a module without examples_per_step: every rank its own batch
    plain.on_train_batch_end(SimpleNamespace(world_size=2), object(), None, {"image": torch.zeros(5, 1)}, 0)
    assert (plain.steps, plain.images) == (1, 10)


def test_a_resume_continues_the_counts_or_says_they_are_unknown():
    first = TrainingBudget()
    trainer = SimpleNamespace(world_size=1, global_step=0)
    for i in range(3):
        first.on_train_batch_end(trainer, _Module(1, "data"), None, _batch(8), i)
    resumed = TrainingBudget()
    resumed.load_state_dict(first.state_dict())
    resumed.on_train_start(SimpleNamespace(world_size=1, global_step=3), _Module(1, "data"))
    resumed.on_train_batch_end(trainer, _Module(1, "data"), None, _batch(8), 0)
    assert (resumed.record()["steps"], resumed.record()["images"]) == (4, 32)
    older = TrainingBudget()  # resumed from a checkpoint that kept no counts: the steps before it are unknown
    older.on_train_start(SimpleNamespace(world_size=1, global_step=3), _Module(1, "data"))
    older.on_train_batch_end(trainer, _Module(1, "data"), None, _batch(8), 0)
    assert older.record() == {"steps": None, "images": None, "train_images": None, "batch_size": None}

    class NotSetUp:  # num_train raises before setup: unknown, not an error
        batch_size = 8

        @property
        def num_train(self) -> int:
            raise RuntimeError("num_train is known after setup('fit')")

    assert first.record(NotSetUp())["train_images"] is None and first.record(NotSetUp())["batch_size"] == 8
