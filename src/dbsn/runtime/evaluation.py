"""What `evaluate.py`'s config builds, and where its results may go.

- `build_evaluator`: the evaluations chosen by `evaluations=[...]` (`conf/evaluations/<name>.yaml`,
  instantiated by their `_target_`), in an `Evaluator`;
- `build_posterior`: the post-hoc posterior of `posthoc=<name>` (`conf/posthoc/<name>.yaml`);
- `checkpoint_paths`, `evaluation_data`: the checkpoints and the data they were trained on, with
  the evaluation's own overrides (`data_root`, `batch_size`); `evaluation_samples`: S, resolved
  once; `apply_overrides`: the other prediction settings; `fit_posterior`: the posterior with S;
- `evaluation_folder`: where a model's results go, refusing a folder the evaluation did not make
  for the same checkpoints (`dbsn.runtime.evaluation_folder`).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dbsn import conf_choices
from dbsn.data.base import DatasetNotFoundError
from dbsn.evaluation.base import EvaluationError
from dbsn.evaluation.pipeline import Evaluator
from dbsn.evaluation.runs import CONFIG_FILE, METRICS_FILE
from dbsn.evaluation.statistics import Statistics
from dbsn.methods import DBSN, Method
from dbsn.posthoc.base import PosthocError, PosthocPosterior
from dbsn.runtime.checkpoint import CONFIG_KEY
from dbsn.runtime.config import ConfigError, check_node
from dbsn.runtime.evaluation_folder import evaluation_folder  # re-exported: where one model's results go
from dbsn.runtime.memory import release_freed_memory

__all__ = [
    "apply_overrides",
    "build_evaluator",
    "build_posterior",
    "checkpoint_paths",
    "evaluation_data",
    "evaluation_folder",
    "evaluation_samples",
    "fatal_in_a_sweep",
    "fit_posterior",
    "write_posthoc_run",
]


def _build(node: DictConfig, where: str) -> Any:
    """`instantiate(node)`, its keys checked against the constructor first; a constructor's
    refusal becomes a `ConfigError` naming the config key."""
    check_node(node, where)
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__ or err
        if isinstance(cause, (EvaluationError, PosthocError)):  # their messages name the key
            raise cause from None
        if isinstance(cause, (ValueError, TypeError)):
            raise ConfigError(f"{where}: {cause}") from err
        raise


def build_evaluator(cfg: DictConfig) -> Evaluator:
    """The chosen evaluations, built (and their settings checked) before any checkpoint is read."""
    chosen = cfg.get("evaluations")
    chosen = OmegaConf.create({}) if chosen is None else chosen
    if not isinstance(chosen, DictConfig):
        raise ConfigError(
            f"evaluations={OmegaConf.to_container(chosen) if OmegaConf.is_config(chosen) else chosen}: "
            "choose evaluations by name, e.g. evaluations=[ood,shift] (conf/evaluations/ lists them)."
        )
    if cfg.get("ood") and "ood" not in chosen:
        raise ConfigError(
            f"ood={list(cfg.ood)} chooses the sets of the OOD evaluation, which is not chosen: add "
            "evaluations=[ood] (with any others, e.g. evaluations=[ood,shift])."
        )
    for group in ("ood", "ood_score"):  # each OOD set and score on its own first, so a refusal names its key
        for name, node in (cfg.get(group) or {}).items():
            _build(node, f"{group}.{name}")
    evaluations = [_build(node, f"evaluations.{name}") for name, node in chosen.items()]
    sizes = (cfg.get("ablation") or {}).get("sizes")
    try:
        return Evaluator(
            evaluations, None if sizes is None else list(sizes), statistics_of(cfg), between_steps=release_freed_memory
        )
    except EvaluationError as err:
        raise ConfigError(str(err)) from err


def statistics_of(cfg: DictConfig) -> Statistics:
    """The evaluation's seed and bootstrap (`statistics.*`), checked."""
    node = cfg.get("statistics") or {}
    unknown = sorted(set(node) - {"seed", "resamples", "level"})
    if unknown:
        raise ConfigError(f"statistics.{unknown[0]} is not a setting: statistics takes seed, resamples and level.")
    try:
        return Statistics(**{k: v for k, v in node.items() if v is not None})
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err


def build_posterior(cfg: DictConfig) -> PosthocPosterior | None:
    """The post-hoc posterior of `posthoc=<name>`, or None."""
    node = cfg.get("posthoc")
    if not node:
        return None
    if not isinstance(node, DictConfig) or "_target_" not in node:
        names = ", ".join(conf_choices("posthoc"))
        raise ConfigError(
            f"posthoc={node}: choose a post-hoc posterior by name, e.g. posthoc=laplace "
            f"(conf/posthoc/ lists them: {names})."
        )
    posterior = _build(node, "posthoc")
    if not isinstance(posterior, PosthocPosterior):
        raise ConfigError(f"posthoc: {type(posterior).__name__} is not a dbsn.posthoc.PosthocPosterior")
    return posterior


