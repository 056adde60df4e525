"""Training and evaluation (dbsn.runtime.run) end to end, through the same code as train.py /
evaluate.py, on generated data.
"""

from __future__ import annotations

import csv
import json

import lightning.pytorch as pl
import pytest
import torch

import dbsn
from dbsn.methods import DBSN, NonFiniteLossError
from dbsn.runtime.build import build_model
from dbsn.runtime.checkpoint import CheckpointError, load_checkpoint
from dbsn.runtime.run import evaluate, train
from tests.support.configs import TINY, compose_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cifar_root(cifar10_files):
    return cifar10_files(n_train=320, n_test=64, seed=0)


def _cifar_overrides(root, epochs: int) -> list[str]:
    return [
        "data=cifar10",
        f"data.root={root}",
        "data.batch_size=32",
        "data.num_workers=0",
        *TINY,
        f"trainer.max_epochs={epochs}",
        "model.structure_optim.lr=0.01",
    ]


def _metric_rows(run_dir) -> list[dict[str, str]]:
    with open(next(run_dir.glob("csv/version_*/metrics.csv"))) as f:
        return list(csv.DictReader(f))


def _epoch_values(run_dir, key: str) -> list[float]:
    return [float(row[key]) for row in _metric_rows(run_dir) if row.get(key)]


@pytest.fixture(scope="module")
def trained_run(cifar_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = compose_config("train", _cifar_overrides(cifar_root, epochs=4), out)
    metrics = train(cfg, out)
    return cfg, out, metrics


def test_training_decreases_loss_and_moves_theta(trained_run):
    cfg, out, metrics = trained_run
    nll = _epoch_values(out, "train/nll_epoch")
    assert len(nll) == 4 and nll[-1] < 0.9 * nll[0]

    # theta at initialisation: same seed, same build order as train()
    pl.seed_everything(cfg.seed)
    initial = build_model(cfg.model, num_classes=10).structure.theta.detach()
    checkpoint = load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert checkpoint["dbsn_version"] == dbsn.__version__  # every checkpoint records its writer
    final = checkpoint["state_dict"]["structure.theta"]
    assert (final - initial).abs().max() > 0.02

    assert set(metrics) >= {"test/error", "test/nll", "test/brier", "test/ece"}
    record = json.loads((out / "metrics.json").read_text())
    assert record["metrics"]["test/ece"] == pytest.approx(metrics["test/ece"])
    assert record["n_samples"] == 4
    assert record["dbsn_version"] == dbsn.__version__
    assert 0 < record["train_seconds"] < 600  # the fit's wall time (Timer callback)
    assert (out / "reliability_diagram.png").stat().st_size > 1000
    # schedules are logged every epoch
    assert len(_epoch_values(out, "structure/tau")) == 4
    assert len(_epoch_values(out, "structure/beta")) == 4


def cfg_overrides(out) -> list[str]:
    return [
        f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}",
        "n_samples=3",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
    ]


def test_evaluate_reloads_checkpoint_and_overrides_samples(trained_run, tmp_path):
    _, out, _ = trained_run
    eval_dir = tmp_path / "eval"
    cfg = compose_config("evaluate", cfg_overrides(out), eval_dir)
    metrics = evaluate(cfg, eval_dir)
    assert 0.0 <= metrics["test/error"] <= 1.0
    folder = out / "evaluation"  # next to the run it evaluates, where the report looks
    record = json.loads((folder / "metrics.json").read_text())
    assert record["n_samples"] == 3 and record["metrics"]["test/error"] == pytest.approx(metrics["test/error"])
    assert record["dbsn_version"] == dbsn.__version__
    assert (folder / "reliability_diagram.png").exists()
    # written where asked when output_dir is given
    evaluate(compose_config("evaluate", [*cfg_overrides(out), "output_dir=" + str(eval_dir)], eval_dir), eval_dir)
    assert (eval_dir / "metrics.json").exists()


def _eval_cfg(path, tmp_path):
    return compose_config("evaluate", [f"ckpt_path={path}", "trainer.accelerator=cpu"], tmp_path / "e")


