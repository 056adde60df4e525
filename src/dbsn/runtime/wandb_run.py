"""Which W&B run a training or an evaluation logs into, and how it is grouped.

- **id**: made on the first start and kept in the run folder (`wandb_id`), so a resumed or
  requeued run continues the same W&B run (`resume: allow`) instead of opening a new one.
- **group**: the sweep (`<task_name> <sweep folder>`, e.g. `cifar10_sweep 2026-11-24_10-00-00`),
  or for a run of its own `<task_name> <run folder>`. An evaluation joins its training run's group.
- **job type**: `train` or `evaluate`. `evaluate.py` logs into a linked run of its own (job type
  `evaluate`, same group and name, `train_run_id` in its config): a second process resuming the
  training run would clash with it offline, where W&B cannot append to a run that it has not
  synced (a later `wandb sync` of the same id replaces the history).
- **name**: method, dataset and seed, e.g. `dbsn cifar10 seed=1`.
- **config**: the resolved config, plus flat keys that W&B groups and filters on: `method`,
  `dataset`, `seed`, `T` (structures per training step), `S` (members of the test ensemble),
  `epochs`, `batch_size`, `sweep`, `job_type`.
A user's own `logger.wandb.{id,group,name,job_type}` wins over each of these.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from dbsn.runtime.layout import WANDB_ID_FILE, method_and_dataset, sweep_of

IDENTITY_KEYS = ("id", "group", "name", "job_type")


def stable_wandb_id(folder: Path) -> str:
    """The W&B run id kept in `folder` (made and written on the first call, by rank 0)."""
    path = Path(folder) / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's own id form
    if rank_zero_only.rank == 0 and os.environ.get("LOCAL_RANK", "0") == "0":  # only rank 0 logs
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
    return run_id


def run_group(run_dir: Path, task_name: str | None) -> str:
    """The sweep a run belongs to, or the run itself, named as a person recognises it."""
    folder = sweep_of(run_dir) or Path(run_dir).absolute()
    return f"{task_name or 'run'} {folder.name}"


def run_facts(config: dict, run_dir: Path) -> dict[str, Any]:
    """The flat keys W&B groups and filters runs on (see the module docstring)."""
    model, data, trainer = (config.get(k) or {} for k in ("model", "data", "trainer"))
    method, dataset = method_and_dataset(run_dir, config)
    return {"method": method, "dataset": dataset, "seed": config.get("seed"),
            "T": model.get("train_samples", 1), "S": model.get("n_samples", 1),
            "epochs": trainer.get("max_epochs"), "batch_size": data.get("batch_size")}


def identity(config: dict, run_dir: Path, job_type: str, id_folder: Path, group: str | None = None) -> dict[str, Any]:
    """id, group, name and job type of the W&B run of `config`'s run in `run_dir` (see the module
    docstring); `id_folder` keeps the id, `group` replaces the derived one."""
    facts = run_facts(config, run_dir)
    return {"id": stable_wandb_id(id_folder), "group": group or run_group(run_dir, config.get("task_name")),
            "name": f"{facts['method']} {facts['dataset']} seed={facts['seed']}", "job_type": job_type}


def with_identity(loggers: DictConfig | None, ident: dict[str, Any], save_dir: Path | None = None) -> DictConfig | None:
    """The logger group with each W&B logger's unset identity keys filled from `ident`."""
    if not loggers:
        return loggers
    loggers = OmegaConf.create(OmegaConf.to_container(loggers, resolve=True))
    for node in loggers.values():
        if node is not None and str(node.get("_target_", "")).endswith("WandbLogger"):
            for key in IDENTITY_KEYS:
                if node.get(key) is None:
                    node[key] = ident[key]
            if save_dir is not None:
                node.save_dir = str(save_dir)
    return loggers


def configured_group(config: dict) -> str | None:
    """A group the user set for a run's W&B logger (`logger.wandb.group=...`), if any."""
    for node in (config.get("logger") or {}).values():
        if isinstance(node, dict) and str(node.get("_target_", "")).endswith("WandbLogger") and node.get("group"):
            return str(node["group"])
    return None
