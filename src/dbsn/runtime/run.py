"""The two entry points' bodies: `train(cfg, output_dir)` and `evaluate(cfg, output_dir)`.

`train.py` and `evaluate.py` at the repository root only parse the command line with Hydra
and call these, so tests (and DDP child processes, see `dbsn.runtime.ddp`) can run the exact same code
on a composed config without Hydra's runtime.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar, Timer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from dbsn.runtime.checkpoint import (CONFIG_KEY, AtomicCheckpointIO, CheckpointError, RandomStateCallback, RunConfigCallback,
                                     check_resume_checkpoint, load_checkpoint)
from dbsn.runtime.cluster import PreemptionRequeue, job_facts, write_job_facts
from dbsn.runtime.config import ConfigError, check_trainer, to_plain, validate_config
from dbsn.runtime.ddp import RunDirDDPStrategy
from dbsn.evaluation.runs import CONFIG_FILE, WANDB_ID_FILE, last_checkpoint, method_and_dataset
from dbsn.runtime.memory import keep_freed_memory
from dbsn.runtime.progress import LineProgress
from dbsn.runtime.rank import is_rank_zero
from dbsn.evaluation.report import build_sweep_report
from dbsn.runtime.wandb_run import (configured_group, logged_to_wandb, run_facts, run_group, run_name,
                                    stable_wandb_id, with_identity)
from dbsn.methods import DBSN, ClassificationMethod, DeepEnsemble
from dbsn.metrics.ablation import SampleAblation
from dbsn.data.shift import CORRUPTIONS, GENERATED_STANDARD, SEVERITIES, is_generated, write_generated_set
from dbsn.evaluation.ood_groups import group_coverage, group_means, openood_groups, per_set_metrics
from dbsn.evaluation.shift import SHIFT_METRICS, shift_evaluation
from dbsn.evaluation.runner import (adversarial, ood_evaluation, prediction_quality, print_table, reliability_table,
                                   write_risk_coverage, write_sample_ablation, write_structure)
from dbsn.evaluation.plots import reliability_diagram, save_figure
from dbsn.evaluation.tracking import log_to_wandb
from dbsn.posthoc import POSTHOC

METRIC_NAMES = ("error", "miou", "global_acc", "nll", "brier", "ece", "predictive_entropy", "expected_entropy",
                "mutual_information")
EVALUATIONS = ("ood", "adversarial", "shift")  # beyond the test pass, which always runs


# ---------------------------------------------------------------------- builders
def build_model(model_cfg: DictConfig | dict, num_classes: int) -> ClassificationMethod:
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


def init_weights(model: ClassificationMethod, path) -> None:
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


def _num_devices(devices: Any, accelerator: str) -> int:
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
    strategy = kwargs.get("strategy", "auto")
    if strategy == "ddp" or (strategy == "auto" and _num_devices(kwargs.get("devices", 1), kwargs.get("accelerator", "auto")) > 1):
        kwargs["strategy"] = RunDirDDPStrategy(run_dir=output_dir)
    return pl.Trainer(**kwargs, callbacks=list(callbacks), logger=list(loggers) or False, plugins=[AtomicCheckpointIO()])


def _with_facts(config: dict, logger, facts: dict, wandb: dict | None, **extra) -> dict:
    """The config a logger records: the run's resolved config plus, for W&B, the flat keys it
    groups and filters runs on (`dbsn.runtime.wandb_run.run_facts`), the sweep and job type."""
    if not isinstance(logger, WandbLogger) or wandb is None:
        return config
    return {**config, **facts, "sweep": wandb["group"], "job_type": wandb["job_type"], **extra}


def _instantiate_group(group: DictConfig | None) -> list:
    if not group:
        return []
    return [instantiate(node) for node in group.values() if node is not None and "_target_" in node]


# ---------------------------------------------------------------------- reporting
@rank_zero_only
def write_test_report(model: ClassificationMethod, metrics: dict[str, float], output_dir: Path,
                      title: str, loggers=(), extra: dict | None = None, structure: bool = True,
                      datamodule=None) -> None:
    """What the test pass gives: metrics.json, reliability_diagram.png, the MC-sample ablation
    (ablation/) and, with `structure`, the learned structure posterior (structure/; a training
    run has it from the `StructurePosteriorMonitor` callback), W&B images, a printed table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {"metrics": metrics, **(extra or {})}
    (output_dir / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    if model.test_predictions is not None:
        log_probs, targets = model.test_predictions
        figure = reliability_diagram(log_probs.exp(), targets, n_bins=10, title=title)
        path = save_figure(figure, output_dir / "reliability_diagram.png")
        log_to_wandb(loggers, images={"test/reliability_diagram": path},
                     tables={"test/reliability_bins": reliability_table(log_probs.exp(), targets)})
        write_risk_coverage(model, output_dir, title, loggers)
    if model.test_maps and datamodule is not None:
        path = save_figure(uncertainty_maps(model.test_maps, datamodule, title), output_dir / "uncertainty_maps.png")
        log_to_wandb(loggers, images={"test/uncertainty_maps": path})
    per_class = [[key.removeprefix("test/iou/"), float(value)] for key, value in metrics.items() if key.startswith("test/iou/")]
    if per_class:
        log_to_wandb(loggers, tables={"test/per_class_iou": (["class", "iou"], per_class)})
    named = [f"test/{name}" for name in METRIC_NAMES if f"test/{name}" in metrics]
    print_table(title, ["metric", "value"], [[key, float(metrics[key])] for key in named + sorted(set(metrics) - set(named))])
    if model.ablation_rows is not None:
        write_sample_ablation(model.ablation_rows, output_dir / "ablation", title, loggers)
    if structure:
        write_structure(model, output_dir / "structure", title, loggers=loggers)
    Console().print(f"Outputs: {output_dir}")


def uncertainty_maps(maps: list[dict], datamodule, title: str):
    """The paper's Figure 2 for the kept test images: input, ground truth, prediction, entropy
    and mutual information (segmentation)."""
    from dbsn.metrics.segmentation import uncertainty_grid

    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (datamodule.mean, datamodule.std))
    rows = [{**m, "image": (m["image"] * std + mean).clamp(0, 1)} for m in maps]
    return uncertainty_grid(rows, datamodule.PALETTE, datamodule.CLASS_NAMES, datamodule.ignore_index,
                            title=f"{title}: pixel-wise uncertainty")


