"""A resumed run continues the run its checkpoint holds, or applies the changes the user lists.

Lightning restores a checkpoint's optimisers (their param groups) and lr schedules over the ones
this run configured, so a setting given on resume that differs from the checkpoint's run would be
recorded but not applied (`model.optim.lr=0.5 ckpt_path=<ckpt>` would train at the checkpoint's
0.1). `check_resume` therefore compares this run's config with the checkpoint's (`dbsn_config`,
key by key) and refuses, in one line naming each key and both values, every difference in a
setting that changes the run, unless the user lists it in `resume_changes=[...]`:

- free keys (`FREE`: outputs and their display, how data is read, the prediction's settings,
  `test`, `statistics`, ...) may differ and are used as given;
- a listed key is applied: what is built from the config at every start takes the new value;
  what the checkpoint restores (param groups, lr schedules) is set again by `ApplyResumeChanges`,
  the lr at the schedule's current epoch; the changes are returned (`[{"key", "old", "new"}]`);
- keys a restored state cannot take (`FIXED`: the network, the method, the weights' posterior,
  what only initialises, the seed), and any change after which the checkpoint's tensors no longer
  fit, are refused even when listed, pointing to `init_from=<ckpt>`.

A requeued job and a resume with no change pass untouched and stay bit for bit the uninterrupted
run. User guide: docs/training.md ("Evaluation and resume").
"""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from dbsn.evaluation.runs import OUTSIDE_THE_RUN, flatten_config, under
from dbsn.runtime.config import ConfigError, to_plain
from dbsn.runtime.config_errors import suggest

__all__ = [
    "FIXED",
    "FREE",
    "RESUME_CHANGES",
    "ApplyResumeChanges",
    "check_resume",
    "config_differences",
    "resume_callbacks",
]

#: The top-level option that lists the settings a resume changes.
RESUME_CHANGES = "resume_changes"

#: Keys (and the keys below them) that do not change the run: they may differ on resume.
FREE = (
    *OUTSIDE_THE_RUN,
    "init_from",  # init_from's weights are replaced by the checkpoint's on resume
    "model.prediction",
    "model.member.prediction",
    "model.bn_recalibration",
    "model.member.bn_recalibration",
    "model.test_tau",
    "model.member.test_tau",
    "trainer.inference_mode",
    "trainer.limit_test_batches",
    "trainer.limit_predict_batches",
)

#: Callbacks that only show, time or save the run: their settings may differ on resume.
FREE_CALLBACKS = (
    "ModelCheckpoint",
    "Timer",
    "LearningRateMonitor",
    "RichProgressBar",
    "TQDMProgressBar",
    "ModelSummary",
    "RichModelSummary",
    "StructurePosteriorMonitor",
    "LineProgress",
)

#: Keys a restored state cannot take, and why; refused even when listed in resume_changes.
FIXED = {
    "model._target_": "the checkpoint holds another method's state",
    "model.member._target_": "the checkpoint holds another method's state",
    "model.net": "the checkpoint's weights have the shape of its own network",
    "model.member.net": "the checkpoint's weights have the shape of its own network",
    "model.size": "the checkpoint holds its own number of members",
    "model.weights": "the checkpoint's weights have the form of their own posterior",
    "model.member.weights": "the checkpoint's weights have the form of their own posterior",
    "model.learn_structure": "the checkpoint's structure parameters are its own",
    "model.member.learn_structure": "the checkpoint's structure parameters are its own",
    "data._target_": "the checkpoint was trained on its own data",
    "seed": "the checkpoint's random streams continue where they stopped; a seed only starts them",
}