def test_evaluate_rejects_missing_corrupt_and_foreign_checkpoints(trained_run, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        evaluate(_eval_cfg(tmp_path / "nope.ckpt", tmp_path), tmp_path / "e")
    corrupt = tmp_path / "corrupt.ckpt"
    good = (trained_run[1] / "checkpoints" / "last.ckpt").read_bytes()
    corrupt.write_bytes(good[: len(good) // 2])  # a truncated copy
    with pytest.raises(CheckpointError, match="corrupt"):
        evaluate(_eval_cfg(corrupt, tmp_path), tmp_path / "e")
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "epoch": 3}, foreign)
    with pytest.raises(CheckpointError, match="did not write"):
        evaluate(_eval_cfg(foreign, tmp_path), tmp_path / "e")


def test_resume_restores_structure_optimisers_and_counters(cifar_root, trained_run, tmp_path):
    _, out, _ = trained_run
    last = out / "checkpoints" / "last.ckpt"
    saved = load_checkpoint(last)
    steps_per_epoch = 320 // 32
    assert int(saved["state_dict"]["examples_seen"]) == 4 * steps_per_epoch * 32  # drives τ
    assert len(saved["optimizer_states"]) == 2  # SGD on weights, Adam on theta

    resumed_dir = tmp_path / "resumed"
    cfg = compose_config(
        "train",
        [*_cifar_overrides(cifar_root, epochs=5), f"ckpt_path={last}", "resume_changes=[trainer.max_epochs]"],
        resumed_dir,
    )
    train(cfg, resumed_dir)
    after = load_checkpoint(resumed_dir / "checkpoints" / "last.ckpt")
    assert after["epoch"] == 4  # 0-based: the fifth epoch
    assert int(after["state_dict"]["examples_seen"]) == 5 * steps_per_epoch * 32
    assert after["global_step"] > saved["global_step"]
    # the lr schedule continued from where it was (5 epochs stepped in total)
    assert after["lr_schedulers"][0]["last_epoch"] == 5
    # Adam's state for theta was carried over and advanced
    assert (
        after["optimizer_states"][1]["state"][0]["step"]
        == saved["optimizer_states"][1]["state"][0]["step"] + steps_per_epoch
    )
    assert not torch.equal(after["state_dict"]["structure.theta"], saved["state_dict"]["structure.theta"])
    # the training time adds the resumed epoch to the first four (the Timer's state is in the checkpoint)
    first, total = (json.loads((d / "metrics.json").read_text())["train_seconds"] for d in (out, resumed_dir))
    assert total > first + 0.01
    # and the budget its steps and images (TrainingBudget's counts are in the checkpoint too); 320 training images
    first, total = (json.loads((d / "metrics.json").read_text())["budget"] for d in (out, resumed_dir))
    assert first == {
        "steps": 4 * steps_per_epoch,
        "images": 4 * steps_per_epoch * 32,
        "train_images": 320,
        "batch_size": 32,
    }
    assert (total["steps"], total["images"]) == (5 * steps_per_epoch, 5 * steps_per_epoch * 32)


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(cifar_root, tmp_path, monkeypatch):
    original = DBSN.training_loss

    def poisoned(self, x, y):
        out = original(self, x, y)
        if self._examples >= 13 * 32:  # step 13, in the second epoch; the first epoch's checkpoint exists
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(DBSN, "training_loss", poisoned)
    cfg = compose_config("train", _cifar_overrides(cifar_root, epochs=3), tmp_path)
    with pytest.raises(NonFiniteLossError, match=r"nan at global step \d+ \(epoch 1, batch 3\)"):
        train(cfg, tmp_path)
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert checkpoint["epoch"] == 0
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())


def test_init_from_loads_weights_only_and_rejects_a_foreign_model(trained_run):
    from dbsn.runtime.build import init_weights

    cfg, out, _ = trained_run
    model = build_model(cfg.model, num_classes=10)
    init_weights(model, out / "checkpoints" / "last.ckpt")
    saved = load_checkpoint(out / "checkpoints" / "last.ckpt")["state_dict"]
    assert torch.equal(model.structure.theta.detach(), saved["structure.theta"])
    other = build_model({**cfg.model, "net": {**cfg.model.net, "growth": 8}}, num_classes=10)
    with pytest.raises(CheckpointError, match="do not fit"):
        init_weights(other, out / "checkpoints" / "last.ckpt")