def attach_sample_ablation(model: ClassificationMethod, sizes=None) -> None:
    """Make the next test pass also report the ensembles of the first s members (s in `sizes`,
    default 1..S). Nothing to ablate for a one-member prediction (or, for now, segmentation)."""
    if (sizes is not None and len(sizes) == 0) or not model.task.supports_ablation:
        model.sample_ablation = None
        return
    if model.num_members > 1:
        sizes = None if sizes is None else [s for s in sizes if s <= model.num_members] or [model.num_members]
        model.sample_ablation = SampleAblation(model.num_classes, model.num_members, sizes)


def _test_metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}


def _title(method: str, data_cfg, n_samples: int) -> str:
    data = str(data_cfg["_target_"]).rsplit(".", 1)[-1].replace("DataModule", "")
    return f"{method} on {data} (S = {n_samples})"


# ---------------------------------------------------------------------- entry points
def checkpoint_to_resume(cfg: DictConfig, output_dir: Path) -> Path | None:
    """What the fit starts from: with `resume=true`, the run folder's own `last.ckpt` when there
    is one (a requeued cluster job continues where it stopped), else `ckpt_path` (None: from
    scratch). Checked here, before data or model are built."""
    own = last_checkpoint(output_dir)
    if cfg.get("resume") and own.is_file():
        print(f"Resuming from this run's own checkpoint {own}", flush=True)
        return check_resume_checkpoint(own, to_plain(cfg))
    if cfg.get("ckpt_path"):
        return check_resume_checkpoint(cfg.ckpt_path, to_plain(cfg))
    return None


