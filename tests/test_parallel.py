"""One training step, three ways: the T structures in one grouped forward, in chunks with their
gradients accumulated (the memory knob), and split over two ranks (structure-parallel DDP).
All three must leave the same weights, θ and BatchNorm running statistics."""

from __future__ import annotations

import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from configs import ROOT, TINY, compose_config
from torch.utils.data import DataLoader, TensorDataset

from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.data.base import EpochShuffleSampler, SameOrderOnEveryRank
from dbsn.methods import DBSN
from dbsn.nets import StructureNet
from dbsn.runtime.run import train


def _one_step(train_samples_per_forward: int | None, train_samples: int = 4) -> dict[str, torch.Tensor]:
    """State after one training step of a small DBSN on one fixed batch (seeded: same init,
    same structure draws)."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(net, train_samples=train_samples, dataset_size=100,
                  train_samples_per_forward=train_samples_per_forward)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(method, DataLoader(TensorDataset(x, y), batch_size=6))
    return {k: v.detach().clone() for k, v in method.state_dict().items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    checked = {"weights": 0, "theta": 0, "running": 0}
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=atol, msg=key)
        else:
            assert torch.equal(a[key], b[key]), key
        kind = "theta" if key == "structure.theta" else "running" if "running_" in key else "weights"
        checked[kind] += 1
    assert min(checked.values()) > 0, checked


def test_structures_in_chunks_give_the_grouped_step():
    grouped = _one_step(None)
    initial_bn = next(v for k, v in _fresh_state().items() if k.endswith("running_var"))
    assert not torch.equal(initial_bn, next(v for k, v in grouped.items() if k.endswith("running_var")))
    for chunk in (1, 3):  # equal chunks, and a last chunk smaller than the others
        _assert_same_state(_one_step(chunk), grouped)


def test_chunks_without_the_accumulated_batchnorm_update_would_differ(monkeypatch):
    """Guards the test above: chunks that each move the running statistics (T moves instead
    of one) leave other statistics than the grouped step."""
    import contextlib

    import dbsn.methods.base

    grouped = _one_step(None)
    monkeypatch.setattr(dbsn.methods.base, "accumulated_running_statistics",
                        lambda net, enabled=True: contextlib.nullcontext())
    with pytest.raises(AssertionError, match="running_"):
        _assert_same_state(_one_step(1), grouped)


def _fresh_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    return DBSN(net, train_samples=4, dataset_size=100).state_dict()


def test_same_order_on_every_rank_is_the_single_device_order():
    data = list(range(37))
    single, shared = EpochShuffleSampler(data, seed=5), SameOrderOnEveryRank(data, seed=5)
    for epoch in (0, 3):
        single.set_epoch(epoch)
        shared.set_epoch(epoch)
        assert list(shared) == list(single) and sorted(shared) == data
    assert isinstance(shared, torch.utils.data.DistributedSampler)  # Lightning keeps it as it is


def test_structure_parallel_refuses_t_not_divisible_by_devices(tmp_path):
    cfg = compose_config("train", ["data=digits", *TINY, "model.train_samples=3", "trainer.devices=2",
                                   "trainer.strategy=ddp"], tmp_path)
    with pytest.raises(ValueError, match=r"T = 3 structures of a step over 2 devices.*model.parallel=data"):
        train(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("train_samples, chunk, steps", [(2, "null", 1), (2, "null", 2), (4, "1", 2)])
def test_structure_parallel_steps_on_two_ranks_equal_one_device(tmp_path, train_samples, chunk, steps):
    """python train.py ... trainer.devices=2 (structure-parallel: T / 2 structures per rank,
    and with T = 4 one structure after the other on each rank) against the grouped step on one
    device: two steps on the same batches with the same structures leave the same weights, θ and
    running statistics."""
    common = ["data=digits", *TINY, f"model.train_samples={train_samples}", "model.parallel=structure",
              "data.batch_size=16", "trainer.max_epochs=1", f"trainer.limit_train_batches={steps}", "test=false",
              "callbacks.structure_posterior=null"]
    states = {}
    for devices in (1, 2):
        run_dir = tmp_path / f"devices{devices}"
        extra = ["trainer.strategy=ddp", f"model.train_samples_per_forward={chunk}"] if devices > 1 else []
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *common, f"trainer.devices={devices}", *extra,
             f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        states[devices] = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    assert int(states[2]["examples_seen"]) == steps * 16  # a shared batch counts once
    # float32 round-off of the all-reduce's summation order: a few 1e-6 after two steps at lr 0.1
    # (data-parallel ranks, or a wrong share of the structures, differ by ~1e-2)
    _assert_same_state(states[2], states[1], atol=2e-5)