def test_init_from_continues_tau_and_beta_where_the_first_run_ended(trained_run, tmp_path):
    """A second stage (`init_from`) starts its optimisers and lr schedule afresh but continues the
    structure posterior's annealing: its first epoch has the β of epoch 4 and the τ the first run
    ended at, not β(0) = 1 and τ = 3 around an already sharpened θ."""
    cfg, out, _ = trained_run
    first_beta = _epoch_values(out, "structure/beta")
    first_tau = _epoch_values(out, "structure/tau")
    saved = load_checkpoint(out / "checkpoints" / "last.ckpt")
    overrides = [
        *_cifar_overrides(cfg.data.root, 1),
        f"init_from={out / 'checkpoints' / 'last.ckpt'}",
        "test=false",
        "model.beta.decay_per_epoch=0.1",
        "model.tau.decay=0.01",
    ]
    second = train(compose_config("train", overrides, tmp_path), tmp_path)
    assert second == {}
    model = build_model(compose_config("train", overrides, tmp_path).model, num_classes=10)
    beta = _epoch_values(tmp_path, "structure/beta")[0]
    tau = _epoch_values(tmp_path, "structure/tau")[0]
    assert beta == pytest.approx(model.beta_schedule(4)) and beta < model.beta_schedule(0)
    assert tau == pytest.approx(model.tau_schedule(int(saved["state_dict"]["examples_seen"]) / 64))
    assert len(first_beta) == len(first_tau) == 4
    resumed = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    assert int(resumed["epochs_before"]) == 4


def test_train_checks_ckpt_path_before_building_anything(trained_run, tmp_path, monkeypatch):
    """A missing, truncated, foreign or other-method checkpoint is refused with evaluate.py's
    messages before the data module is instantiated (here the data root is empty, so building
    the data first would fail with a missing-dataset error instead)."""
    import dbsn.runtime.run as run

    def no_build(*args, **kwargs):
        raise AssertionError("the data or model was built before the checkpoint was checked")

    monkeypatch.setattr(run, "instantiate", no_build)
    empty = tmp_path / "empty"
    good = (trained_run[1] / "checkpoints" / "last.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(good[: len(good) // 2])
    torch.save({"state_dict": {}, "epoch": 3}, tmp_path / "foreign.ckpt")
    base = ["data=cifar10", f"data.root={empty}", *TINY]
    for path, message in (
        (tmp_path / "nope.ckpt", "not found"),
        (tmp_path / "truncated.ckpt", "corrupt"),
        (tmp_path / "foreign.ckpt", "did not write"),
    ):
        with pytest.raises(CheckpointError, match=message):
            train(compose_config("train", [*base, f"ckpt_path={path}"], tmp_path / "run"), tmp_path / "run")
    other_method = compose_config(
        "train",
        [
            "data=cifar10",
            f"data.root={empty}",
            "model=map",
            f"ckpt_path={trained_run[1] / 'checkpoints' / 'last.ckpt'}",
        ],
        tmp_path / "run",
    )
    with pytest.raises(
        CheckpointError, match=r"is a model dbsn\.methods\.DBSN checkpoint, but this run's model is dbsn\.methods\.MAP"
    ):
        train(other_method, tmp_path / "run")


def test_resume_true_continues_from_the_run_folders_own_last_checkpoint(cifar_root, trained_run, tmp_path):
    """resume=true: a fresh folder starts from scratch (or from ckpt_path); a folder with a
    last.ckpt continues from it, ckpt_path or not (what a requeued cluster job does)."""
    _, out, _ = trained_run
    run_dir = tmp_path / "run"
    train(
        compose_config("train", [*_cifar_overrides(cifar_root, epochs=1), "resume=true", "test=false"], run_dir),
        run_dir,
    )
    first = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert first["epoch"] == 0 and first["global_step"] > 0  # from scratch: one epoch
    # the same folder again, two epochs, and a ckpt_path that would start from a 4-epoch run
    cfg = compose_config(
        "train",
        [
            *_cifar_overrides(cifar_root, epochs=2),
            "resume=true",
            "test=false",
            "resume_changes=[trainer.max_epochs]",
            f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}",
        ],
        run_dir,
    )
    train(cfg, run_dir)
    second = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert second["epoch"] == 1 and second["global_step"] == 2 * first["global_step"]  # continued its own run
    assert second["optimizer_states"][1]["state"][0]["step"] == 2 * first["optimizer_states"][1]["state"][0]["step"]
