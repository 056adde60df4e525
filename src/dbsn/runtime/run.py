"""The two entry points' bodies: `train(cfg, output_dir)` and `evaluate(cfg, output_dir)`.

`train.py` and `evaluate.py` (and the `dbsn-train` / `dbsn-evaluate` commands) only parse the
command line with Hydra and call these, so tests (and DDP child processes, see
`dbsn.runtime.ddp`) run the exact same code on a composed config without Hydra's runtime. Each
goes config -> objects -> fit / evaluate; what is evaluated and how lives in `dbsn.evaluation`
(`Evaluator`), the post-hoc posteriors in `dbsn.posthoc`.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Timer
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from dbsn.evaluation.base import Subject
from dbsn.evaluation.budget import TrainingBudget
from dbsn.evaluation.convergence import TrainingCurve
from dbsn.evaluation.cost import EpochTimer, reset_peak_memory
from dbsn.evaluation.pipeline import Evaluator
from dbsn.evaluation.report import build_sweep_report, check_sweep_report_folder
from dbsn.evaluation.runs import CONFIG_FILE, METRICS_FILE, read_run_record, run_checkpoint
from dbsn.methods import DeepEnsemble, Method
from dbsn.runtime.build import (
    build_model,
    build_trainer,
    count_parameters,
    device_of,
    init_weights,
    instantiate_group,
    load_method,
    with_facts,
)
from dbsn.runtime.checkpoint import (
    CONFIG_KEY,
    RandomStateCallback,
    RunConfigCallback,
    check_resume_checkpoint,
    load_checkpoint,
)
from dbsn.runtime.cluster import PreemptionRequeue, job_facts, write_job_facts
from dbsn.runtime.compile_cache import compile_cache_callbacks
from dbsn.runtime.config import ConfigError, check_evaluate_config, check_trainer, to_plain, validate_config
from dbsn.runtime.disk import OutputError, disk_problem
from dbsn.runtime.errors import RunInterrupted
from dbsn.runtime.evaluation import (
    apply_overrides,
    build_evaluator,
    build_posterior,
    check_prediction_overrides,
    checkpoint_paths,
    evaluation_data,
    evaluation_folder,
    evaluation_samples,
    fatal_in_a_sweep,
    fit_posterior,
    statistics_of,
    write_posthoc_run,
)
from dbsn.runtime.evaluation_folder import (
    check_folder,
    check_run_files,
    evaluation_record,
    evaluation_settings,
    identify,
)
from dbsn.runtime.folder import RunFolder, claim_run_folder, write_hydra_files
from dbsn.runtime.memory import keep_freed_memory
from dbsn.runtime.preflight import check_run_length, check_trained
from dbsn.runtime.rank import is_rank_zero
from dbsn.runtime.resume import check_resume, resume_callbacks
from dbsn.runtime.signals import current_watch, interruptible
from dbsn.runtime.turns import turn_callbacks
from dbsn.runtime.wandb_run import (
    close_loggers,
    evaluation_loggers,
    run_facts,
    run_group,
    run_name,
    stable_wandb_id,
    with_identity,
)

__all__ = ["checkpoint_to_resume", "evaluate", "evaluate_checkpoints", "evaluate_folder", "train"]


def title_of(method: str, data_cfg, n_samples: int) -> str:
    data = str(data_cfg["_target_"]).rsplit(".", 1)[-1].replace("DataModule", "")
    return f"{method} on {data} (S = {n_samples})"


def progress_of(cfg: DictConfig) -> bool:
    return cfg.trainer.get("enable_progress_bar", True) is not False


# ---------------------------------------------------------------------- train
def checkpoint_to_resume(cfg: DictConfig, output_dir: Path) -> Path | None:
    """What the fit starts from: with `resume=true`, the run folder's own `last.ckpt` when there
    is one (a requeued cluster job continues where it stopped), else `ckpt_path` (None: from
    scratch). Checked here, before data or model are built."""
    from dbsn.evaluation.runs import last_checkpoint

    own = last_checkpoint(output_dir)
    if cfg.get("resume") and own.is_file():
        print(f"Resuming from this run's own checkpoint {own}", flush=True)
        return check_resume_checkpoint(own, to_plain(cfg))
    if cfg.get("ckpt_path"):
        return check_resume_checkpoint(cfg.ckpt_path, to_plain(cfg))
    return None


@interruptible
def train(cfg: DictConfig, output_dir: Path, where: str = "hydra.run.dir") -> dict[str, float]:
    """Fit a method, test the final model, write metrics and plots; returns the test metrics.

    The run folder is claimed first (`dbsn.runtime.folder`: one process, one run; `where` names the
    setting that chose it in a refusal), and nothing is written there until every check of the
    start has passed. A signal stops it as `RunInterrupted` (`dbsn.runtime.signals`)."""
    composed = copy.deepcopy(cfg)  # as composed: Hydra's record of it (.hydra/config.yaml)
    validate_config(cfg)
    statistics = statistics_of(cfg)
    keep_freed_memory()
    output_dir = Path(output_dir)
    folder = (
        claim_run_folder(output_dir, resume=bool(cfg.get("resume")), ckpt_path=cfg.get("ckpt_path"), where=where)
        if is_rank_zero()
        else None
    )
    try:
        metrics = _train(cfg, composed, output_dir, statistics, folder)
    except BaseException as err:
        if folder is not None:
            folder.end(
                "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit, RunInterrupted)) else "failed",
                error=f"{type(err).__name__}: {err}"[:500],
            )
        if isinstance(err, OSError) and (problem := disk_problem(err, output_dir)) is not None:
            raise OutputError(
                f"Could not write {err.filename or 'a file'} in the run folder {output_dir}: {problem}. "
                "Free space (or choose a writable folder), then continue with resume=true."
            ) from err
        raise
    else:
        if folder is not None:
            folder.end("finished")
        return metrics
    finally:
        if folder is not None:
            folder.release()


def _begin(
    composed: DictConfig, plain: dict, output_dir: Path, folder: RunFolder, ckpt_path: Path | None, changes: list
) -> None:
    """Write the run's files for this start: the resolved config, Hydra's record, run.json (with the
    settings a resume changed), the log file."""
    if folder.mode == "continue" and ckpt_path is None and (output_dir / METRICS_FILE).is_file():
        raise ConfigError(
            f"{output_dir} holds a finished run without a checkpoint to continue: start the new run in a new folder."
        )
    OmegaConf.save(OmegaConf.create(plain), output_dir / CONFIG_FILE)
    write_hydra_files(output_dir, composed)
    folder.begin(
        changes=changes, continued_from=str(ckpt_path) if ckpt_path is not None and folder.mode == "new" else None
    )
    if HydraConfig.initialized():
        folder.log_to_file(str(HydraConfig.get().job.name))
    if (facts := job_facts()) is not None:  # which SLURM job ran (or resumed) this run, and its logs
        write_job_facts(output_dir, facts)


def _train(
    cfg: DictConfig, composed: DictConfig, output_dir: Path, statistics, folder: RunFolder | None
) -> dict[str, float]:
    """The body of `train` once the folder is claimed (`folder`: None on ranks other than 0)."""
    ckpt_path = checkpoint_to_resume(cfg, output_dir)
    resume_changes = check_resume(cfg, ckpt_path)  # [{"key", "old", "new"}] applied on resume (run history)
    plain = to_plain(cfg)
    if folder is not None:
        _begin(composed, plain, output_dir, folder, ckpt_path, resume_changes)
    run_id = folder.run_id if folder is not None else (read_run_record(output_dir) or {}).get("run_id")
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data)
    check_files = getattr(datamodule, "check_files", None)
    if check_files is not None and not getattr(datamodule, "download", False):
        check_files()  # a missing dataset fails now, before the model, the loggers and the trainer
    check_run_length(cfg, datamodule)  # a run of no step, or too short for its settings, before the model
    model = build_model(cfg.model, datamodule.num_classes)
    if cfg.get("init_from"):
        init_weights(model, cfg.init_from)
    Console().print(f"{type(model).__name__}: {count_parameters(model):,} parameters")
    epoch_timer, curve, budget = EpochTimer(), TrainingCurve(), TrainingBudget()
    callbacks = instantiate_group(cfg.get("callbacks")) + [
        RunConfigCallback(plain, run_id),
        RandomStateCallback(),
        epoch_timer,
        curve,
        budget,
        *resume_callbacks(resume_changes),
        *current_watch(),
        *compile_cache_callbacks(model, output_dir),
        *turn_callbacks(),  # in a group of runs in one process (dbsn.runtime.group): the next run's turn
    ]
    if PreemptionRequeue.active is not None:  # a submitit job on SLURM: requeue at an epoch end when preempted
        callbacks.append(PreemptionRequeue.active)
    facts = run_facts(plain, output_dir)
    logger_cfg, wandb = with_identity(
        cfg.get("logger"),
        lambda: {
            "id": stable_wandb_id(output_dir),
            "group": run_group(output_dir, plain.get("task_name")),
            "name": run_name(facts),
            "job_type": "train",
        },
    )
    loggers = instantiate_group(logger_cfg)
    trainer = build_trainer(cfg.trainer, output_dir, callbacks, loggers)
    try:
        model.check_world_size(trainer.world_size)  # before any data is read
    except ValueError as err:
        raise ConfigError(str(err)) from err
    # structure-parallel: every rank trains on the same batches (its share of the structures)
    datamodule.same_batches_on_every_rank = model.parallel == "structure"
    for logger in loggers:
        logger.log_hyperparams(with_facts(plain, logger, facts, wandb))

    reset_peak_memory(
        trainer.strategy.root_device
    )  # the cost's peak memory: this run's, not an earlier one's in this process
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    check_trained(trainer)
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

    def record() -> dict:
        return {
            "run_id": run_id,
            "n_samples": model.num_members,
            "epochs": trainer.current_epoch,
            "seed": cfg.get("seed"),
            "world_size": trainer.world_size,
            "parallel": model.parallel,
            "train_seconds": train_seconds,
            "convergence": curve.summary(),
            "budget": budget.record(datamodule),
            **model.run_facts(),
            "slurm": job_facts(),
            "last_checkpoint": getattr(trainer.checkpoint_callback, "last_model_path", None),
        }

    subject = Subject(
        model,
        datamodule,
        title_of(type(model).__name__, plain["data"], model.n_samples),
        trainer.strategy.root_device,
        progress_of(cfg),
    )
    metrics = Evaluator(statistics=statistics).evaluate(
        subject, trainer, output_dir, loggers, record, structure=False, epoch_seconds=epoch_timer.mean_epoch_seconds
    )
    close_loggers(loggers, "success", finish_wandb=trainer.is_global_zero)
    return metrics


# ---------------------------------------------------------------------- evaluate
@interruptible(resumable=False)
def evaluate(cfg: DictConfig, output_dir: Path) -> dict:
    """Evaluate a checkpoint, a list of checkpoints (one deep ensemble), or every run in a folder.

    Returns the numbers under flat, stable names: `test/*`, `selective/*`, `ood/<set>/<score>/<metric>`,
    `shift/*`, `adversarial/<attack>/<accuracy|mean_entropy>@<ε>` (for a folder: which runs were
    evaluated). The test pass always runs; `evaluations=[...]` adds the evaluations of
    `conf/evaluations/` (ood, shift, adversarial, or your own), `posthoc=<name>` evaluates a
    post-hoc posterior of the run (`conf/posthoc/`) instead of its own predictive.
    A single checkpoint inside a training run folder is evaluated into `<run>/evaluation`
    (`<run>/posthoc/<name>/evaluation` with a posterior, so the report finds it next to the run);
    otherwise into `output_dir`, unless `cfg.output_dir` says where. Nothing the evaluation did
    not write is overwritten, nor the evaluation of another checkpoint (`evaluation_folder`
    refuses such a folder), and a checkpoint whose run folder holds another run's files is refused.
    """
    check_evaluate_config(cfg)
    check_trainer(cfg.get("trainer"))
    evaluator, posterior = build_evaluator(cfg), build_posterior(cfg)
    check_prediction_overrides(cfg)
    paths = checkpoint_paths(cfg)
    keep_freed_memory()
    if len(paths) == 1 and paths[0].is_dir():
        if cfg.get("output_dir"):
            raise ConfigError(
                f"output_dir={cfg.output_dir} takes one model's results; a folder of runs is evaluated into "
                "each run's own evaluation/ folder (and <folder>/report): leave output_dir unset."
            )
        return evaluate_folder(cfg, paths[0], evaluator, posterior)
    check_run_files(paths)
    identities = identify(paths)
    out = evaluation_folder(cfg, paths, posterior, Path(output_dir), identities)
    return evaluate_checkpoints(cfg, paths, out, evaluator, posterior, identities=identities)


def evaluate_checkpoints(
    cfg: DictConfig,
    paths: list[Path],
    out: Path,
    evaluator: Evaluator,
    posterior=None,
    in_sweep: bool = False,
    identities: list[dict] | None = None,
) -> dict[str, float] | None:
    """The test pass and the chosen evaluations of one model (several paths: a deep ensemble;
    `posterior`: a post-hoc posterior of the run). In a sweep, a run the posterior does not
    apply to is skipped (None). metrics.json records what was evaluated (`identities`, read from
    the checkpoints when not given) and the evaluation's own settings."""
    identities = identify(paths) if identities is None else identities
    first = load_checkpoint(paths[0])
    datamodule = evaluation_data(cfg, first)
    run_data = first[CONFIG_KEY]["data"]
    members = [
        load_method(p, datamodule.num_classes, run_data["_target_"], first if i == 0 else None)
        for i, p in enumerate(paths)
    ]
    model: Method = members[0] if len(members) == 1 else DeepEnsemble(members)
    apply_overrides(model, cfg)
    n_samples = evaluation_samples(cfg, posterior)  # S: the posterior's to use, else the model's
    if posterior is None:
        model.use_samples(n_samples)
    device = device_of(cfg.trainer)
    subject = Subject(model, datamodule, "", device, progress_of(cfg))
    if posterior is not None:
        reason = posterior.why_not(model, first)
        if reason is not None:
            if in_sweep:
                return None
            raise ConfigError(f"{reason}.")
        posterior.check(model, datamodule, first, n_samples)
        evaluator.check(subject)  # before the posterior is fitted
        subject.model = model = fit_posterior(posterior, model, datamodule, first, n_samples, device)
    name = type(model).__name__ + (f" of {len(members)}" if len(members) > 1 else "")
    subject.title = title_of(name, run_data, model.num_members)
    facts = {
        "n_samples": model.num_members,
        "checkpoints": [str(p) for p in paths],
        "epoch": first.get("epoch"),
        **({"posthoc": posterior.name, "seed": first[CONFIG_KEY].get("seed")} if posterior else {}),
        **evaluation_record(identities),
        "settings": evaluation_settings(cfg, posterior),
    }
    loggers = evaluation_loggers(cfg, paths, first[CONFIG_KEY], out, model, posterior)
    trainer = build_trainer(cfg.trainer, out, callbacks=instantiate_group(cfg.get("callbacks")), loggers=loggers)
    try:
        values = evaluator.evaluate(
            subject, trainer, out, loggers, record=lambda: {**facts, **model.run_facts()}, checked=posterior is not None
        )
    except BaseException:
        close_loggers(loggers, "failed")  # else the next run of a folder would log into this W&B run
        raise
    write_posthoc_run(out, first[CONFIG_KEY], posterior)
    close_loggers(loggers, "success")
    return values