def train(cfg: DictConfig, output_dir: Path) -> dict[str, float]:
    """Fit a method, test the final model, write metrics and plots; returns the test metrics."""
    validate_config(cfg)
    keep_freed_memory()
    output_dir = Path(output_dir)
    ckpt_path = checkpoint_to_resume(cfg, output_dir)
    plain = to_plain(cfg)
    if is_rank_zero():
        output_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(plain), output_dir / CONFIG_FILE)
        if (facts := job_facts()) is not None:  # which SLURM job ran (or resumed) this run, and its logs
            write_job_facts(output_dir, facts)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data)
    check_files = getattr(datamodule, "check_files", None)
    if check_files is not None and not getattr(datamodule, "download", False):
        check_files()  # a missing dataset fails now, before the model, the loggers and the trainer
    model = build_model(cfg.model, datamodule.num_classes)
    if cfg.get("init_from"):
        init_weights(model, cfg.init_from)
    Console().print(f"{type(model).__name__}: {count_parameters(model):,} parameters")
    callbacks = _instantiate_group(cfg.get("callbacks")) + [RunConfigCallback(plain), RandomStateCallback()]
    if PreemptionRequeue.active is not None:  # a submitit job on SLURM: requeue at an epoch end when preempted
        callbacks.append(PreemptionRequeue.active)
    facts = run_facts(plain, output_dir)
    logger_cfg, wandb = with_identity(cfg.get("logger"), lambda: {
        "id": stable_wandb_id(output_dir), "group": run_group(output_dir, plain.get("task_name")),
        "name": run_name(facts), "job_type": "train"})
    loggers = _instantiate_group(logger_cfg)
    trainer = build_trainer(cfg.trainer, output_dir, callbacks, loggers)
    model.check_world_size(trainer.world_size)  # before any data is read
    # structure-parallel: every rank trains on the same batches (its share of the structures)
    datamodule.same_batches_on_every_rank = model.parallel == "structure"
    for logger in loggers:
        logger.log_hyperparams(_with_facts(plain, logger, facts, wandb))

    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if model.temperature_scaling:
        temperature = model.fit_temperature(datamodule)
        Console().print(f"Temperature fitted on the validation split: T = {temperature:.4f}")
        for logger in loggers:
            logger.log_metrics({"val/temperature": temperature})
        trainer.save_checkpoint(output_dir / "checkpoints" / "calibrated.ckpt")
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    train_seconds = None if timer is None else round(timer.time_elapsed("train"), 1)
    if train_seconds is not None:
        Console().print(f"Training time: {timedelta(seconds=round(train_seconds))} (h:mm:ss, resumed parts included)")
    if not cfg.get("test", True):
        return {}
    attach_sample_ablation(model)
    trainer.test(model, datamodule=datamodule, verbose=False)
    quality = prediction_quality(model)  # not logged by the test pass itself
    log_to_wandb(loggers, quality)
    metrics = {**_test_metrics(trainer), **quality}
    write_test_report(
        model, metrics, output_dir, _title(type(model).__name__, plain["data"], model.n_samples), loggers,
        structure=False, datamodule=datamodule,
        extra={"n_samples": model.num_members, "epochs": trainer.current_epoch, "seed": cfg.get("seed"),
               "world_size": trainer.world_size, "parallel": model.parallel, "train_seconds": train_seconds,
               **model.run_facts(), "slurm": job_facts(),
               "last_checkpoint": getattr(trainer.checkpoint_callback, "last_model_path", None)},
    )
    _close_loggers(loggers, "success", finish_wandb=trainer.is_global_zero)
    return metrics


def _load_method(path, num_classes: int, expected_data: str | None = None) -> ClassificationMethod:
    checkpoint = load_checkpoint(path)
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


