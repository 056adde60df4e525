"""Finding and reading runs for the report: run folders and sweep roots below some folders, each
run's config and metrics.json, and the jobs a sweep should have made but did not (missing)."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dbsn.evaluation.convergence import convergence
from dbsn.evaluation.identity import examine
from dbsn.evaluation.report.folder import ReportFolder
from dbsn.evaluation.runs import CONFIG_FILE, SLURM_FILE, method_and_dataset
from dbsn.evaluation.runs import hydra_choices as _choices

# <run>/posthoc/<name> is a run of its own; `dbsn-compare --tune`'s tuning runs (never tested) are read from
# the tuned run's tuning.json, not as runs
SKIP_DIRS = {"checkpoints", "evaluation", ".hydra", "wandb", "csv", "tune"}


@dataclass
class Run:
    path: Path
    method: str  # the row it is in: its method, and what differs from the method's main setting (`pooling`)
    dataset: str
    seed: object
    status: str  # ok | failed | missing | inconsistent (its files disagree about their run) | repeat (`pooling`)
    metrics: dict = field(default_factory=dict)
    overrides: list = field(default_factory=list)
    note: str = ""
    n_samples: object = None
    train_seconds: float | None = None  # fit wall time (metrics.json; resumed parts included)
    epochs: object = None
    log: str | None = None  # the SLURM job's log file (slurm.json), for runs that did not finish
    intervals: dict = field(default_factory=dict)  # metric -> [low, high], the bootstrap intervals of metrics.json
    cost: dict = field(default_factory=dict)  # metrics.json's cost: parameters, FLOPs per image, epoch time, memory
    calibration: dict = field(default_factory=dict)  # metrics.json's calibration: where the temperature was fitted
    convergence: dict = field(default_factory=dict)  # metrics.json's convergence: the training loss's last tenth
    tuning: dict = field(default_factory=dict)  # tuning.json of `dbsn-compare --tune`: the lr grid, its validation NLLs
    calibrator: str | None = None  # metrics.json's calibrator: the post-hoc calibrator a `posthoc/<name>/` run applied
    config: dict = field(default_factory=dict)  # resolved_config.yaml
    evaluation_settings: dict = field(default_factory=dict)  # an evaluation's metrics.json `settings` (post-hoc runs)
    base_method: str = ""  # the method alone (`method` without the differences of its setting)
    differences: list = field(default_factory=list)  # `key=value` of its setting that differ from its method's main one
    evaluation_differences: list = field(
        default_factory=list
    )  # those of them that are its evaluation's (post-hoc runs)
    stale: str | None = None  # why its evaluation/ is of an earlier checkpoint of the run (`identity.examine`)
    budget: dict = field(default_factory=dict)  # what its training consumed (`training_budget`; post hoc: its run's)

    def __post_init__(self) -> None:
        self.base_method = self.base_method or self.method


@dataclass
class Report:
    out: Path
    runs: list[Run]
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    summary: list[str] = field(
        default_factory=list
    )  # one line per finding the console repeats (indistinguishable differences)
    unconverged: set[str] = field(default_factory=set)  # methods with a run whose training had not converged: marked ‡
    folder: ReportFolder | None = None  # the manifest of the files written (None: not kept, e.g. a section's test)

    def with_status(self, status: str) -> list[Run]:
        return [r for r in self.runs if r.status == status]


# ---------------------------------------------------------------------- reading runs
def _yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def load_run(folder: Path) -> Run:
    config = _yaml(folder / CONFIG_FILE) or _yaml(folder / ".hydra" / "config.yaml") or {}
    method, dataset = method_and_dataset(folder, config)
    run = Run(
        folder,
        method,
        dataset,
        config.get("seed"),
        "failed",
        overrides=_yaml(folder / ".hydra" / "overrides.yaml") or [],
        config=config,
    )
    metrics = folder / "metrics.json"
    slurm = _json(folder / SLURM_FILE)
    if not (folder / CONFIG_FILE).is_file():
        run.note = f"no {CONFIG_FILE}: stopped before training started"
    elif not metrics.is_file():
        run.note = "no metrics.json: failed or unfinished"
    else:
        try:
            record = json.loads(metrics.read_text())
            run.metrics, run.status = dict(record["metrics"]), "ok"
            run.seed, run.n_samples = record.get("seed", run.seed), record.get("n_samples")
            run.train_seconds, run.epochs = record.get("train_seconds"), record.get("epochs")
            run.intervals, run.cost = dict(record.get("intervals") or {}), dict(record.get("cost") or {})
            run.calibration = dict(record.get("calibration") or {})
            run.convergence = dict(record.get("convergence") or {})
            if run.convergence.get("epoch_losses"):  # judged again: the rule of this version, for every run alike
                run.convergence = convergence(run.convergence["epoch_losses"])
            run.tuning = _json(folder / "tuning.json") or {}
            # a posthoc=temperature run of an earlier version names no calibrator
            run.calibrator = record.get("calibrator") or (
                "temperature" if record.get("posthoc") == "temperature" else None
            )
            run.evaluation_settings = dict(record.get("settings") or {})
            trained = _json(folder.parent.parent / "metrics.json") if folder.parent.name == "posthoc" else record
            run.budget = training_budget(trained or {})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            run.note = f"unreadable metrics.json: {err!r}"
    if run.status == "ok":
        disagreement, run.stale = examine(folder)
        if disagreement is not None:
            run.status, run.note = "inconsistent", f"its files are not all this run's: {disagreement}"
    if run.status != "ok" and slurm:
        run.log = slurm.get("stdout")
        if slurm.get("error"):
            run.note += f"; SLURM job {slurm.get('job_id')} failed: {slurm['error'][:300]}"
    return run


#: metrics.json's run facts that belong to a row's budget: cSG-MCMC's temperature and its largest noise a step
BUDGET_FACTS = ("sampler_temperature", "sampler_noise_std_max")


def training_budget(record: dict) -> dict:
    """What a training run's metrics.json says it consumed: `epochs`, `seconds` (the fit's wall
    time), and where recorded (`dbsn.evaluation.budget`) `steps`, `images` (seen), `train_images`
    (the training split's size) and `batch_size`, with `BUDGET_FACTS`; a key not recorded is absent."""
    found = {"epochs": record.get("epochs"), "seconds": record.get("train_seconds"), **(record.get("budget") or {})}
    found.update({key: record[key] for key in BUDGET_FACTS if key in record})
    return {key: value for key, value in found.items() if value is not None}


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def find_folders(dirs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(run folders, sweep roots) below `dirs`."""
    runs, roots = set(), set()
    for top in dirs:
        for here, subdirs, files in os.walk(Path(top).resolve()):
            subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
            here = Path(here)
            if "multirun.yaml" in files:
                roots.add(here)
            if CONFIG_FILE in files or SLURM_FILE in files or "model" in _choices(here):
                runs.add(here)
    return sorted(runs, key=_natural), sorted(roots)


def _natural(path: Path) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts)


# ---------------------------------------------------------------------- sweeps
def _parse_overrides(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([str(o) for o in overrides])


def expected_jobs(root: Path) -> list[dict[str, str]]:
    """Every job's overrides ({key: value}) that the sweep at `root` launches (BasicSweeper rules:
    the sweeper's params, then the command line's overrides, a later key replacing an earlier one)."""
    hydra_cfg = (_yaml(root / "multirun.yaml") or {}).get("hydra") or {}
    params = (hydra_cfg.get("sweeper") or {}).get("params") or {}
    args = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in params.items()]
    args += list((hydra_cfg.get("overrides") or {}).get("task") or [])
    axes = {}
    for override in _parse_overrides(args):
        axes[override.get_key_element()] = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.get_value_element_as_str()]
        )
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _as_dict(overrides: list[str]) -> dict[str, str]:
    try:
        return {o.get_key_element(): o.get_value_element_as_str() for o in _parse_overrides(overrides)}
    except Exception:  # noqa: BLE001 - a hand-edited file: compare the raw text
        return dict(str(o).split("=", 1) for o in overrides if "=" in str(o))


def _expected_method(combo: dict, choices: dict) -> str:
    """The method name a job of a sweep will have: `model=`, or a field job's `field=<backbone>/<method>`
    (`<method>@<backbone>` on a field backbone, as `method_and_dataset` names the finished run)."""
    if "field" in combo:
        backbone, _, method = combo["field"].partition("/")
        method = method.removesuffix("_cifar100")
        return method if backbone == "structure_net" else f"{method}@{backbone}"
    return combo.get("model", choices.get("model", "?"))


def missing_runs(root: Path, runs: list[Run]) -> list[Run]:
    jobs = [_as_dict(r.overrides) for r in runs if r.status != "missing" and root in r.path.parents]
    multirun = _yaml(root / "multirun.yaml") or {}
    choices = ((multirun.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
    missing = []
    for combo in expected_jobs(root):
        if not any(all(job.get(k) == v for k, v in combo.items()) for job in jobs):
            missing.append(
                Run(
                    root,
                    _expected_method(combo, choices),
                    combo.get("data", choices.get("data", "?")),
                    combo.get("seed", multirun.get("seed")),
                    "missing",
                    overrides=[f"{k}={v}" for k, v in combo.items()],
                    note="no job folder",
                )
            )
    return missing
