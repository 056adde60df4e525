"""What a training job is checked for before it builds its network, and after its fit.

- `check_run_length`: the run's length from its data and trainer settings, as Lightning will
  count it (the training split's size, the batch size, `drop_last`, the devices a data-parallel
  run splits the data over, `limit_train_batches`, `overfit_batches`, `max_steps`): a run that
  would train no step (`data.batch_size=5000` on digits drops its only, incomplete batch), a
  limit that rounds to no batch, a validation split as large as the training set, and a run too
  short for what its settings lay out over it (cSG-MCMC's cycles, a snapshot ensemble's) are
  refused in one line. It reads the training split once (the data module keeps it for the fit).
- `check_trained`: after the fit, a run that trained no step (a time limit that ran out first,
  whatever the first check cannot see) is refused instead of being tested and reported.
- `check_job`: every cheap check of one composed job (`validate_config`, the checkpoint and the
  changes it resumes with, the run's length), for a sweep to run on every job before the first
  one starts.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dbsn.runtime.config import ConfigError, to_plain, validate_config
from dbsn.runtime.trainer_settings import limit_value

__all__ = ["check_job", "check_run_length", "check_trained", "training_steps"]


def _world(cfg: DictConfig) -> int:
    """Ranks that split the training data: devices × nodes for a data-parallel method, else 1."""
    from dbsn.runtime.build import num_devices

    trainer, model = cfg.get("trainer") or {}, cfg.get("model") or {}
    parallel = model.get("parallel", "data") if "member" not in model else "data"
    if parallel != "data":
        return 1
    try:
        devices = num_devices(trainer.get("devices", 1), str(trainer.get("accelerator", "auto")))
        return max(1, int(devices)) * max(1, int(trainer.get("num_nodes", 1) or 1))
    except (TypeError, ValueError):
        return 1


def _limited(count: int, limit: int | float | None) -> int:
    """Batches Lightning runs of `count` under a `limit_*_batches` value."""
    if limit is None:
        return count
    return min(count, limit) if isinstance(limit, int) else int(count * limit)


def _setup(datamodule: Any, stage: str) -> None:
    """`datamodule.setup(stage)`, its refusal of a split (`val_size`, `train_subset`) as one line."""
    try:
        datamodule.setup(stage)
    except ValueError as err:
        problem, name = str(err), type(datamodule).__name__
        if "val_size" in problem:
            value = getattr(datamodule, "val_size", None)
            raise ConfigError(
                f"data.val_size={value} {problem.removeprefix(f'val_size {value} ')} ({name}): choose a "
                "smaller count, or a fraction in (0, 1)."
            ) from err
        raise ConfigError(f"{problem if problem.startswith('data.') else 'data: ' + problem} ({name}).") from err


def training_steps(cfg: DictConfig, datamodule: Any) -> tuple[int, int]:
    """(batches of an epoch, optimiser steps of the run) that the fit will run, refusing a run of
    none; reads the training split."""
    trainer = cfg.trainer
    for key, least in (("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0)):
        value = getattr(datamodule, key, None)
        if isinstance(value, int) and value < least:
            what = "a number of images" if least else "a number of worker processes"
            raise ConfigError(f"data.{key}={value}: expected {what} >= {least}.")
    _setup(datamodule, "fit")
    images, batch_size = int(datamodule.num_train), int(datamodule.batch_size)
    drop_last = bool(getattr(datamodule, "drop_last", False))
    world = _world(cfg)
    per_rank = math.ceil(images / world)
    batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
    name = type(datamodule).__name__
    if batches == 0:
        ranks = f", {per_rank} on each of {world} data-parallel ranks" if world > 1 else ""
        raise ConfigError(
            f"data.batch_size={batch_size} is larger than the training split ({images} images of "
            f"{name}{ranks}), and data.drop_last=true drops an incomplete batch: the run would train no "
            f"step. Set data.batch_size to at most {per_rank}, or data.drop_last=false."
        )
    overfit = limit_value(trainer, "overfit_batches")
    key, limit = (
        ("overfit_batches", overfit)
        if overfit
        else ("limit_train_batches", limit_value(trainer, "limit_train_batches"))
    )
    if _limited(batches, limit) == 0:
        raise ConfigError(
            f"trainer.{key}={limit} of an epoch's {batches} batches is less than one batch: the run would "
            f"train no step. Set it to a count >= 1, or a fraction of at least {1 / batches:.3g}."
        )
    batches = _limited(batches, limit)
    steps = int(trainer.max_epochs) * batches
    max_steps = trainer.get("max_steps", -1)
    if max_steps is not None and max_steps > 0:
        steps = min(steps, int(max_steps))
    return batches, steps


def _check_evaluation_batches(cfg: DictConfig, datamodule: Any) -> None:
    """A fraction of the validation or test batches that rounds to none: Lightning refuses it,
    after training for the test set."""
    trainer = cfg.trainer
    size = getattr(datamodule, "eval_batch_size", None) or getattr(datamodule, "batch_size", 1)
    stages = [("limit_val_batches", "val_set", "fit")]
    if cfg.get("test", True):
        stages.append(("limit_test_batches", "test_set", "test"))
    for key, split, stage in stages:
        limit = limit_value(trainer, key)
        if not isinstance(limit, float) or limit in (0.0, 1.0):
            continue
        if getattr(datamodule, split, None) is None and stage == "test":
            _setup(datamodule, "test")
        dataset = getattr(datamodule, split, None)
        if dataset is None or not len(dataset):
            continue
        batches = math.ceil(len(dataset) / int(size))
        if _limited(batches, limit) == 0:
            raise ConfigError(
                f"trainer.{key}={limit} of the {batches} batches of the {split.split('_')[0]} split is "
                f"less than one batch: set it to a count >= 1, or a fraction of at least {1 / batches:.3g}."
            )


def _check_schedules(cfg: DictConfig, batches: int, steps: int) -> None:
    """What a setting lays out over the run: cSG-MCMC's cycles over its steps, a snapshot
    ensemble's cycles over its epochs."""
    model = cfg.get("model") or {}
    epochs = cfg.trainer.max_epochs
    length = (
        f"this run: {epochs} epoch{'s' if epochs != 1 else ''} × {batches} batches"
        + (f", at most trainer.max_steps={cfg.trainer.max_steps}" if (cfg.trainer.get("max_steps") or -1) > 0 else "")
        + f" = {steps} steps"
    )
    for where, node in (("model", model), ("model.member", model.get("member"))):
        sampler = node.get("sampler") if isinstance(node, DictConfig) else None
        if isinstance(sampler, DictConfig) and isinstance(sampler.get("schedule"), DictConfig):
            try:
                instantiate(sampler.schedule).check(steps)
            except ValueError as err:
                raise ConfigError(f"{where}.sampler.schedule: {err} ({length}).") from err
    for name, node in (cfg.get("callbacks") or {}).items():
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith(".SnapshotCollector"):
            cycles = node.get("cycles", 5)
            if isinstance(cycles, int) and cfg.trainer.max_epochs < cycles:
                raise ConfigError(
                    f"callbacks.{name}.cycles={cycles}: a snapshot ensemble takes one snapshot at the end "
                    f"of each cycle of whole epochs, and the run has trainer.max_epochs="
                    f"{cfg.trainer.max_epochs}: train at least {cycles} epochs or lower the cycles."
                )