def evaluate(cfg: DictConfig, output_dir: Path) -> dict:
    """Evaluate a checkpoint, a list of checkpoints (one deep ensemble), or every run in a folder.

    Returns the numbers under flat, stable names: `test/*`, `ood/<set>/<score>/<metric>`,
    `adversarial/<attack>/<accuracy|mean_entropy>@<ε>` (for a folder: which runs were evaluated).

    The test pass always runs (metrics, equal-mass and classwise ECE, selective prediction,
    reliability diagram, uncertainty decomposition, the MC-sample ablation, the structure
    posterior); `evaluations` adds `ood` (with near / far means where `ood_groups` or OpenOOD's
    CIFAR groups apply), `adversarial` and `shift`; `posthoc` evaluates a point-estimate run's
    Laplace or SWAG posterior instead of the run's own predictive.
    A single checkpoint inside a training run folder is evaluated into `<run>/evaluation`
    (so the report finds it next to the run); otherwise into `output_dir`, unless
    `cfg.output_dir` says where.
    """
    unknown = [e for e in _evaluations(cfg) if e not in EVALUATIONS]
    if unknown:
        raise ConfigError(f"evaluations: unknown {unknown}; choose from {list(EVALUATIONS)} (the test pass always runs).")
    check_trainer(cfg.get("trainer"))
    keep_freed_memory()
    paths = [Path(p) for p in (list(cfg.ckpt_path) if OmegaConf.is_list(cfg.ckpt_path) else [cfg.ckpt_path])]
    if len(paths) == 1 and paths[0].is_dir():
        return evaluate_folder(cfg, paths[0])
    posthoc = _posthoc_name(cfg)
    if cfg.get("output_dir"):
        out = Path(cfg.output_dir)
    elif len(paths) == 1 and (run_dir := paths[0].parent.parent).joinpath(CONFIG_FILE).is_file():
        out = run_dir / "posthoc" / posthoc / "evaluation" if posthoc else run_dir / "evaluation"
    else:
        out = Path(output_dir)
    return evaluate_checkpoints(cfg, paths, out)




def _posthoc_name(cfg: DictConfig) -> str | None:
    name = cfg.get("posthoc")
    if name is not None and name not in POSTHOC:
        raise ConfigError(f"posthoc={name}: choose one of {list(POSTHOC)} (or null: the run's own predictive).")
    return name


def _posthoc_model(cfg: DictConfig, name: str, model: ClassificationMethod, datamodule, path: Path,
                   checkpoint: dict, device: torch.device) -> ClassificationMethod:
    """The finished point-estimate run `model` with a post-hoc posterior: a last-layer Laplace
    (fitted now: curvature on the training split, prior precision on the validation split, or by
    the marginal likelihood on the training split where the run has none) or SWAG (from the
    moments its run collected, `callbacks=swag`)."""
    if isinstance(model, DeepEnsemble) or model.is_stochastic or not model.task.keeps_test_outputs:
        raise ConfigError(f"posthoc={name} works on a point-estimate classifier (map, map_fixed, a deep-ensemble "
                          f"member's run); this checkpoint is {type(model).__name__}.")
    settings = dict(cfg.get(name) or {})
    model.to(device)
    if name == "laplace":
        from dbsn.posthoc.laplace import fit_laplace_on

        datamodule.setup("fit")
        prior = settings.get("prior_precision")
        if prior is None:
            prior = "gridsearch" if datamodule.has_val else "marglik"
        elif not isinstance(prior, str) and not float(prior) > 0:
            raise ConfigError(f"laplace.prior_precision={prior}: a prior precision must be positive (or gridsearch, "
                              "marglik, null).")
        if prior == "gridsearch" and not datamodule.has_val:
            raise ConfigError("posthoc=laplace with laplace.prior_precision=gridsearch fits the prior precision on the "
                              "validation split, and this run has none (data.val_size=0): use "
                              "laplace.prior_precision=marglik (training data only), or train with data.val_size.")
        Console().print(f"Fitting a last-layer Laplace ({settings.get('hessian', 'kron')} Hessian, prior precision: {prior})")
        fitted = fit_laplace_on(model, datamodule, hessian_structure=settings.get("hessian", "kron"),
                                prior_precision=prior, n_samples=int(cfg.get("n_samples") or settings.get("n_samples") or 30))
        Console().print(f"Prior precision λ = {fitted.prior_precision:.4g}")
        return fitted
    from dbsn.posthoc.swag import SWAGMethod, load_swag_state

    try:
        state = load_swag_state(checkpoint)  # `path`, loaded once
    except (KeyError, ValueError) as err:
        raise ConfigError(f"posthoc=swag needs the SWAG moments its run collected, and {path} has none ({err}): train "
                          "with callbacks=swag (e.g. python train.py model=map_fixed callbacks=swag).") from err
    snapshots = int(state["moments"]["count"])
    if snapshots < 2:
        raise ConfigError(f"posthoc=swag needs at least 2 collected snapshots of the weights, and {path} has "
                          f"{snapshots}: collect over more epochs (callbacks.swag.start earlier, or more epochs) or "
                          "after every step (callbacks.swag.collect=step).")
    return SWAGMethod(model, state, n_samples=int(cfg.get("n_samples") or settings.get("n_samples") or 30),
                      scale=float(settings.get("scale", 0.5)))


