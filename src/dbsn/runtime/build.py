"""From config to objects: methods (from a config or a checkpoint), trainers, callbacks, loggers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelSummary, ProgressBar, RichProgressBar
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from dbsn.methods import Method
from dbsn.runtime.checkpoint import CONFIG_KEY, AtomicCheckpointIO, CheckpointError, load_checkpoint
from dbsn.runtime.console import summary_callback
from dbsn.runtime.ddp import RunDirDDPStrategy
from dbsn.runtime.progress import LineProgress

__all__ = [
    "build_model",
    "build_trainer",
    "count_parameters",
    "init_weights",
    "instantiate_group",
    "load_method",
    "with_facts",
]


def build_model(model_cfg: DictConfig | dict, num_classes: int) -> Method:
    """Instantiate the network (given the data's class count), then the method around it.

    An ensemble config (`member:` + `size:`) builds `size` members, member m initialised from
    its own seed (the current seed + m), and the ensemble around them.
    """
    spec = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    if "member" in spec:
        member, base_seed = spec.pop("member"), torch.initial_seed()
        members = []
        for m in range(spec["size"]):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(base_seed + m)
                members.append(build_model(member, num_classes))
        return instantiate(spec, members=members)
    net = instantiate(spec.pop("net"), num_classes=num_classes)
    return instantiate(spec, net=net)


def count_parameters(model) -> int:
    """Trainable parameters of the method: network weights (means and scales for Gaussian
    weights) and structure logits."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def load_method(
    path, num_classes: int, expected_data: str | None = None, checkpoint: dict[str, Any] | None = None
) -> Method:
    """The method a checkpoint holds, rebuilt from the run config inside it (`checkpoint`: the
    file already loaded); `expected_data`: the data `_target_` it must have been trained on."""
    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(path)
    run_cfg = checkpoint[CONFIG_KEY]
    if expected_data is not None and run_cfg["data"]["_target_"] != expected_data:
        raise CheckpointError(
            f"{path} was trained on {run_cfg['data']['_target_']}, not {expected_data} like the first "
            "checkpoint: ensemble members must share their data."
        )
    model = build_model(run_cfg["model"], num_classes)
    try:
        model.load_state_dict(checkpoint["state_dict"], strict=True)
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: its weights do not fit the model described by its own config "
            f"(was the file edited or written by another version?): {err}"
        ) from err
    return model


def init_weights(model: Method, path) -> None:
    """Start from the weights (and θ) of another run's checkpoint, e.g. full-size fine-tuning
    after training on crops; unlike `ckpt_path`, optimisers, the lr schedule and the epoch count
    start afresh, while the structure posterior's τ and β continue where that run ended
    (`continue_schedules`)."""
    checkpoint = load_checkpoint(path)
    try:
        model.load_state_dict(checkpoint["state_dict"], strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"init_from={path}: its weights do not fit this model ({err})") from err
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    model.continue_schedules(int(progress.get("processed", checkpoint.get("epoch", -1) + 1)))


def num_devices(devices: Any, accelerator: str) -> int:
    """How many devices `trainer.devices` asks for."""
    cuda = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        if devices == "auto":
            return torch.cuda.device_count() if cuda else 1
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        devices = int(devices)
    if devices == -1:
        return torch.cuda.device_count() if cuda else 1
    return int(devices)


def build_trainer(trainer_cfg: DictConfig, output_dir: Path, callbacks=(), loggers=()) -> pl.Trainer:
    """A Lightning Trainer from `trainer.*`, with atomic checkpoints and Hydra-safe DDP."""
    kwargs = OmegaConf.to_container(trainer_cfg, resolve=True)
    kwargs.pop("_target_", None)
    if kwargs.get("enable_progress_bar") is False:  # the progress-bar callback would contradict it
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    elif not sys.stdout.isatty():  # a log file (SLURM, nohup): plain lines instead of a redrawn bar
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)] + [LineProgress()]
    if kwargs.get("enable_model_summary") is not False and not any(isinstance(cb, ModelSummary) for cb in callbacks):
        rich = any(isinstance(cb, RichProgressBar) for cb in callbacks)  # Lightning's own choice
        callbacks = [*callbacks, summary_callback(rich)]  # without Lightning's FLOPs, always 0 here
    if not loggers:  # logger=none: the learning rates have nowhere to go (Lightning would refuse to start)
        callbacks = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    strategy = kwargs.get("strategy", "auto")
    if strategy == "ddp" or (
        strategy == "auto" and num_devices(kwargs.get("devices", 1), kwargs.get("accelerator", "auto")) > 1
    ):
        kwargs["strategy"] = RunDirDDPStrategy(run_dir=output_dir)
    return pl.Trainer(
        **kwargs, callbacks=list(callbacks), logger=list(loggers) or False, plugins=[AtomicCheckpointIO()]
    )


def device_of(trainer_cfg) -> torch.device:
    """Where an evaluation predicts: the GPU when the trainer may use one and there is one."""
    wants_gpu = trainer_cfg.get("accelerator", "auto") in ("auto", "gpu", "cuda")
    return torch.device("cuda") if wants_gpu and torch.cuda.is_available() else torch.device("cpu")


def instantiate_group(group: DictConfig | None) -> list:
    """The objects of a config group whose options are keyed by name (callbacks, loggers)."""
    if not group:
        return []
    return [instantiate(node) for node in group.values() if node is not None and "_target_" in node]


def with_facts(config: dict, logger, facts: dict, wandb: dict | None, **extra) -> dict:
    """The config a logger records: the run's resolved config plus, for W&B, the flat keys it
    groups and filters runs on (`dbsn.runtime.wandb_run.run_facts`), the sweep and job type."""
    if not isinstance(logger, WandbLogger) or wandb is None:
        return config
    return {**config, **facts, "sweep": wandb["group"], "job_type": wandb["job_type"], **extra}