def _cannot_download(datamodule: Any) -> bool:
    """Whether a data module keeps the base class's `download_files`, which downloads nothing."""
    from dbsn.data.base import ImageClassificationDataModule

    return getattr(type(datamodule), "download_files", None) is ImageClassificationDataModule.download_files


def check_run_length(cfg: DictConfig, datamodule: Any) -> int:
    """Refuse, before the network is built, a run that would train no step, or too few for what
    its settings lay out over it (see the module docstring); returns its optimiser steps. A data
    module whose files are still to be downloaded (`data.download=true`) is not read here:
    `check_trained` sees a run of no step after its fit."""
    check_files = getattr(datamodule, "check_files", None)
    if getattr(datamodule, "download", False) and _cannot_download(datamodule):
        raise ConfigError(
            f"data.download=true: {type(datamodule).__name__} has nothing to download (its data ship "
            "with the package that provides them); set data.download=false."
        )
    if check_files is not None and getattr(datamodule, "download", False):
        from dbsn.data.base import DatasetNotFoundError

        try:
            check_files()
        except DatasetNotFoundError:
            return -1
    if not all(hasattr(datamodule, a) for a in ("setup", "batch_size")) or not hasattr(type(datamodule), "num_train"):
        return -1  # a data module of an extension that does not say its size: `check_trained` after the fit
    batches, steps = training_steps(cfg, datamodule)
    _check_evaluation_batches(cfg, datamodule)
    _check_schedules(cfg, batches, steps)
    return steps