def evaluate_folder(cfg: DictConfig, root: Path, evaluator: Evaluator, posterior=None) -> dict:
    """Evaluate every training run under `root` (e.g. a multirun folder) into its own
    `evaluation/` (with a posterior: `posthoc/<name>/evaluation/`, runs it does not apply to
    skipped), then write the report into `<root>/report`. Runs without a checkpoint, or whose
    evaluation fails, are listed; a missing data set or evaluation input stops the sweep."""
    runs = sorted(p.parent for p in root.rglob(CONFIG_FILE) if "evaluation" not in p.parts and "posthoc" not in p.parts)
    if not runs:
        raise ConfigError(
            f"ckpt_path={root} is a folder without training runs (folders with {CONFIG_FILE}): give a "
            "checkpoint (<run>/checkpoints/last.ckpt), a list of them, or a folder of runs (a sweep)."
        )
    check_sweep_report_folder(root)  # before any run is evaluated
    problems: dict[str, str] = {}
    for run_dir in runs:
        ckpt = run_checkpoint(run_dir)
        if ckpt is None:
            problems[str(run_dir)] = "no checkpoint (failed or unfinished run)"
            continue
        out = run_dir / "posthoc" / posterior.name / "evaluation" if posterior else run_dir / "evaluation"
        try:
            check_run_files([ckpt])
            identities = identify([ckpt])
            out = check_folder(out, posterior=posterior, identities=identities, where=None)
            Console().print(f"[bold]Evaluating {ckpt}{f' with posthoc={posterior.name}' if posterior else ''}[/bold]")
            evaluate_checkpoints(cfg, [ckpt], out, evaluator, posterior, in_sweep=True, identities=identities)
        except Exception as err:  # one bad run must not stop the others; it is listed below
            if fatal_in_a_sweep(err):
                raise
            problems[str(run_dir)] = f"{type(err).__name__}: {err}"
    for run, problem in problems.items():
        Console().print(f"[red]not evaluated[/red] {run}: {problem}")
    report = build_sweep_report(
        root, reference=str((cfg.get("report") or {}).get("reference") or "dbsn"), statistics=statistics_of(cfg)
    )
    for line in report.summary:
        Console().print(line)
    Console().print(f"Report: {root / 'report'}")
    return {"runs": [str(r) for r in runs], "not_evaluated": problems, "report": report}