def _evaluations(cfg: DictConfig) -> list[str]:
    chosen = cfg.get("evaluations") or []
    return [chosen] if isinstance(chosen, str) else list(chosen)


def _device(trainer_cfg) -> torch.device:
    wants_gpu = trainer_cfg.get("accelerator", "auto") in ("auto", "gpu", "cuda")
    return torch.device("cuda") if wants_gpu and torch.cuda.is_available() else torch.device("cpu")


def evaluate_checkpoints(cfg: DictConfig, paths: list[Path], out: Path) -> dict[str, float]:
    """The test pass and the chosen evaluations of one model (several paths: a deep ensemble)."""
    first = load_checkpoint(paths[0])
    ood_sets = _ood_sets(cfg) if "ood" in _evaluations(cfg) else {}  # built (names checked) before the test pass
    data_cfg = OmegaConf.create(first[CONFIG_KEY]["data"])
    if cfg.get("data_root") is not None:
        data_cfg.root = cfg.data_root
    if cfg.get("batch_size") is not None:
        data_cfg.eval_batch_size = cfg.batch_size
    datamodule = instantiate(data_cfg)

    members = [_load_method(p, datamodule.num_classes, first[CONFIG_KEY]["data"]["_target_"]) for p in paths]
    model = members[0] if len(members) == 1 else DeepEnsemble(members)
    posthoc = _posthoc_name(cfg)
    if posthoc:
        model = _posthoc_model(cfg, posthoc, model, datamodule, paths[0], first, _device(cfg.trainer))
    if _evaluations(cfg) and not model.task.keeps_test_outputs:
        raise ConfigError(f"evaluations={_evaluations(cfg)} are defined for classifiers; this is a segmentation model.")
    for method in model.modules():  # evaluation-time overrides reach ensemble members too
        if isinstance(method, ClassificationMethod):
            if cfg.get("n_samples") is not None:
                method.n_samples = int(cfg.n_samples)
            if cfg.get("samples_per_forward") is not None:
                method.samples_per_forward = int(cfg.samples_per_forward)
            if isinstance(method, DBSN):
                if cfg.get("test_tau") is not None:
                    method.test_tau = float(cfg.test_tau)
                changes = {k: v for k, v in (cfg.get("bn_recalibration") or {}).items() if v is not None}
                method.bn_recalibration = replace(method.bn_recalibration, **changes)

    name = type(model).__name__ + (f" of {len(members)}" if len(members) > 1 else "")
    title = _title(name, data_cfg, model.num_members)
    facts = {"n_samples": model.num_members, "checkpoints": [str(p) for p in paths], "epoch": first.get("epoch"),
             **({"posthoc": posthoc, "seed": first[CONFIG_KEY].get("seed")} if posthoc else {})}
    if posthoc and out.name == "evaluation" and out.parent.parent.name == "posthoc":
        _write_posthoc_run(out.parent, first[CONFIG_KEY], posthoc)
    loggers = _evaluation_loggers(cfg, paths, first[CONFIG_KEY], out, model)
    try:
        results = _run_evaluations(cfg, model, datamodule, ood_sets, out, title, loggers, facts)
    except BaseException:
        _close_loggers(loggers, "failed")  # else the next run of a folder would log into this W&B run
        raise
    _close_loggers(loggers, "success")
    return results


