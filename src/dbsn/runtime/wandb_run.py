"""Which W&B run a training or an evaluation logs into, and how it is grouped.

- **id**: made on the first start and kept in the run folder (`wandb_id`), so a resumed or
  requeued run continues the same W&B run (`resume: allow`) instead of opening a new one.
- **group**: the sweep (`<task_name> <sweep folder>`, e.g. `cifar10_sweep <date>_<time>`),
  or for a run of its own `<task_name> <run folder>`. An evaluation joins its training run's group.
- **job type**: `train` or `evaluate`. `evaluate.py` logs into a linked run of its own (job type
  `evaluate`, same group and name, `train_run_id` in its config): a second process resuming the
  training run would clash with it offline, where W&B cannot append to a run that it has not
  synced (a later `wandb sync` of the same id replaces the history).
- **name**: method, dataset and seed, e.g. `dbsn cifar10 seed=1`.
- **config**: the resolved config, plus flat keys that W&B groups and filters on: `method`,
  `dataset`, `seed`, `network` (resnet18, wrn28_10, or the network's class: StructureNet, ...),
  `T` (structures per training step), `S` (members of the test ensemble as the config sets
  them, in the paper's letter as `T` is; an evaluation's run gives the members it predicted with,
  metrics.json's `n_samples`, which can differ: a sampler's kept samples, a deterministic method's
  single member), `epochs`, `batch_size`, `sweep`, `job_type`.
A user's own `logger.wandb.{id,group,name,job_type}` wins over each of these.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from dbsn.evaluation.runs import (
    CONFIG_FILE,
    WANDB_ID_FILE,
    backbone_of,
    hydra_choices,
    load_run_config,
    method_and_dataset,
    sweep_of,
)
from dbsn.runtime.build import instantiate_group, with_facts
from dbsn.runtime.config import to_plain
from dbsn.runtime.rank import is_rank_zero

IDENTITY_KEYS = ("id", "group", "name", "job_type")


def stable_wandb_id(folder: Path) -> str:
    """The W&B run id kept in `folder` (made and written on the first call, by rank 0)."""
    path = Path(folder) / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's own id form
    if is_rank_zero():  # only rank 0 logs
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
    member = model.get("member") or {}  # model=deep_ensemble: `size` members trained as one model
    size = model.get("size", 1) if member else 1
    net = (member or model).get("net") or {}
    network = backbone_of(model, hydra_choices(run_dir)) or str(net.get("_target_", "?")).rsplit(".", 1)[-1]
    return {
        "method": method,
        "dataset": dataset,
        "seed": config.get("seed"),
        "network": network,
        "T": (member or model).get("train_samples", 1),
        "S": size * n_samples_of(member)
        if member
        else model.get("size") or n_samples_of(model),  # size: M of a single-pass ensemble
        "epochs": trainer.get("max_epochs"),
        "batch_size": data.get("batch_size"),
    }


def n_samples_of(model: dict) -> int:
    """S of a model config: `prediction.n_samples` (configs written before the prediction
    settings were grouped: `n_samples`)."""
    return int((model.get("prediction") or {}).get("n_samples") or model.get("n_samples") or 1)


def run_name(facts: dict[str, Any]) -> str:
    return f"{facts['method']} {facts['dataset']} seed={facts['seed']}"


def is_wandb_node(node) -> bool:
    """A logger config node that builds a W&B logger (ours or Lightning's)."""
    return isinstance(node, (dict, DictConfig)) and str(node.get("_target_", "")).endswith("WandbLogger")


def with_identity(
    loggers: DictConfig | None, make_identity: Callable[[], dict[str, Any]], save_dir: Path | None = None
) -> tuple[DictConfig | None, dict[str, Any] | None]:
    """The logger group with each W&B logger's unset identity keys (id, group, name, job type)
    filled from `make_identity()`, and the identity in effect (None without a W&B logger).
    `make_identity` is called only when a W&B logger needs it: it may write the id file."""
    if not loggers:
        return loggers, None
    loggers = OmegaConf.create(OmegaConf.to_container(loggers, resolve=True))
    effective = None
    for node in loggers.values():
        if not is_wandb_node(node):
            continue
        missing = [key for key in IDENTITY_KEYS if node.get(key) is None]
        if missing:
            made = make_identity()
            for key in missing:
                node[key] = made[key]
        if save_dir is not None:
            node.save_dir = str(save_dir)
        effective = {key: node[key] for key in IDENTITY_KEYS}
    return loggers, effective


def configured_group(config: dict) -> str | None:
    """A group the user set for a run's W&B logger (`logger.wandb.group=...`), if any."""
    for node in (config.get("logger") or {}).values():
        if is_wandb_node(node) and node.get("group"):
            return str(node["group"])
    return None


def logged_to_wandb(config: dict) -> bool:
    """Whether the run of `config` had a W&B logger."""
    return any(is_wandb_node(node) for node in (config.get("logger") or {}).values())


def evaluation_loggers(
    cfg: DictConfig, paths: list[Path], train_config: dict, out: Path, model, posterior=None
) -> list:
    """The evaluation's loggers. A W&B logger logs into a run linked to the training run: the
    training run's group and name, job type `evaluate`, the training runs' W&B ids, the
    evaluation's settings under `evaluation`, S as evaluated; its id is kept in `out`. A deep
    ensemble of several runs is its own method, `deep_ensemble`; a post-hoc posterior is method
    `<run's method>+<name>` (`posthoc`, `base_method` kept)."""
    run_dirs = [Path(p).parent.parent for p in paths]
    in_runs = all((d / CONFIG_FILE).is_file() for d in run_dirs)
    run_dir = run_dirs[0] if in_runs else out
    facts = {**run_facts(train_config, run_dir), "S": model.num_members}
    if len(paths) > 1:
        facts.update(method="deep_ensemble", members=f"{len(paths)} x {facts['method']}", seed=None)
    if posterior is not None:  # a method of its own (as in the report), on top of the run's
        facts.update(method=f"{facts['method']}+{posterior.name}", posthoc=posterior.name, base_method=facts["method"])
    name = run_name(facts) if len(paths) == 1 else f"deep_ensemble {facts['dataset']} {facts['members']}"
    group = (
        configured_group(train_config) or run_group(run_dir, train_config.get("task_name"))
        if in_runs
        else run_group(out, cfg.get("task_name"))
    )
    logger_cfg, wandb = with_identity(
        cfg.get("logger"),
        lambda: {"id": stable_wandb_id(out), "group": group, "name": name, "job_type": "evaluate"},
        save_dir=out,
    )
    loggers = instantiate_group(logger_cfg)
    if wandb is None:
        return loggers
    train_ids = [
        (d / WANDB_ID_FILE).read_text().strip()
        for d in run_dirs
        if in_runs and logged_to_wandb(load_run_config(d)) and (d / WANDB_ID_FILE).is_file()
    ]
    settings = {k: v for k, v in to_plain(cfg).items() if k not in ("logger", "hydra", "paths", "callbacks", "trainer")}
    links = {"train_run_id": train_ids[0]} if len(paths) == 1 and train_ids else {"train_run_ids": train_ids}
    for logger in loggers:
        logger.log_hyperparams(
            with_facts(
                train_config, logger, facts, wandb, evaluation=settings, checkpoints=[str(p) for p in paths], **links
            )
        )
    return loggers


def close_loggers(loggers, status: str, finish_wandb: bool = True) -> None:
    """Finalize the loggers; finishing a W&B run writes its summary (offline runs: for `wandb sync`)."""
    for logger in loggers:
        logger.finalize(status)
        if isinstance(logger, WandbLogger) and finish_wandb:
            logger.experiment.finish(exit_code=0 if status == "success" else 1)
