"""Resuming from a checkpoint reproduces the uninterrupted run bit for bit: the same weights,
structure logits, optimiser states (SGD/Adam, VOGN's precision, NEK-FAC's factors) and
counters, for every method that draws random numbers while it trains. Two pieces make that
true and are tested on their own: the training loader's order depends only on (seed, epoch),
and the random state travels in the checkpoint."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from configs import compose_config, tiny_for
from fakedata import write_cifar10
from torch.utils.data import DataLoader, TensorDataset

import dbsn.runtime.run
from dbsn.runtime.checkpoint import RandomStateCallback, load_checkpoint
from dbsn.data.base import EpochShuffleSampler
from dbsn.runtime.run import train


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_cifar10(root, n_train=96, n_test=16, seed=1)
    return root


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _differences(a: dict, b: dict) -> list[str]:
    """Names of the state-dict entries and optimiser states in which two checkpoints differ."""
    names = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
    names += [f"optimizer_states[{i}]" for i, (x, y) in enumerate(zip(a["optimizer_states"], b["optimizer_states"]))
              if not _equal(x, y)]
    return names


class _StopAfterFirstEpoch(pl.Callback):
    """An interruption between epochs (after that epoch's checkpoint is written)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def _three_runs(method: str, root, tmp_path, monkeypatch, extra=()) -> tuple[dict, dict]:
    """Final checkpoints of a 2-epoch run, and of the same run stopped after its first epoch
    then resumed from its `last.ckpt` (the schedules span 2 epochs in both)."""
    common = [f"model={method}", "data=cifar10", f"data.root={root}", "data.batch_size=16", "data.num_workers=0",
              *tiny_for(method), "test=false", "seed=3", "trainer.max_epochs=2", *extra]
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(compose_config("train", common, straight), straight)
    with monkeypatch.context() as patch:
        build_trainer = dbsn.runtime.run.build_trainer
        patch.setattr(dbsn.runtime.run, "build_trainer",
                      lambda cfg, out, callbacks=(), loggers=(): build_trainer(cfg, out, [*callbacks, _StopAfterFirstEpoch()], loggers))
        train(compose_config("train", common, first), first)
    last = first / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["epoch"] == 0
    train(compose_config("train", [*common, f"ckpt_path={last}"], resumed), resumed)
    return (load_checkpoint(straight / "checkpoints" / "last.ckpt"),
            load_checkpoint(resumed / "checkpoints" / "last.ckpt"))


# Validation between epochs draws random numbers too (DBSN samples structures): dbsn runs with a
# validation split, so its checkpoint is written after validation, not after training.
@pytest.mark.parametrize("method, extra", [
    ("dbsn", ["data.val_size=16", "model.prediction.val_samples=2"]),
    ("mc_dropout", []),
    ("bbb", []),
    ("vogn", []),
    ("vogn_fbn", []),
    ("nekfac", []),
])
def test_resumed_run_equals_the_uninterrupted_run(method, extra, cifar_root, tmp_path, monkeypatch):
    straight, resumed = _three_runs(method, cifar_root, tmp_path, monkeypatch, extra)
    assert straight["epoch"] == resumed["epoch"] == 1
    assert straight["global_step"] == resumed["global_step"] > 0
    assert _differences(straight, resumed) == []
    assert len(straight["optimizer_states"]) == len(resumed["optimizer_states"]) >= 1


def test_without_the_random_state_the_resumed_run_differs(cifar_root, tmp_path, monkeypatch):
    """The test above can fail: resuming without restoring the random state changes the
    structures DBSN draws in the second epoch, hence θ and the weights."""
    monkeypatch.setattr(RandomStateCallback, "on_train_epoch_start", lambda self, trainer, module: None)
    straight, resumed = _three_runs("dbsn", cifar_root, tmp_path, monkeypatch)
    different = _differences(straight, resumed)
    assert "structure.theta" in different and len(different) > 10


def test_epoch_shuffle_depends_only_on_seed_and_epoch():
    data = TensorDataset(torch.arange(50))
    sampler = EpochShuffleSampler(data, seed=7)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert all(sorted(o) == list(range(50)) for o in orders)  # permutations
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch
    fresh = EpochShuffleSampler(data, seed=7)
    fresh.set_epoch(2)
    assert list(fresh) == orders[2]  # a fresh sampler (a resumed run) at epoch 2: the same order
    assert list(fresh) == orders[2]  # iterating again does not advance anything
    other = EpochShuffleSampler(data, seed=8)
    other.set_epoch(2)
    assert list(other) != orders[2]

    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = DataLoader(data, batch_size=10, sampler=sampler, generator=torch.Generator().manual_seed(1))
    batches = [b[0].tolist() for b in loader]
    assert sum(batches, []) == orders[2]
    assert torch.equal(torch.get_rng_state(), before)  # the global random state is left alone
    assert EpochShuffleSampler(data).seed == 0  # defaults to the run's seed (torch.initial_seed())


def test_random_state_callback_restores_at_the_first_resumed_epoch():
    callback = RandomStateCallback()
    torch.manual_seed(11)
    state = callback.state_dict()
    expected = torch.rand(5)

    class Trainer:
        world_size, global_rank = 1, 0

    torch.manual_seed(12)
    restored = RandomStateCallback()
    restored.load_state_dict(state)
    restored.on_train_epoch_start(Trainer(), None)
    assert torch.equal(torch.rand(5), expected)
    current = torch.get_rng_state()
    restored.on_train_epoch_start(Trainer(), None)  # only once: later epochs keep their stream
    assert torch.equal(torch.get_rng_state(), current)
