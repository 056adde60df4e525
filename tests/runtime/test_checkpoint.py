"""Checkpoints (dbsn.runtime.checkpoint): atomic writes, the random state they carry, configs
written before classes moved, and resuming.

Resuming from a checkpoint reproduces the uninterrupted run bit for bit: the same weights,
structure logits, optimiser states (SGD/Adam, VOGN's precision, NEK-FAC's factors) and
counters, for every method that draws random numbers while it trains. Two pieces make that
true and are tested on their own: the training loader's order depends only on (seed, epoch)
(tests/data/test_base.py), and the random state travels in the checkpoint.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

import dbsn.runtime.run
from dbsn.runtime.checkpoint import AtomicCheckpointIO, RandomStateCallback, load_checkpoint
from dbsn.runtime.run import train
from tests.support.configs import compose_config, tiny_for


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


def test_restored_random_state_is_shared_by_structure_parallel_ranks_and_split_for_data_parallel():
    from dbsn.runtime.checkpoint import RandomStateCallback

    saved = RandomStateCallback().state_dict()  # rank 0's state, as a checkpoint holds it
    draws = {}
    for parallel in ("structure", "data"):
        for rank in (0, 1):
            callback = RandomStateCallback()
            callback.load_state_dict(saved)
            callback.on_train_epoch_start(
                SimpleNamespace(world_size=2, global_rank=rank), SimpleNamespace(parallel=parallel)
            )
            draws[parallel, rank] = torch.rand(3)
    assert torch.equal(draws["structure", 0], draws["structure", 1])
    assert not torch.equal(draws["data", 0], draws["data", 1])


def test_checkpoints_written_before_classes_moved_still_load(tmp_path):
    """A run config naming a class by the module it used to live in (dbsn.schedules.TauSchedule,
    dbsn.tracking.WandbLogger) is read with the class's new path."""
    import torch

    from dbsn.runtime.checkpoint import CONFIG_KEY, load_checkpoint, upgrade_config

    old = {
        "model": {
            "tau": {"_target_": "dbsn.schedules.TauSchedule", "decay": 1e-3},
            "beta": {"_target_": "dbsn.structure.schedules.BetaSchedule"},
        },
        "logger": {"wandb": {"_target_": "dbsn.tracking.WandbLogger"}},
        "members": [{"_target_": "dbsn.schedules.X"}],
    }
    new = upgrade_config(old)
    assert new["model"]["tau"] == {"_target_": "dbsn.structure.schedules.TauSchedule", "decay": 1e-3}
    assert new["model"]["beta"]["_target_"] == "dbsn.structure.schedules.BetaSchedule"  # already new: unchanged
    assert new["logger"]["wandb"]["_target_"] == "dbsn.evaluation.tracking.WandbLogger"
    assert new["members"][0]["_target_"] == "dbsn.structure.schedules.X"
    torch.save({"state_dict": {}, CONFIG_KEY: old}, tmp_path / "old.ckpt")
    assert (
        load_checkpoint(tmp_path / "old.ckpt")[CONFIG_KEY]["model"]["tau"]["_target_"]
        == "dbsn.structure.schedules.TauSchedule"
    )


def test_run_configs_with_flat_method_settings_build_the_same_method():
    """A model config written before S, the validation S, members per forward and temperature
    scaling travelled as `prediction`, channels-last and compile as `execution`, and VOGN's draws
    per step were named `draws_per_step`, builds today's method with the same settings."""
    from dbsn.runtime.build import build_model
    from dbsn.runtime.checkpoint import upgrade_config

    net = {"_target_": "dbsn.nets.StructureNet", "num_nodes": 3, "cells_per_stage": 1, "growth": 4, "stem_channels": 8}
    old = {
        "_target_": "dbsn.methods.DBSN",
        "net": net,
        "train_samples": 2,
        "n_samples": 7,
        "val_samples": 3,
        "samples_per_forward": 2,
        "temperature_scaling": True,
        "channels_last": True,
        "compile": {"_target_": "dbsn.methods.Compilation", "enabled": False},
    }
    method = build_model(upgrade_config({"model": old})["model"], num_classes=10)
    assert (method.n_samples, method.val_samples, method.samples_per_forward, method.temperature_scaling) == (
        7,
        3,
        2,
        True,
    )
    assert method.channels_last and not method.execution.compile.enabled and method.train_samples == 2
    vogn = {
        "_target_": "dbsn.methods.natgrad.VOGNMethod",
        "net": net,
        "n_samples": 5,
        "vogn": {"num_samples": 2, "lr": 0.1},
    }
    upgraded = upgrade_config({"model": vogn})["model"]
    assert upgraded["vogn"] == {"draws_per_step": 2, "lr": 0.1} and upgraded["prediction"]["n_samples"] == 5
    assert build_model(upgraded, num_classes=10).vogn["draws_per_step"] == 2
    ensemble = {"_target_": "dbsn.methods.DeepEnsemble", "temperature_scaling": False, "size": 2}
    assert upgrade_config({"model": ensemble})["model"] == ensemble  # the ensemble's own setting stays