def _target_at(config: dict, key: str) -> str | None:
    node: Any = config
    for part in key.split(".")[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return node.get("_target_") if isinstance(node, dict) else None


_ABSENT = object()


def _default(config: dict, key: str) -> Any:
    """The default of the constructor parameter that `key` sets (where its node has a
    `_target_`), else `_ABSENT`: a key that one config lacks means that default."""
    target = _target_at(config, key)
    if target is None:
        return _ABSENT
    try:
        from hydra.utils import get_object

        obj = get_object(target)
        parameters = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters
    except Exception:  # noqa: BLE001 - a target that does not import: no default known
        return _ABSENT
    parameter = parameters.get(key.rsplit(".", 1)[-1])
    return _ABSENT if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _free(key: str, saved: dict, current: dict) -> bool:
    """Whether `key` does not change the run (`FREE`, or a setting of a callback in `FREE_CALLBACKS`
    in both configs)."""
    if any(under(key, prefix) for prefix in FREE):
        return True
    parts = key.split(".")
    if parts[0] != "callbacks" or len(parts) < 2:
        return False
    names = [
        str(((config.get("callbacks") or {}).get(parts[1]) or {}).get("_target_", "")).rsplit(".", 1)[-1]
        for config in (saved, current)
    ]
    present = [name for name in names if name]
    return bool(present) and all(name in FREE_CALLBACKS for name in present)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def config_differences(saved: dict, current: dict) -> list[dict]:
    """The keys in which the run config `current` differs from the checkpoint's `saved`, free
    keys left out: `[{"key", "old", "new"}]` ("old": the checkpoint's value; a key that one config
    lacks stands for its constructor's default, or `None` where none is known)."""
    old, new = flatten_config(saved), flatten_config(current)
    changes = []
    for key in [*old, *(k for k in new if k not in old)]:
        if _free(key, saved, current):
            continue
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a is _ABSENT:
            a = _default(current, key)
        if b is _ABSENT:
            b = _default(saved, key)
        if a is _ABSENT or b is _ABSENT or not _same(a, b):
            changes.append({"key": key, "old": None if a is _ABSENT else a, "new": None if b is _ABSENT else b})
    return changes


def _listed(cfg: DictConfig) -> list[str]:
    value = cfg.get(RESUME_CHANGES)
    if value is None:
        return []
    items = list(value) if isinstance(value, (ListConfig, list, tuple)) else [value]
    if not all(isinstance(item, str) and item for item in items):
        raise ConfigError(
            f"{RESUME_CHANGES}={OmegaConf.to_container(value) if OmegaConf.is_config(value) else value!r}: "
            "expected a list of config keys, e.g. resume_changes=[model.optim.lr,trainer.max_epochs]."
        )
    return items


def _show(value: Any) -> str:
    return "(not set)" if value is None else str(value)


def _state_fits(cfg: DictConfig, checkpoint: dict) -> str | None:
    """Where the checkpoint's tensors do not fit the model this config builds (built on the meta
    device: no memory, no initialisation), or None; None too where it cannot be built so."""
    from hydra.utils import get_object

    from dbsn.runtime.build import build_model

    try:
        num_classes = int(get_object(cfg.data._target_).num_classes)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_model(cfg.model, num_classes)
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - a model that does not build on the meta device: Lightning checks on load
        return None
    theirs = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return f"its tensor {key} is {theirs.get(key, 'absent')} there and {ours.get(key, 'absent')} here"
    return None


def check_resume(cfg: DictConfig, path: str | Path | None) -> list[dict]:
    """Compare this run's config with the config of the checkpoint it resumes (`path`; None: a
    run from scratch) and return the changes to apply, `[{"key", "old", "new"}]` (see the module
    docstring); refuse, in one line, a change that is not listed in `resume_changes`, and one that
    a restored state cannot take."""
    listed = _listed(cfg)
    if path is None:
        if listed:
            raise ConfigError(
                f"{RESUME_CHANGES}={listed} changes settings of a resumed run, and this run starts from "
                "scratch: give the checkpoint it resumes (ckpt_path=<ckpt>, or resume=true in the run's "
                f"folder), or drop {RESUME_CHANGES}."
            )
        return []
    from dbsn.runtime.checkpoint import CONFIG_KEY, load_checkpoint

    checkpoint = load_checkpoint(path)
    current = to_plain(OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]))
    flat = flatten_config(current)
    for key in listed:
        if not any(under(k, key) for k in flat) and not any(
            under(k, key) for k in flatten_config(checkpoint[CONFIG_KEY])
        ):
            raise ConfigError(
                f"{RESUME_CHANGES} lists '{key}', which is no key of this run's config.{suggest(key, flat)}"
            )
    changes = config_differences(checkpoint[CONFIG_KEY], current)
    for change in changes:
        reason = next((why for prefix, why in FIXED.items() if under(change["key"], prefix)), None)
        if reason is None and "init" in change["key"].rsplit(".", 1)[-1]:
            reason = "it sets only how training starts"
        if reason is not None:
            raise ConfigError(
                f"{change['key']}={_show(change['new'])} differs from {_show(change['old'])} in the "
                f"checkpoint it resumes ({path}), and a resumed run cannot change it: {reason}. Resume "
                f"with {change['key']}={_show(change['old'])}, or start a new run from its weights with "
                f"init_from={path}."
            )
    unlisted = [c for c in changes if not any(under(c["key"], key) for key in listed)]
    if unlisted:
        shown = ", ".join(
            f"{c['key']} (the checkpoint's {_show(c['old'])}, this run's {_show(c['new'])})" for c in unlisted[:6]
        )
        more = f" and {len(unlisted) - 6} more" if len(unlisted) > 6 else ""
        keys = ",".join(c["key"] for c in unlisted[:6])
        raise ConfigError(
            f"this run's config differs from that of the checkpoint it resumes ({path}) in {shown}{more}: "
            "a resumed run restores the checkpoint's optimisers and schedules, so they would not be "
            "applied as given. Resume with the checkpoint's values, or apply the changes with "
            f"{RESUME_CHANGES}=[{keys}], or start a new run from its weights with init_from={path}."
        )
    if any(c["key"].startswith("model.") for c in changes):
        misfit = _state_fits(cfg, checkpoint)
        if misfit is not None:
            keys = ", ".join(c["key"] for c in changes if c["key"].startswith("model."))
            raise ConfigError(
                f"with the changes to {keys}, the checkpoint ({path}) no longer fits the model: {misfit}. "
                f"Resume with its values, or start a new run from its weights with init_from={path}."
            )
    return changes