def _posthoc_applies(posthoc: str, run_dir: Path, ckpt: Path) -> bool:
    """Whether a run of a sweep gets the post-hoc posterior: point-estimate classifiers (Laplace),
    runs that collected SWAG moments (SWAG)."""
    config = _load_run_config(run_dir)
    method, _ = method_and_dataset(run_dir, config)
    if posthoc == "laplace":
        return method in ("map", "map_fixed")
    from dbsn.posthoc.swag import load_swag_state

    try:
        load_swag_state(ckpt)
    except (KeyError, ValueError):
        return False
    return True


def _write_posthoc_run(folder: Path, run_config: dict, posthoc: str) -> None:
    """`<run>/posthoc/<name>/` reads as a run of its own to the report: the training run's config
    with `posthoc: <name>` (its method); `_run_evaluations` copies the test pass's metrics.json
    beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create({**run_config, "posthoc": posthoc}), folder / CONFIG_FILE)


def _close_loggers(loggers, status: str, finish_wandb: bool = True) -> None:
    """Finalize the loggers; finishing a W&B run writes its summary (offline runs: for `wandb sync`)."""
    for logger in loggers:
        logger.finalize(status)
        if isinstance(logger, WandbLogger) and finish_wandb:
            logger.experiment.finish(exit_code=0 if status == "success" else 1)


def _run_evaluations(cfg: DictConfig, model: ClassificationMethod, datamodule, ood_sets: dict, out: Path, title: str,
                     loggers: list, facts: dict) -> dict[str, float]:
    """The test pass (its report records `facts`), then the chosen evaluations; the numbers under flat names."""
    trainer = build_trainer(cfg.trainer, out, callbacks=_instantiate_group(cfg.get("callbacks")), loggers=loggers)
    attach_sample_ablation(model, (cfg.get("ablation") or {}).get("sizes"))
    trainer.test(model, datamodule=datamodule, verbose=False)
    quality = prediction_quality(model)  # not logged by the test pass itself
    log_to_wandb(loggers, quality)
    metrics = {**_test_metrics(trainer), **quality}
    write_test_report(model, metrics, out, title, loggers, datamodule=datamodule, extra={**facts, **model.run_facts()})
    if facts.get("posthoc") and (out.parent / CONFIG_FILE).is_file():
        shutil.copyfile(out / "metrics.json", out.parent / "metrics.json")  # the post-hoc method's own run record
    results = dict(metrics)  # flat names (on W&B the same, but attacks are curves against adversarial/epsilon)
    device, progress = _device(cfg.trainer), cfg.trainer.get("enable_progress_bar", True) is not False
    model.to(device)
    for name, ood_datamodule in ood_sets.items():  # one in-distribution pass (the test pass's scores) for all sets
        ood = ood_evaluation(model, datamodule, ood_datamodule, model.test_scores, out / "ood" / name, device,
                             title, loggers, progress, set_name=name)
        results.update({f"ood/{name}/{score}/{k}": v for score, m in ood["scores"].items() for k, v in m.items()})
    if ood_sets:
        results.update(_ood_group_means(cfg, datamodule, results, out, loggers))
    if "shift" in _evaluations(cfg):
        results.update(_shift(cfg, model, datamodule, out, device, title, loggers, progress))
    if "adversarial" in _evaluations(cfg):
        settings = OmegaConf.to_container(cfg.adversarial, resolve=True)
        rows = adversarial(model, datamodule, settings, out / "adversarial", device, title, loggers, progress)
        results.update({f"adversarial/{r['attack']}/{k}@{r['epsilon']:g}": r[k] for r in rows
                        for k in ("accuracy", "mean_entropy")})
    return results


def _ood_group_means(cfg: DictConfig, datamodule, results: dict, out: Path, loggers) -> dict[str, float]:
    """Near- and far-OOD means (`ood/near/...`, `ood/far/...`) over the evaluated sets of each
    group: `ood_groups` where the config gives them, else OpenOOD v1.5's for CIFAR-10 / -100."""
    given = cfg.get("ood_groups")
    if given:
        groups = {str(k): list(v) for k, v in given.items()}
    else:
        try:
            groups = openood_groups(datamodule.name)
        except KeyError:  # no standard grouping for this in-distribution set
            return {}
    per_set = per_set_metrics(results)
    groups = {name: c["evaluated"] for name, c in group_coverage(per_set, groups).items() if c["evaluated"]}
    if not groups:
        return {}
    means = group_means(per_set, groups)
    (out / "ood").mkdir(parents=True, exist_ok=True)
    (out / "ood" / "groups.json").write_text(json.dumps({"groups": groups, "metrics": means}, indent=2) + "\n")
    log_to_wandb(loggers, means)
    return means