def test_runs_written_before_the_fused_cell_keep_their_cell_and_refuse_to_resume_with_another(tmp_path):
    """A run config written before the `cell` choice ran the per-edge cell: it is read so. Evaluating
    its checkpoint with either cell works (the state converts), resuming it with the fused cell is
    refused in one line, since the optimiser's state belongs to the per-edge parameters."""
    import torch

    from dbsn.runtime.build import build_model
    from dbsn.runtime.checkpoint import CONFIG_KEY, CheckpointError, check_resume_checkpoint, upgrade_config

    net = {"_target_": "dbsn.nets.StructureNet", "num_nodes": 3, "cells_per_stage": 1, "growth": 4, "stem_channels": 8}
    old = {"model": {"_target_": "dbsn.methods.DBSN", "net": net}, "data": {"_target_": "dbsn.data.DigitsDataModule"}}
    assert upgrade_config(old)["model"]["net"]["cell"] == "per_edge"
    assert upgrade_config({"model": {"net": {**net, "cell": "fused"}}})["model"]["net"]["cell"] == "fused"
    per_edge = build_model(upgrade_config(old)["model"], num_classes=10)
    fused = build_model({**old["model"], "net": {**net, "cell": "fused"}}, num_classes=10)
    fused.load_state_dict(per_edge.state_dict())  # evaluate.py model.net.cell=fused on an old checkpoint
    torch.save({"state_dict": per_edge.state_dict(), CONFIG_KEY: old}, tmp_path / "old.ckpt")
    today = {"model": {**old["model"], "net": {**net, "cell": "fused"}}, "data": old["data"]}
    with pytest.raises(
        CheckpointError,
        match=r"trained with model.net.cell=per_edge, and this run asks for fused.*"
        r"Resume with model.net.cell=per_edge",
    ):
        check_resume_checkpoint(tmp_path / "old.ckpt", today)
    same = {"model": {**old["model"], "net": {**net, "cell": "per_edge"}}, "data": old["data"]}
    assert check_resume_checkpoint(tmp_path / "old.ckpt", same) == tmp_path / "old.ckpt"


# ---------------------------------------------------------------------- resuming


@pytest.fixture(scope="module")
def cifar_root(cifar10_files):
    return cifar10_files(n_train=96, n_test=16, seed=1)


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
    names += [
        f"optimizer_states[{i}]"
        for i, (x, y) in enumerate(zip(a["optimizer_states"], b["optimizer_states"]))
        if not _equal(x, y)
    ]
    return names


class _StopAfterFirstEpoch(pl.Callback):
    """An interruption between epochs (after that epoch's checkpoint is written)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def _three_runs(method: str, root, tmp_path, monkeypatch, extra=()) -> tuple[dict, dict]:
    """Final checkpoints of a 2-epoch run, and of the same run stopped after its first epoch
    then resumed from its `last.ckpt` (the schedules span 2 epochs in both)."""
    common = [
        f"model={method}",
        "data=cifar10",
        f"data.root={root}",
        "data.batch_size=16",
        "data.num_workers=0",
        *tiny_for(method),
        "test=false",
        "seed=3",
        "trainer.max_epochs=2",
        *extra,
    ]
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(compose_config("train", common, straight), straight)
    with monkeypatch.context() as patch:
        build_trainer = dbsn.runtime.run.build_trainer
        patch.setattr(
            dbsn.runtime.run,
            "build_trainer",
            lambda cfg, out, callbacks=(), loggers=(): build_trainer(
                cfg, out, [*callbacks, _StopAfterFirstEpoch()], loggers
            ),
        )
        train(compose_config("train", common, first), first)
    last = first / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["epoch"] == 0
    train(compose_config("train", [*common, f"ckpt_path={last}"], resumed), resumed)
    return (
        load_checkpoint(straight / "checkpoints" / "last.ckpt"),
        load_checkpoint(resumed / "checkpoints" / "last.ckpt"),
    )


# Validation between epochs draws random numbers too (DBSN samples structures): dbsn runs with a
# validation split, so its checkpoint is written after validation, not after training.
@pytest.mark.parametrize(
    "method, extra",
    [
        ("dbsn", ["data.val_size=16", "model.prediction.val_samples=2"]),
        ("mc_dropout", []),
        ("bbb", []),
        ("vogn", []),
        ("vogn_fbn", []),
        ("nekfac", []),
    ],
)
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