def _hyperparameters(group: dict) -> dict:
    return {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in group.items()
        if k != "params"
    }


def _set(group: dict, key: str, value: Any) -> None:
    """`group[key] = value`, in place where both are tensors (a captured step reads that tensor)."""
    if isinstance(group.get(key), torch.Tensor):
        group[key].fill_(float(value))
    else:
        group[key] = float(value) if isinstance(value, torch.Tensor) else value


def _scheduled_lrs(scheduler) -> list:
    """The lr of each group at the scheduler's current epoch, computed from its base lrs."""
    if hasattr(scheduler, "_get_closed_form_lr"):
        return scheduler._get_closed_form_lr()
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scheduler.get_lr()


class ApplyResumeChanges(pl.Callback):
    """Applies a resume's listed changes to what the checkpoint restores (see the module
    docstring): at `on_fit_start` (after `configure_optimizers`, before Lightning restores the
    checkpoint's optimisers and schedules) it keeps the param groups and schedules this run
    configured; at `on_train_start` (after the restore) it sets the restored param groups'
    hyperparameters and the schedules' settings from them, and the lr of every group to its
    schedule's value at the current epoch."""

    def __init__(self, changes: list[dict]) -> None:
        self.changes = changes
        self._groups: list[list[dict]] | None = None
        self._schedules: list[dict] | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._groups = [[_hyperparameters(g) for g in opt.param_groups] for opt in trainer.optimizers]
        self._schedules = [
            copy.deepcopy({k: v for k, v in c.scheduler.state_dict().items() if k != "lr_lambdas"})
            for c in trainer.lr_scheduler_configs
        ]

    def on_train_start(self, trainer, pl_module) -> None:
        if self._groups is None:
            return
        scheduled: dict[int, tuple] = {}
        for config, fresh in zip(trainer.lr_scheduler_configs, self._schedules):
            scheduler = config.scheduler
            keep = {
                k: v
                for k, v in scheduler.state_dict().items()
                if k in ("last_epoch", "_step_count", "_is_initial", "_get_lr_called_within_step")
            }
            state = {**fresh, **keep}
            if "lr_lambdas" in scheduler.state_dict():
                state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)
            scheduler.load_state_dict(state)
            lrs = _scheduled_lrs(scheduler)
            scheduled[id(scheduler.optimizer)] = lrs
            scheduler._last_lr = [float(lr) if isinstance(lr, torch.Tensor) else lr for lr in lrs]
        for opt, groups in zip(trainer.optimizers, self._groups):
            lrs = scheduled.get(id(opt))
            for i, (group, fresh) in enumerate(zip(opt.param_groups, groups)):
                for key, value in fresh.items():
                    if key != "lr":
                        _set(group, key, value)
                _set(group, "lr", lrs[i] if lrs is not None else fresh["lr"])
            show = getattr(opt, "_show_lr", None)  # a sampler's lr is its step size at its step count
            if callable(show):
                show()
        self._groups = self._schedules = None


def resume_callbacks(changes: list[dict]) -> list[pl.Callback]:
    """The callbacks that apply a resume's changes: none without changes (a requeued job, a
    resume as it was)."""
    return [ApplyResumeChanges(changes)] if changes else []