def shift_plan(settings, folder: Path) -> tuple[bool, list[str]]:
    """Whether `evaluations=[shift]` generates a corrupted set into `folder`, and the corruptions it
    evaluates: files already there win over `shift.generate=true` (published or generated, never
    overwritten); without `shift.corruptions`, the 15 standard ones, or the 14 of them the generator
    makes (not frost) for a generated set."""
    generate = bool(settings.get("generate")) and not (Path(folder) / "labels.npy").is_file()
    default = GENERATED_STANDARD if generate or is_generated(folder) else CORRUPTIONS
    return generate, list(settings.get("corruptions") or default)


def _shift(cfg: DictConfig, model, datamodule, out: Path, device, title: str, loggers, progress: bool) -> dict[str, float]:
    """Dataset shift on the published CIFAR-10-C / -100-C files, or on a generated set
    (`shift.generate=true` writes one from the test set where the folder has none)."""
    settings = cfg.get("shift") or {}
    folder = Path(settings.get("root") or Path(datamodule.root) / f"{datamodule.name}-C")
    generate, corruptions = shift_plan(settings, folder)
    if generate:
        datamodule.setup("test")
        Console().print(f"Generating {len(corruptions)} corruptions of the {datamodule.name} test set into {folder} "
                        "(labelled as generated; not the published files)")
        write_generated_set(folder, datamodule.test_set.images, datamodule.test_set.labels, corruptions,
                            seed=int(settings.get("seed", 0)), source=f"{datamodule.name} test set")
    record = shift_evaluation(model, datamodule, folder, corruptions, list(settings.get("severities") or SEVERITIES),
                              out / "shift", device, title, loggers, progress, int(settings.get("batch_size") or 500))
    means = record["metrics"]
    print_table(f"Shift, {'generated' if record['generated'] else 'published'}: mean of {len(corruptions)} corruptions",
                ["severity", *SHIFT_METRICS],
                [[str(sv), *(means[f"shift/mean/{sv}/{m}"] for m in SHIFT_METRICS)] for sv in record["severities"]]
                + [["all", *(means[f"shift/mean/{m}"] for m in SHIFT_METRICS)]])
    return {**means, "shift/generated": float(record["generated"])}


def _ood_sets(cfg: DictConfig) -> dict[str, Any]:
    """The OOD data modules of `ood=<set>` or `ood=[<set>,<set>,...]`, by set name."""
    chosen = cfg.get("ood") or {}
    if not chosen or "_target_" in chosen:
        raise ConfigError("ood: choose one or more OOD sets by name, e.g. ood=svhn or ood=[svhn,cifar100,photos] "
                          "(conf/ood/ lists them; a set's file holds its settings under its own name, "
                          "e.g. conf/ood/svhn.yaml starts with 'svhn:').")
    return {str(name): instantiate(node) for name, node in chosen.items()}


