"""The trainer settings of a training run that the methods would not apply, or that would end it
in a traceback after the network is built, refused in one line from the config alone.

The methods optimise manually (`dbsn.methods.training.TrainingLoop`): they zero, clip and step
their optimisers themselves at every batch, so Lightning's automatic gradient accumulation and
clipping do not apply to them (Lightning refuses the first and its advice, "switch to automatic
optimization", is no option here; the methods' own clipping is `model.optim.grad_clip_norm`).
Their schedules (the lr's milestones, τ and β, the samplers' cycles) are laid out over
`trainer.max_epochs`, so a run needs a number of epochs. The limits on batches and steps are
checked for what Lightning would refuse later (a negative count, a fraction above 1) and for a
run that would train or test nothing. `check_devices` asks this machine for the accelerator and
the devices the trainer names (not where a job is only submitted: SLURM's login node).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dbsn.runtime.config_errors import ConfigError

__all__ = ["check_devices", "check_trainer_settings", "limit_value"]


def _error(message: str) -> Exception:
    return ConfigError(message)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def limit_value(trainer, key: str, zero_allowed: bool = True) -> int | float | None:
    """`trainer.<key>` (a `limit_*_batches` or `overfit_batches`): None, a count >= 0 or a
    fraction in [0, 1], else refused as Lightning would refuse it after the network is built."""
    value = trainer.get(key)
    if value is None:
        return None
    if _int(value) and value >= 0 or isinstance(value, float) and 0.0 <= value <= 1.0:
        return value
    raise _error(
        f"trainer.{key}={value!r}: expected a number of batches >= 0 (an int) or a fraction of them in "
        f"[0, 1] (a float), or null (all of them)."
    )


def check_trainer_settings(cfg: DictConfig) -> None:
    """Refuse a training run's trainer settings that the methods would not apply or that would
    train or test nothing (see the module docstring)."""
    trainer = cfg.get("trainer") or {}
    max_epochs = trainer.get("max_epochs")
    if not _int(max_epochs) or max_epochs < 1:
        raise _error(
            f"trainer.max_epochs={max_epochs}: the methods' schedules (the lr's milestones, τ and β, the "
            "samplers' cycles) are laid out over the run's epochs; set a number of epochs >= 1."
        )
    min_epochs = trainer.get("min_epochs")
    if min_epochs is not None and (not _int(min_epochs) or not 0 <= min_epochs <= max_epochs):
        raise _error(
            f"trainer.min_epochs={min_epochs} with trainer.max_epochs={max_epochs}: the run stops at "
            "max_epochs whatever min_epochs says; set trainer.min_epochs to null or to at most max_epochs."
        )
    max_steps = trainer.get("max_steps", -1)
    if max_steps is None or not _int(max_steps) or max_steps < -1 or max_steps == 0:
        raise _error(
            f"trainer.max_steps={max_steps}: expected -1 (trainer.max_epochs decides) or a number of "
            "steps >= 1" + (" (0 trains nothing)." if max_steps == 0 else ".")
        )
    min_steps = trainer.get("min_steps")
    if min_steps is not None and (not _int(min_steps) or min_steps < 0 or max_steps != -1 and min_steps > max_steps):
        raise _error(
            f"trainer.min_steps={min_steps} with trainer.max_steps={max_steps}: set trainer.min_steps "
            "to null or to a number of steps between 0 and max_steps."
        )
    for key in (
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
        "overfit_batches",
    ):
        limit_value(trainer, key)
    if trainer.get("limit_train_batches") in (0, 0.0):
        raise _error(
            f"trainer.limit_train_batches={trainer.get('limit_train_batches')} trains no batch: a run "
            "that trained no step is no result. Set it to null (every batch), a count >= 1 or a fraction."
        )
    if cfg.get("test", True) and trainer.get("limit_test_batches") in (0, 0.0):
        raise _error(
            f"trainer.limit_test_batches={trainer.get('limit_test_batches')} with test=true tests no "
            "example, and the run's metrics would be no test's: set it to null (the whole test set), a "
            "count >= 1 or a fraction, or test=false (train only; evaluate.py tests later)."
        )
    accumulate = trainer.get("accumulate_grad_batches", 1)
    if accumulate not in (1, None):
        raise _error(
            f"trainer.accumulate_grad_batches={accumulate}: the methods step their optimisers at every "
            "batch themselves, so Lightning's accumulation does not apply to them. Keep it at 1; for a "
            "larger effective batch raise data.batch_size (the memory of a DBSN step: "
            "model.train_samples_per_forward)."
        )
    for key in ("gradient_clip_val", "gradient_clip_algorithm"):
        if trainer.get(key) not in (None, 0, 0.0):
            raise _error(
                f"trainer.{key}={trainer.get(key)}: the methods step their optimisers themselves, and "
                "Lightning's clipping does not reach them. Their clipping is model.optim.grad_clip_norm "
                f"(the weights' gradient norm; e.g. model.optim.grad_clip_norm=1.0); set trainer.{key}=null."
            )
    if trainer.get("barebones"):
        raise _error(
            "trainer.barebones=true turns off the checkpoints, loggers and callbacks that a run writes "
            "its results with; set trainer.barebones=false."
        )
    if trainer.get("fast_dev_run"):
        value = trainer.get("fast_dev_run")
        raise _error(
            f"trainer.fast_dev_run={str(value).lower() if isinstance(value, bool) else value} writes no checkpoint and would report "
            "a run of a batch or two as a finished one; for a quick check use e.g. trainer.max_epochs=1 "
            "trainer.limit_train_batches=2 trainer.limit_test_batches=2."
        )
    callbacks = cfg.get("callbacks") or {}
    checkpointing = [
        name
        for name, node in callbacks.items()
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith("ModelCheckpoint")
    ]
    if trainer.get("enable_checkpointing") is False and checkpointing:
        raise _error(
            f"trainer.enable_checkpointing=false with the callback callbacks.{checkpointing[0]} (it writes "
            f"checkpoints/last.ckpt, which evaluate.py, resume and the report read): to write no "
            f"checkpoint remove it too (~callbacks.{checkpointing[0]}), or leave trainer.enable_checkpointing "
            "at null."
        )
    devices = trainer.get("devices", 1)
    if _int(devices) and (devices == 0 or devices < -1):
        raise _error(
            f"trainer.devices={devices}: expected a number of devices >= 1, -1 or auto (all of them), "
            "or a list of device indices."
        )
    nodes = trainer.get("num_nodes", 1)
    if nodes is not None and (not _int(nodes) or nodes < 1):
        raise _error(f"trainer.num_nodes={nodes}: expected a number of machines >= 1.")


def _available(accelerator: str) -> tuple[bool, int]:
    """Whether this machine has `accelerator`, and how many devices of it."""
    if accelerator in ("gpu", "cuda"):
        return torch.cuda.is_available(), torch.cuda.device_count()
    if accelerator == "mps":
        available = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        return available, int(available)
    if accelerator == "cpu":
        return True, math.inf  # processes, as many as asked
    return True, math.inf  # Lightning's other accelerators: it says itself


def check_devices(cfg: DictConfig) -> None:
    """Refuse an accelerator this machine does not have (`trainer=gpu` without a GPU) and more
    devices of it than it has, before anything is built."""
    trainer = cfg.get("trainer") or {}
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator == "auto":
        return
    available, count = _available(accelerator)
    if not available:
        what = "a GPU (trainer=gpu sets it)" if accelerator in ("gpu", "cuda") else f"an {accelerator} device"
        raise _error(
            f"trainer.accelerator={accelerator} asks for {what}, and this machine has none that PyTorch can "
            "use: train on the CPU with trainer=cpu, or let the run take what there is with "
            "trainer.accelerator=auto."
        )
    devices = trainer.get("devices", 1)
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        wanted = len(devices)
    elif isinstance(devices, str) and "," in devices:
        wanted = len([d for d in devices.split(",") if d.strip()])
    else:
        wanted = devices
    if _int(wanted) and wanted > count:
        raise _error(
            f"trainer.devices={devices} on accelerator={accelerator}: this machine has {count}; set "
            f"trainer.devices={count} or fewer."
        )