def check_trained(trainer) -> None:
    """Refuse to test and report a fit that trained no step (`trainer.global_step` is 0), for
    what `check_run_length` could not see before it (a time limit that ran out first, a data
    module that was downloaded during the fit)."""
    if trainer.global_step > 0:
        return
    reason = " (it was interrupted)" if getattr(trainer, "interrupted", False) else ""
    raise ConfigError(
        f"the fit ended without a training step{reason}: it is no trained model, and nothing was tested "
        f"or reported. Check the run's length (trainer.max_epochs, trainer.max_steps, "
        "trainer.limit_train_batches, callbacks.timer.duration, trainer.max_time) against its data "
        "(data.batch_size, data.drop_last)."
    )


_DATA: dict[str, Any] = {}  # a sweep's data modules by their config: each data set read once


def _datamodule(data: DictConfig) -> Any:
    key = json.dumps(OmegaConf.to_container(data, resolve=True), sort_keys=True, default=str)
    if key not in _DATA:
        _DATA.clear()  # one at a time: a sweep over data sets holds no more than one in memory
        _DATA[key] = instantiate(data)
    return _DATA[key]


def check_job(cfg: DictConfig, output_dir: str | Path | None = None, on_this_machine: bool = True) -> list[dict]:
    """Every cheap check of one composed training job, so that a sweep can refuse a bad job
    before its first job starts: `validate_config` (keys, types, ranges, trainer settings; this
    machine's devices with `on_this_machine`), the checkpoint it resumes (`resume=true` with a
    `last.ckpt` in `output_dir`, or `ckpt_path`) and the settings it changes on resume, and the
    run's length from its data (`check_run_length`; where the data is not on this machine and
    the job runs elsewhere, `on_this_machine=False`, that check is left to the job). Returns the
    changes the resume applies (`dbsn.runtime.resume.check_resume`). `cfg` is not modified."""
    from dbsn.data.base import DatasetNotFoundError
    from dbsn.evaluation.runs import last_checkpoint
    from dbsn.runtime.checkpoint import check_resume_checkpoint
    from dbsn.runtime.resume import check_resume

    job = copy.deepcopy(cfg)
    validate_config(job, on_this_machine=on_this_machine)
    plain_job = OmegaConf.masked_copy(job, [k for k in job.keys() if k != "hydra"])
    checkpoint = None
    if output_dir is not None and job.get("resume") and last_checkpoint(Path(output_dir)).is_file():
        checkpoint = last_checkpoint(Path(output_dir))
    elif job.get("ckpt_path"):
        checkpoint = job.ckpt_path
    changes = []
    if checkpoint is not None:
        checkpoint = check_resume_checkpoint(checkpoint, to_plain(plain_job))
        changes = check_resume(plain_job, checkpoint)
    datamodule = _datamodule(job.data)
    check_files = getattr(datamodule, "check_files", None)
    try:
        if check_files is not None and not getattr(datamodule, "download", False):
            check_files()
    except DatasetNotFoundError:
        if on_this_machine:
            raise
        return changes
    check_run_length(plain_job, datamodule)
    return changes
