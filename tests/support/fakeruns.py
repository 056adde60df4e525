"""Hand-made run folders for the report's tests: a Hydra sweep's job folders (resolved config,
.hydra choices and overrides, metrics.json) with known numbers, and evaluation files beside them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml

MODELS = {
    "dbsn": {"_target_": "dbsn.methods.DBSN", "weights": None},
    "map": {"_target_": "dbsn.methods.MAP", "learn_structure": True, "weights": None},
}
DATA = {"cifar10": "dbsn.data.CIFAR10DataModule", "cifar100": "dbsn.data.CIFAR100DataModule"}
# test errors of the finished jobs; (map, cifar10, 2) fails, (map, cifar100, 3) never ran
ERRORS = {
    ("dbsn", "cifar10"): {1: 0.05, 2: 0.06, 3: 0.07},
    ("map", "cifar10"): {1: 0.08, 3: 0.10},
    ("dbsn", "cifar100"): {1: 0.20, 2: 0.22, 3: 0.24},
    ("map", "cifar100"): {1: 0.30, 2: 0.31},
}
ECES = {1: 0.010, 2: 0.012, 3: 0.014}
TIMES = {"dbsn": 600.0, "map": 1200.0}  # train_seconds = TIMES[model] * seed


def write_yaml(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))


def write_run(
    folder: Path, model: dict, data_target: str, seed: int, error: float | None, train_seconds: float | None = None
) -> Path:
    write_yaml(folder / "resolved_config.yaml", {"model": model, "data": {"_target_": data_target}, "seed": seed})
    if error is not None:
        metrics = {"test/error": error, "test/nll": 10 * error, "test/ece": ECES.get(seed, 0.02)}
        record = {"metrics": metrics, "n_samples": 100, "seed": seed, "epochs": 100, "train_seconds": train_seconds}
        (folder / "metrics.json").write_text(json.dumps(record))
    return folder


def write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def write_outputs(tmp_path: Path) -> Path:
    """One Hydra sweep (model=dbsn,map x seed=1,2,3 from the sweeper, data=cifar10,cifar100 from the
    command line) with one failed and one missing job, plus a hand-made fbn run without .hydra."""
    root = tmp_path / "outputs" / "sweep" / "multiruns" / "2024-01-01_00-00-00"
    write_yaml(
        root / "multirun.yaml",
        {
            "seed": 0,
            "hydra": {
                "sweeper": {
                    "_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": {"model": "dbsn,map", "seed": "1,2,3"},
                },
                "overrides": {"task": ["data=cifar10,cifar100", "trainer=cpu"]},
            },
        },
    )
    job = 0
    for model in ("dbsn", "map"):
        for seed in (1, 2, 3):
            for data in ("cifar10", "cifar100"):
                job += 1
                if (model, data, seed) == ("map", "cifar100", 3):
                    continue  # the missing job: no folder at all
                folder = root / str(job - 1)
                write_yaml(
                    folder / ".hydra" / "hydra.yaml",
                    {"hydra": {"runtime": {"choices": {"model": model, "data": data}}}},
                )
                write_yaml(
                    folder / ".hydra" / "overrides.yaml",
                    [f"model={model}", f"seed={seed}", f"data={data}", "trainer=cpu"],
                )
                write_run(
                    folder,
                    MODELS[model],
                    DATA[data],
                    seed,
                    ERRORS[model, data].get(seed),
                    train_seconds=TIMES[model] * seed,
                )
                write_yaml(folder / "checkpoints" / "resolved_config.yaml", {})  # skipped folders are not runs
    # fbn, launched without Hydra: the method comes from the resolved config
    write_run(
        tmp_path / "outputs" / "single" / "fbn_run",
        {"_target_": "dbsn.methods.DBSN", "weights": {"_target_": "dbsn.methods.weights.GaussianWeights"}},
        DATA["cifar10"],
        7,
        0.04,
    )
    return tmp_path / "outputs"


def job_dir(outputs: Path, model: str, data: str, seed: int) -> Path:
    root = outputs / "sweep" / "multiruns" / "2024-01-01_00-00-00"
    return root / str(["dbsn", "map"].index(model) * 6 + (seed - 1) * 2 + ["cifar10", "cifar100"].index(data))


# ---------------------------------------------------------------------- runs that name themselves
def write_identity(folder: Path, run_id: str, **record) -> dict:
    """run.json as training writes it: the run's id and the sha256 of its resolved_config.yaml."""
    import hashlib

    config = folder / "resolved_config.yaml"
    run = {
        "run_id": run_id,
        "status": "finished",
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        "history": [{"event": "started"}, {"event": "finished"}],
        **record,
    }
    (folder / "run.json").write_text(json.dumps(run))
    return run


def name_run(folder: Path, run_id: str) -> Path:
    """A hand-made run (`write_run`) that names itself: run.json, and its metrics.json's run_id."""
    write_identity(folder, run_id)
    metrics = folder / "metrics.json"
    if metrics.is_file():
        metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "run_id": run_id}))
    return folder


def write_checkpoint(path: Path, run_id: str | None, epoch: int = 0, global_step: int = 1, **extra) -> Path:
    """A small file that reads as a checkpoint for the run identity's checks (no weights)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": {"w": torch.zeros(2)},
            "epoch": epoch,
            "global_step": global_step,
            **({"dbsn_run_id": run_id} if run_id else {}),
            **extra,
        },
        path,
    )
    return path


def write_trained_run(
    folder: Path, run_id: str | None, seed: int = 0, epoch: int = 1, global_step: int = 20, extra: tuple[str, ...] = ()
) -> Path:
    """A run folder as train.py leaves it, without training: a tiny DBSN on digits, freshly
    initialised (`seed`), saved as checkpoints/last.ckpt with the run's config and id; its
    resolved_config.yaml, metrics.json and (with `run_id`) run.json. evaluate.py evaluates it."""
    import torch

    from dbsn import __version__
    from dbsn.runtime.build import build_model
    from dbsn.runtime.config import to_plain
    from tests.support.configs import TINY, compose_config

    cfg = compose_config("train", ["data=digits", *TINY, f"seed={seed}", "logger=none", *extra], folder)
    plain = to_plain(cfg)
    torch.manual_seed(seed)
    model = build_model(cfg.model, 10)
    write_yaml(folder / "resolved_config.yaml", plain)
    checkpoint = {
        "state_dict": model.state_dict(),
        "dbsn_config": plain,
        "dbsn_version": __version__,
        "epoch": epoch,
        "global_step": global_step,
        **({"dbsn_run_id": run_id} if run_id else {}),
    }
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, folder / "checkpoints" / "last.ckpt")
    record = {"metrics": {"test/error": 0.9}, "seed": seed, "epochs": epoch, "n_samples": 4}
    (folder / "metrics.json").write_text(json.dumps({**record, **({"run_id": run_id} if run_id else {})}))
    if run_id:
        write_identity(folder, run_id)
    return folder