def checkpoint_paths(cfg: DictConfig) -> list[Path]:
    """`ckpt_path`: one checkpoint, a list of them, or a folder of runs."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or cfg.get("ckpt_path") in (None, "", []):
        raise ConfigError(
            "ckpt_path is needed: a checkpoint (ckpt_path=<run>/checkpoints/last.ckpt), a list of "
            "checkpoints (ckpt_path=[a.ckpt,b.ckpt]: one deep ensemble) or a folder of runs "
            "(ckpt_path=<sweep folder>: every run, then the report)."
        )
    value = cfg.ckpt_path
    paths = [Path(p) for p in (list(value) if OmegaConf.is_list(value) else [value])]
    if len(paths) > 1 and any(p.is_dir() for p in paths):
        raise ConfigError(
            f"ckpt_path={[str(p) for p in paths]}: a list takes checkpoint files (a deep ensemble); "
            "evaluate a folder of runs on its own (ckpt_path=<folder>)."
        )
    return paths


def evaluation_data(cfg: DictConfig, checkpoint: dict) -> Any:
    """The data module the checkpoint's run was trained on (`data_root`, `batch_size`: this
    machine's folder and batch size), its files checked before any model is built."""
    data_cfg = OmegaConf.create(checkpoint[CONFIG_KEY]["data"])
    if cfg.get("data_root") is not None:
        data_cfg.root = cfg.data_root
    if cfg.get("batch_size") is not None:
        data_cfg.eval_batch_size = cfg.batch_size
    datamodule = instantiate(data_cfg)
    if getattr(datamodule, "download", False):
        datamodule.prepare_data()
    check_files = getattr(datamodule, "check_files", None)
    if check_files is not None:
        check_files()
    return datamodule


def evaluation_samples(cfg: DictConfig, posterior: PosthocPosterior | None) -> int | None:
    """S, the members the evaluated model predicts with, resolved once for the evaluation:
    `evaluate.py n_samples=` when given, else the post-hoc posterior's own `n_samples`, else None
    (the trained method's own S). The runtime gives it to the model (`Method.use_samples`) or to
    the posterior (its `check` and `fit`), never both."""
    if cfg.get("n_samples") is not None:
        return int(cfg.n_samples)
    return None if posterior is None else posterior.n_samples


def check_prediction_overrides(cfg: DictConfig) -> None:
    """Refuse an evaluation's S or forward size below 1 in one line, before any checkpoint is read
    (in a folder of runs, before the first)."""
    if cfg.get("n_samples") is not None and int(cfg.n_samples) < 1:
        raise ConfigError(f"n_samples must be >= 1 (or null: the posterior's or the run's own S), got {cfg.n_samples}.")
    for key in ("samples_per_forward", "rows_per_forward"):
        if cfg.get(key) is not None and int(cfg[key]) < 1:
            raise ConfigError(f"{key} must be >= 1 (or null: as in the run), got {cfg[key]}.")


def apply_overrides(model: Method, cfg: DictConfig) -> None:
    """The evaluation's prediction settings but S (`evaluation_samples`), on every method inside
    `model` (an ensemble's members too): members and rows per forward, DBSN's `test_tau` and
    BatchNorm statistics (checked by `check_prediction_overrides`)."""
    for method in model.modules():
        if not isinstance(method, Method):
            continue
        if cfg.get("samples_per_forward") is not None:
            method.samples_per_forward = int(cfg.samples_per_forward)
        if cfg.get("rows_per_forward") is not None:
            method.prediction = replace(method.prediction, rows_per_forward=int(cfg.rows_per_forward))
        if isinstance(method, DBSN):
            if cfg.get("test_tau") is not None:
                method.test_tau = float(cfg.test_tau)
            changes = {k: v for k, v in (cfg.get("bn_recalibration") or {}).items() if v is not None}
            method.bn_recalibration = replace(method.bn_recalibration, **changes)


def fit_posterior(
    posterior: PosthocPosterior,
    model: Method,
    datamodule,
    checkpoint: dict,
    n_samples: int | None,
    device: torch.device,
) -> Method:
    """`posterior` fitted on the finished `model` on `device`, predicting with S = `n_samples`
    members (`evaluation_samples`; None: the method's own)."""
    model.to(device)
    return posterior.fit(model, datamodule, checkpoint, n_samples)


def write_posthoc_run(out: Path, run_config: dict, posterior: PosthocPosterior | None) -> None:
    """`<run>/posthoc/<name>/` reads as a run of its own to the report: the training run's config
    with `posthoc: <name>` (its method) and the evaluation's metrics.json. Only there: with
    `output_dir` elsewhere the evaluation folder holds the results alone."""
    if (
        posterior is None
        or out.name != "evaluation"
        or out.parent.parent.name != "posthoc"
        or out.parent.name != posterior.name
        or not (out.parent.parent.parent / CONFIG_FILE).is_file()
    ):
        return
    folder = out.parent
    OmegaConf.save(OmegaConf.create({**run_config, "posthoc": posterior.name}), folder / CONFIG_FILE)
    shutil.copyfile(out / METRICS_FILE, folder / METRICS_FILE)


def fatal_in_a_sweep(error: BaseException) -> bool:
    """Errors that stop the evaluation of a sweep instead of being listed for one run: the same
    missing data set or evaluation input would fail every run."""
    return isinstance(error, (EvaluationError, DatasetNotFoundError))
