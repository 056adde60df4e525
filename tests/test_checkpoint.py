"""Atomic checkpoint writes and per-rank random streams."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dbsn.runtime.checkpoint import AtomicCheckpointIO
from dbsn.methods import DBSN
from dbsn.nets import StructureNet


def test_atomic_save_replaces_the_file_whole(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    io.save_checkpoint({"state_dict": {"w": torch.full((3,), 2.0)}}, path)
    assert torch.equal(torch.load(path)["state_dict"]["w"], torch.full((3,), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary files left


def test_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)

    def dies_half_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path)["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def _method_on_rank(rank: int, world_size: int = 2, parallel: str = "data") -> DBSN:
    torch.manual_seed(123)  # seed_everything: the same on every rank
    net = StructureNet(num_classes=3, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = DBSN(net, dataset_size=10, parallel=parallel)
    datamodule = SimpleNamespace(same_batches_on_every_rank=parallel == "structure")  # as train.py sets it
    method._trainer = SimpleNamespace(world_size=world_size, global_rank=rank, datamodule=datamodule)
    method.on_fit_start()
    return method


def test_each_ddp_rank_draws_its_own_structures():
    draws = {rank: _method_on_rank(rank).structure.sample(4, 1.0, 1.0) for rank in (0, 1)}
    assert not torch.allclose(draws[0], draws[1])
    again = _method_on_rank(1).structure.sample(4, 1.0, 1.0)
    assert torch.equal(again, draws[1])  # reproducible per rank
    # the initial weights are the same on every rank (DDP also broadcasts rank 0's)
    a, b = _method_on_rank(0), _method_on_rank(1)
    assert torch.equal(a.structure.theta, b.structure.theta)


def test_structure_parallel_ranks_draw_the_same_structures():
    """...and take different blocks of them (see tests/test_parallel.py for the whole step)."""
    draws = {rank: _method_on_rank(rank, parallel="structure").structure.sample(4, 1.0, 1.0) for rank in (0, 1)}
    assert torch.equal(draws[0], draws[1])


def test_restored_random_state_is_shared_by_structure_parallel_ranks_and_split_for_data_parallel():
    from dbsn.runtime.checkpoint import RandomStateCallback

    saved = RandomStateCallback().state_dict()  # rank 0's state, as a checkpoint holds it
    draws = {}
    for parallel in ("structure", "data"):
        for rank in (0, 1):
            callback = RandomStateCallback()
            callback.load_state_dict(saved)
            callback.on_train_epoch_start(SimpleNamespace(world_size=2, global_rank=rank), SimpleNamespace(parallel=parallel))
            draws[parallel, rank] = torch.rand(3)
    assert torch.equal(draws["structure", 0], draws["structure", 1])
    assert not torch.equal(draws["data", 0], draws["data", 1])


def test_checkpoints_written_before_classes_moved_still_load(tmp_path):
    """A run config naming a class by the module it used to live in (dbsn.schedules.TauSchedule,
    dbsn.tracking.WandbLogger) is read with the class's new path."""
    import torch

    from dbsn.runtime.checkpoint import CONFIG_KEY, load_checkpoint, upgrade_config

    old = {"model": {"tau": {"_target_": "dbsn.schedules.TauSchedule", "decay": 1e-3},
                     "beta": {"_target_": "dbsn.structure.schedules.BetaSchedule"}},
           "logger": {"wandb": {"_target_": "dbsn.tracking.WandbLogger"}}, "members": [{"_target_": "dbsn.schedules.X"}]}
    new = upgrade_config(old)
    assert new["model"]["tau"] == {"_target_": "dbsn.structure.schedules.TauSchedule", "decay": 1e-3}
    assert new["model"]["beta"]["_target_"] == "dbsn.structure.schedules.BetaSchedule"  # already new: unchanged
    assert new["logger"]["wandb"]["_target_"] == "dbsn.evaluation.tracking.WandbLogger"
    assert new["members"][0]["_target_"] == "dbsn.structure.schedules.X"
    torch.save({"state_dict": {}, CONFIG_KEY: old}, tmp_path / "old.ckpt")
    assert load_checkpoint(tmp_path / "old.ckpt")[CONFIG_KEY]["model"]["tau"]["_target_"] == "dbsn.structure.schedules.TauSchedule"


def test_run_configs_with_flat_method_settings_build_the_same_method():
    """A model config written before S, the validation S, members per forward and temperature
    scaling travelled as `prediction`, channels-last and compile as `execution`, and VOGN's draws
    per step were named `draws_per_step`, builds today's method with the same settings."""
    from dbsn.runtime.build import build_model
    from dbsn.runtime.checkpoint import upgrade_config

    net = {"_target_": "dbsn.nets.StructureNet", "num_nodes": 3, "cells_per_stage": 1, "growth": 4, "stem_channels": 8}
    old = {"_target_": "dbsn.methods.DBSN", "net": net, "train_samples": 2, "n_samples": 7, "val_samples": 3,
           "samples_per_forward": 2, "temperature_scaling": True, "channels_last": True,
           "compile": {"_target_": "dbsn.methods.Compilation", "enabled": False}}
    method = build_model(upgrade_config({"model": old})["model"], num_classes=10)
    assert (method.n_samples, method.val_samples, method.samples_per_forward, method.temperature_scaling) == (7, 3, 2, True)
    assert method.channels_last and not method.execution.compile.enabled and method.train_samples == 2
    vogn = {"_target_": "dbsn.methods.natgrad.VOGNMethod", "net": net, "n_samples": 5, "vogn": {"num_samples": 2, "lr": 0.1}}
    upgraded = upgrade_config({"model": vogn})["model"]
    assert upgraded["vogn"] == {"draws_per_step": 2, "lr": 0.1} and upgraded["prediction"]["n_samples"] == 5
    assert build_model(upgraded, num_classes=10).vogn["draws_per_step"] == 2
    ensemble = {"_target_": "dbsn.methods.DeepEnsemble", "temperature_scaling": False, "size": 2}
    assert upgrade_config({"model": ensemble})["model"] == ensemble  # the ensemble's own setting stays