def _evaluation_loggers(cfg: DictConfig, paths: list[Path], train_config: dict, out: Path, model) -> list:
    """The evaluation's loggers. A W&B logger logs into a run linked to the training run (see
    `dbsn.runtime.wandb_run`): the training run's group and name, job type `evaluate`, the
    training runs' W&B ids, the evaluation's settings under `evaluation`, S as evaluated; its id
    is kept in `out`. A deep ensemble of several runs is its own method, `deep_ensemble`."""
    run_dirs = [p.parent.parent for p in paths]
    in_runs = all((d / CONFIG_FILE).is_file() for d in run_dirs)
    run_dir = run_dirs[0] if in_runs else out
    facts = {**run_facts(train_config, run_dir), "S": model.num_members}
    if len(paths) > 1:
        facts.update(method="deep_ensemble", members=f"{len(paths)} x {facts['method']}", seed=None)
    posthoc = _posthoc_name(cfg)
    if posthoc:  # a method of its own (as in the report), on top of the run's
        facts.update(method=posthoc, posthoc=posthoc, base_method=facts["method"])
    name = run_name(facts) if len(paths) == 1 else f"deep_ensemble {facts['dataset']} {facts['members']}"
    group = (configured_group(train_config) or run_group(run_dir, train_config.get("task_name")) if in_runs
             else run_group(out, cfg.get("task_name")))
    logger_cfg, wandb = with_identity(cfg.get("logger"), lambda: {
        "id": stable_wandb_id(out), "group": group, "name": name, "job_type": "evaluate"}, save_dir=out)
    loggers = _instantiate_group(logger_cfg)
    if wandb is None:
        return loggers
    train_ids = [(d / WANDB_ID_FILE).read_text().strip() for d in run_dirs
                 if in_runs and logged_to_wandb(_load_run_config(d)) and (d / WANDB_ID_FILE).is_file()]
    settings = {k: v for k, v in to_plain(cfg).items() if k not in ("logger", "hydra", "paths", "callbacks", "trainer")}
    links = {"train_run_id": train_ids[0]} if len(paths) == 1 and train_ids else {"train_run_ids": train_ids}
    for logger in loggers:
        logger.log_hyperparams(_with_facts(train_config, logger, facts, wandb, evaluation=settings,
                                           checkpoints=[str(p) for p in paths], **links))
    return loggers


def _load_run_config(run_dir: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(run_dir / CONFIG_FILE), resolve=False)


def _run_checkpoint(run_dir: Path) -> Path | None:
    """The final model of a training run: the temperature-calibrated one if there is one."""
    for name in ("calibrated.ckpt", "last.ckpt"):
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    return None


def evaluate_folder(cfg: DictConfig, root: Path) -> dict:
    """Evaluate every training run under `root` (e.g. a multirun folder) into its own
    `evaluation/`, then write the report (Tables 1 and 2, OOD and adversarial summaries) into
    `<root>/report`. Runs without a checkpoint, or whose evaluation fails, are listed."""
    runs = sorted(p.parent for p in root.rglob(CONFIG_FILE) if "evaluation" not in p.parts and "posthoc" not in p.parts)
    if not runs:
        raise FileNotFoundError(f"No training runs (folders with {CONFIG_FILE}) under {root}.")
    posthoc = _posthoc_name(cfg)
    problems: dict[str, str] = {}
    for run_dir in runs:
        ckpt = _run_checkpoint(run_dir)
        if ckpt is None:
            problems[str(run_dir)] = "no checkpoint (failed or unfinished run)"
            continue
        if posthoc and not _posthoc_applies(posthoc, run_dir, ckpt):
            continue  # e.g. a DBSN run in a sweep evaluated with posthoc=laplace: only its point-estimate runs
        Console().print(f"[bold]Evaluating {ckpt}{f' with posthoc={posthoc}' if posthoc else ''}[/bold]")
        try:
            out = run_dir / "posthoc" / posthoc / "evaluation" if posthoc else run_dir / "evaluation"
            evaluate_checkpoints(cfg, [ckpt], out)
        except Exception as err:  # one bad run must not stop the others; it is listed below
            problems[str(run_dir)] = f"{type(err).__name__}: {err}"
    for run, problem in problems.items():
        Console().print(f"[red]not evaluated[/red] {run}: {problem}")
    report = build_sweep_report(root)
    Console().print(f"Report: {root / 'report'}")
    return {"runs": [str(r) for r in runs], "not_evaluated": problems, "report": report}
