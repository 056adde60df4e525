"""A small end-to-end comparison of every method on any classification dataset (CPU-sized).

    python -m dbsn.tools.compare [--data digits] [--subset N] [--epochs 10] [--methods dbsn,map,...] [--tune]
                           [--backbone structure_net|resnet18|wrn28_10] [--batch-size 64] [--out DIR]
                           [--evaluations ood,shift,conformal] [--ood SETS] [--posthoc temperature,...]
                           [--evaluate-overrides "KEY=VALUE ..."] [--resume] [overrides ...]

Every method trains the paper's small network (or a narrow `--backbone`) under one protocol
(`--protocol fair`, the default: shared data, epochs, batch and schedule shape, each method's own
relative settings; `--tune`: one learning-rate grid for all, chosen by validation NLL), is tested
with S = `--samples` members, and optionally evaluated (`--evaluations`, `--posthoc`) as by
evaluate.py. It prints and writes comparison.md / comparison.json (error, NLL, Brier, CE²,
calibrated NLL with 95 % intervals; paired differences against DBSN) and the full report into
DIR/report. Trailing overrides are train.py's, for every method (`data.root=...`, `trainer=gpu`;
default `trainer=cpu`); evaluate.py's go in `--evaluate-overrides`. Options and overrides are
composed and checked before anything trains. The protocol, the schedules and the outputs:
docs/evaluation.md ("Comparing methods fairly"); the evaluations after training: docs/methods.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from datetime import date
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from dbsn import conf_choices
from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, shown_interval
from dbsn.evaluation.report import build_report
from dbsn.methods.registry import method_config, method_configs
from dbsn.runtime.config import CONF_DIR, ConfigError
from dbsn.structure.schedules import REFERENCE_BATCH
from dbsn.tools.comparison_folder import check_output, finished_run, finished_tuning_run, validated

#: The networks a comparison runs on, at CPU size: DBSN's small cell network (the paper's B = 4, one
#: cell per stage), a ResNet-18 of width 16 and a WideResNet-16-2. Methods that need DBSN's cells
#: (`Method.networks` "cells": dbsn, fbn, vogn_fbn) run on the cell network whatever the backbone.
BACKBONES = {
    "structure_net": ["num_nodes=4", "cells_per_stage=1"],
    "resnet18": ["width=16"],
    "wrn28_10": ["depth=16", "widen_factor=2"],
}
#: The protocols. "fair" (the default): what every method shares is the data, the epochs, the batch and
#: the learning-rate schedule's shape (`SHARED_SCHEDULE`); each keeps its authors' relative settings
#: (loss over members, fast-weight lr, initialisation, momentum, weight decay, warm-up), and its base lr
#: is its own config's or, with `--tune`, the value of `LR_GRID` with the lowest validation NLL.
#: "shared": every method trained by SGD trains with the paper's one recipe (`SHARED_OPTIMIZER`), the
#: recipes of their authors' that some configs carry (conf/field's sweeps use them) set aside, and MIMO
#: with the mean over members: the protocol of dbsn's earlier comparisons, which holds Packed-Ensembles at
#: lr / M per member and MIMO at 1 / M of its gradient (kept to reproduce them).
PROTOCOLS = ("fair", "shared")
SHARED_SCHEDULE = {"schedule": "multistep", "milestones": "[0.5,0.75]", "gamma": 0.1}
SHARED_OPTIMIZER = {
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 1.0e-4,
    "nesterov": "false",
    "grad_clip_norm": 5.0,
    "milestones": "[0.5,0.75]",
    "gamma": 0.1,
    "warmup_epochs": 0,
}
#: `--tune`'s base learning rates, the same for every method: the paper's 0.1, halved and doubled twice
LR_GRID = (0.025, 0.05, 0.1, 0.2, 0.4)
#: the validation split `--tune` selects on (every run of the comparison trains without it)
TUNE_VAL_SIZE = 0.15
#: what `--tune` writes beside each tuned run, and the report reads
TUNING_FILE = "tuning.json"
#: MC dropout on a network without cells (conf/field's choices): after every convolution, or WRN's own layers.
DROPOUT_PLACEMENT = {"resnet18": "every_conv", "wrn28_10": "existing"}
#: `--ood`'s default where the OOD sets need no files: the embedded digits against photo patches and noise.
DEFAULT_OOD = {"digits": ("photos", "noise")}
#: Datasets with published corrupted test sets (CIFAR-10-C / -100-C, under the data root); the shift
#: evaluation of any other generates its corruptions once into `<out>/<data>-C`.
PUBLISHED_SHIFT = ("cifar10", "cifar100")
#: The validation split every method trains with when post-hoc calibrators are fitted (`--posthoc`).
POSTHOC_VAL_SIZE = 0.15
#: evaluate.py's settings that belong to the evaluations pass alone, and to the post-hoc passes alone.
EVALUATION_KEYS, POSTHOC_KEYS = ("evaluations", "ood", "ood_score"), ("posthoc",)
#: The training's settings every evaluation reuses: the trainer (device, precision) and the intervals.
SHARED_WITH_EVALUATION = ("trainer", "statistics")


def compared_methods() -> list[str]:
    """The methods a comparison trains (`--methods`), in the report's order: every classification
    method of conf/model/ that trains the cell network or a backbone (`dbsn.methods.registry`; not
    NEK-FAC, defined on its own VGG16-BN)."""
    return [m.name for m in method_configs() if m.classifies and m.networks != "own"]


def backbone_choices() -> list[str]:
    """`--backbone`'s choices: the cell network and every backbone of conf/model/net/ (dbsn's and
    the extensions', `dbsn.methods.registry.field_backbones`)."""
    from dbsn.methods.registry import field_backbones

    return sorted({*BACKBONES, *field_backbones()})


def data_choices() -> list[str]:
    """The classification datasets of conf/data/ (CamVid is segmentation: these methods classify)."""
    from hydra.utils import get_class

    from dbsn.data import ImageClassificationDataModule
    from dbsn.extensions import config_dirs

    return sorted(
        {
            path.stem
            for folder in config_dirs()
            for path in (folder / "data").glob("*.yaml")
            if issubclass(get_class(OmegaConf.load(path)._target_), ImageClassificationDataModule)
        }
    )


def override_key(override: str) -> str:
    """The config key an override sets (`+posthoc@posthoc.base=laplace`: `posthoc.base`'s group,
    `posthoc`), without Hydra's `+`, `++`, `~` prefixes."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def top_key(override: str) -> str:
    return override_key(override).split(".", 1)[0]


def ood_sets(evaluations, ood, data: str) -> list[str]:
    """The OOD sets of `--evaluations ...,ood`: `ood`, else the dataset's default; a ConfigError
    when ood is chosen without sets, or sets are given without ood."""
    if "ood" not in evaluations:
        if ood:
            raise ConfigError(
                f"--ood {','.join(ood)} chooses the sets of the ood evaluation, which is not chosen: add "
                "ood to --evaluations"
            )
        return []
    sets = list(ood or DEFAULT_OOD.get(data, ()))
    if not sets:
        raise ConfigError(
            f"--evaluations ood on {data} needs --ood (sets of conf/ood/: {', '.join(conf_choices('ood'))})"
        )
    return sets


def evaluation_passes(
    evaluations=(),
    posthoc=(),
    ood=(),
    data: str = "digits",
    output_dir: Path = Path("outputs/compare"),
    train_overrides: list[str] = (),
    evaluate_extra: list[str] = (),
) -> dict[str, list[str]]:
    """evaluate.py's overrides of each pass after a method's training, by name: "evaluations" (the
    chosen evaluations, when any), then "posthoc=<name>" for each post-hoc posterior (the test pass
    only). Each reuses the training's `trainer` and `statistics` overrides; `evaluate_extra` under
    `evaluations.`/`ood.` reaches the evaluations pass, under `posthoc` the post-hoc passes, the
    rest every pass."""
    shared = [o for o in train_overrides if top_key(o) in SHARED_WITH_EVALUATION]
    passes = {}
    if evaluations:
        chosen = [f"evaluations=[{','.join(evaluations)}]"]
        if "ood" in evaluations:
            chosen.append(f"ood=[{','.join(ood)}]")
        if "shift" in evaluations and data not in PUBLISHED_SHIFT:  # generated once, shared by every method
            chosen += [
                "evaluations.shift.generate=true",
                f"evaluations.shift.root={Path(output_dir).resolve() / f'{data}-C'}",
            ]
        passes["evaluations"] = [*shared, *chosen, *(o for o in evaluate_extra if top_key(o) not in POSTHOC_KEYS)]
    for name in posthoc:
        passes[f"posthoc={name}"] = [
            *shared,
            f"posthoc={name}",
            *(o for o in evaluate_extra if top_key(o) not in EVALUATION_KEYS),
        ]
    return passes


def compose_train(overrides: list[str]) -> DictConfig:
    """train.py's config with `overrides`, composed in this process from dbsn's config folder."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def compose_evaluate(overrides: list[str], ckpt: Path, output_dir: Path) -> DictConfig:
    """evaluate.py's config for `ckpt`, composed in this process (Hydra's errors as ConfigError)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("evaluate", overrides=[f"ckpt_path={ckpt}", *overrides, f"paths.output_dir={output_dir}"])
    except HydraException as err:
        raise ConfigError(f"evaluate.py's config ({' '.join(overrides)}): {err}") from err


def check_passes(passes: dict[str, list[str]], output_dir: Path) -> None:
    """Compose every pass and build its evaluations and posterior, so that a mistake in them fails
    before any method trains."""
    from dbsn.runtime.config import check_trainer
    from dbsn.runtime.evaluation import build_evaluator, build_posterior

    for overrides in passes.values():
        cfg = compose_evaluate(overrides, Path(output_dir) / "checkpoints" / "last.ckpt", Path(output_dir))
        check_trainer(cfg.get("trainer"))
        build_evaluator(cfg)
        build_posterior(cfg)


def posthoc_why_not(cfg: DictConfig, ckpt: Path) -> str | None:
    """Why the post-hoc posterior of the evaluate config `cfg` does not apply to the method in
    `ckpt` (its `why_not`, where evaluate.py would refuse it), or None."""
    from hydra.utils import get_class

    from dbsn.runtime.build import load_method
    from dbsn.runtime.checkpoint import CONFIG_KEY, load_checkpoint
    from dbsn.runtime.evaluation import build_posterior

    checkpoint = load_checkpoint(ckpt)
    model = load_method(ckpt, get_class(checkpoint[CONFIG_KEY]["data"]["_target_"]).num_classes, checkpoint=checkpoint)
    return build_posterior(cfg).why_not(model, checkpoint)


def evaluate_run(run_dir: Path, method: str, passes: dict[str, list[str]]) -> None:
    """Every pass of `evaluation_passes` on the run's last checkpoint, into evaluate.py's default
    folders (`<run>/evaluation`, `<run>/posthoc/<name>/evaluation`); a posterior that does not apply
    to the method is skipped with one line."""
    from dbsn.evaluation.runs import last_checkpoint
    from dbsn.runtime.run import evaluate

    ckpt = last_checkpoint(run_dir)
    for name, overrides in passes.items():
        posthoc = name.removeprefix("posthoc=") if name.startswith("posthoc=") else None
        out = run_dir / "posthoc" / posthoc / "evaluation" if posthoc else run_dir / "evaluation"
        cfg = compose_evaluate(overrides, ckpt, out)
        if posthoc and (reason := posthoc_why_not(cfg, ckpt)) is not None:
            Console().print(f"[yellow]posthoc={posthoc} skipped for {method}:[/yellow] {reason}", soft_wrap=True)
            continue
        Console().print(f"[bold]Evaluating {method}: {name}[/bold]")
        evaluate(cfg, out)


def shared_overrides(data: str = "digits", batch_size: int = 64, subset: int | float | None = None) -> list[str]:
    """What every method's run shares: the dataset (and its training subset, if any), the batch
    and a CPU trainer (a later `trainer=...` override changes it). The in-memory digits need no
    loader workers; the other datasets keep their config's."""
    overrides = ["trainer=cpu", f"data={data}", f"data.batch_size={batch_size}"]
    if data == "digits":
        overrides.append("data.num_workers=0")
    if subset:
        overrides.append(f"data.train_subset={subset}")
    return overrides


def epoch_size(data_cfg: DictConfig) -> tuple[int, int]:
    """(training images, optimiser steps per epoch) of a composed data config. Its data module
    is built and set up for fitting, so a missing dataset or a bad `data.train_subset` fails
    here with the data module's own error; the last partial batch is a step unless
    `data.drop_last`."""
    from hydra.utils import instantiate

    datamodule = instantiate(data_cfg)
    datamodule.setup("fit")
    n, batch = datamodule.num_train, datamodule.batch_size
    return n, n // batch if datamodule.drop_last else math.ceil(n / batch)


def lr_key(method: str) -> str:
    """The config key of a method's base learning rate: its weights' optimiser's (VOGN's own, a
    deep ensemble's members')."""
    return f"model.{method_config(method).optimizer_key}.lr"


def own_net_keys(method: str) -> list[str]:
    """The `net` keys that the method's own file in conf/model/ (and the model files it extends) sets
    for its cell network, e.g. VOGN's small B = 4 network: on a residual backbone they are removed, as
    train.py's refusal of them tells a user to (`~model.net.num_nodes`)."""
    from dbsn.extensions import config_dirs

    keys, names, seen = [], [method], set()
    while names:
        name = names.pop()
        seen.add(name)
        for folder in config_dirs():
            path = Path(folder) / "model" / f"{name}.yaml"
            if path.is_file():
                raw = OmegaConf.load(path)
                keys += [key for key in (raw.get("net") or {}) if key not in keys]
                parents = [d for d in raw.get("defaults", []) if isinstance(d, str) and d != "_self_"]
                names += [d for d in parents if d not in seen]
                break
    return keys


def method_overrides(
    method: str,
    epochs: int,
    steps_per_epoch: int,
    n_samples: int = 100,
    net_overrides: list[str] = (),
    batch_size: int = 64,
    backbone: str = "structure_net",
    protocol: str = "fair",
    lr: float | None = None,
) -> list[str]:
    """One method's model on `backbone` (at the CPU size of `BACKBONES`; the cell network for
    the methods that need cells) under `protocol` (`PROTOCOLS`; `lr`: its base learning rate,
    None = its config's) and the schedules compressed into `epochs` of `steps_per_epoch`
    steps of `batch_size` images: τ's progress counts examples seen / REFERENCE_BATCH (τ
    reaches 1 at the end), β's counts epochs (0.5 at 80 %), VOGN's KL warm-up counts steps."""
    entry = method_config(method)  # what the method is: dbsn.methods.registry
    model = "model.member" if entry.member else "model"  # a deep ensemble's: its members'
    net = "structure_net" if entry.networks == "cells" else backbone
    choice = "model/net@model.member.net" if entry.member else "model/net"  # the members' network
    overrides = [
        f"model={method}",
        f"{choice}={net}",
        f"trainer.max_epochs={epochs}",
        "trainer.log_every_n_steps=10",
        *[f"~{model}.net.{key}" for key in own_net_keys(method) if net != "structure_net"],
        *[f"{model}.net.{o}" for o in BACKBONES.get(net, ())],
        *[f"{model}.net.{o}" for o in net_overrides],
    ]
    if entry.member:  # an ensemble of networks trained side by side: three of them
        overrides.append("model.size=3")
    optim = f"model.{entry.optimizer_key}"
    if protocol == "shared":
        if entry.sgd:  # the shared weight optimiser, not a recipe of the method's config
            overrides += [f"{optim}.{key}={value}" for key, value in SHARED_OPTIMIZER.items()]
        if "member_loss" in entry.config:  # MIMO's recipe is for one network's mean NLL
            overrides.append("model.member_loss=mean")
    elif entry.sgd:  # the schedule's shape is shared; an optimiser of its own (VOGN's) keeps its own
        overrides += [f"++{optim}.{key}={value}" for key, value in SHARED_SCHEDULE.items()]
    if lr is not None:
        overrides.append(f"{lr_key(method)}={lr:g}")
    if "placement" in (entry.config.get("weights") or {}) and net in DROPOUT_PLACEMENT:
        overrides.append(f"model.weights.placement={DROPOUT_PLACEMENT[net]}")  # MC dropout without cells
    if not entry.fixed_members:
        overrides.append(f"model.prediction.n_samples={n_samples}")
    total = epochs * steps_per_epoch
    if entry.samples_structure:  # compress the 100-epoch schedules into this run
        overrides += [
            f"model.tau.decay={math.log(3.0) / (total * batch_size / REFERENCE_BATCH):.3e}",
            f"model.beta.decay_per_epoch={0.5 / (0.8 * epochs):.4f}",
            "model.structure_optim.lr=3e-3",
        ]
        if "train_samples" in entry.config:  # VOGN-FBN has none: one structure per weight sample
            overrides.append("model.train_samples=1")
    if "kl_warmup_steps" in entry.optimizer:  # VOGN's KL warm-up: the first tenth of the run
        overrides.append(f"{optim}.kl_warmup_steps={max(1, total // 10)}")
    if entry.samples_structure or entry.weights_sample or entry.cls.samples_members:  # S draws, four per forward
        overrides.append("model.prediction.samples_per_forward=4")
    return overrides


def last_validation_nll(run_dir: Path) -> float:
    """The validation NLL of a run's last validation (its CSV log's last `val/nll`); inf if it has none
    or it is not finite (a run that diverged is the worst choice, not an error)."""
    import csv

    values = []
    for path in sorted(Path(run_dir).glob("csv/version_*/metrics.csv")):
        with path.open(newline="") as f:
            values += [float(row["val/nll"]) for row in csv.DictReader(f) if row.get("val/nll")]
    value = values[-1] if values else math.inf
    return value if math.isfinite(value) else math.inf


def choose(curve: dict[float, float]) -> float:
    """The grid value with the lowest validation NLL (the smaller one on a tie)."""
    finite = {lr: nll for lr, nll in curve.items() if math.isfinite(nll)}
    if not finite:
        raise ConfigError(
            f"every learning rate of the grid {sorted(curve)} diverged or never validated: "
            "try a grid of smaller values (--lr-grid)"
        )
    return min(sorted(finite), key=lambda lr: finite[lr])


def tune(
    method: str, grid, overrides_at, shared: list[str], output_dir: Path, epochs: int, resume: bool = False
) -> dict:
    """`method` trained once per learning rate of `grid` (`overrides_at(lr)`: its model's overrides),
    on the training split without its validation part, each run validated once, at its end, and
    never tested; the chosen rate is the one of the lowest validation NLL (`choose`). Returns the
    record `TUNING_FILE` keeps: the grid, each rate's validation NLL, the choice and how it was made."""
    from hydra import compose, initialize_config_dir

    from dbsn.methods import NonFiniteLossError
    from dbsn.runtime.run import train

    curve = {}
    for lr in grid:
        run_dir = Path(output_dir) / "tune" / method / f"lr_{lr:g}"
        Console().print(f"[bold]Tuning {method}: lr = {lr:g}[/bold]")
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[
                    *overrides_at(lr),
                    *shared,
                    "test=false",
                    f"trainer.check_val_every_n_epoch={epochs}",
                    f"paths.output_dir={run_dir}",
                    "task_name=compare_tune",
                    *(["resume=true"] if resume else []),
                ],
            )
        try:
            if not (resume and finished_tuning_run(run_dir)):
                train(cfg, run_dir, where="--out")
            curve[lr] = last_validation_nll(run_dir)
        except NonFiniteLossError:
            curve[lr] = math.inf
    chosen = choose(curve)
    return {
        "grid": [float(lr) for lr in grid],
        "validation_nll": {f"{lr:g}": curve[lr] for lr in grid},
        "chosen": chosen,
        "key": None,
        "selected_by": "the validation NLL after the last epoch, the test set unseen",
    }


def reused_tuning(directory: Path, methods, protocol: str) -> dict[str, dict]:
    """Each method's record of an earlier `--tune` comparison in `directory` (its
    `<method>/tuning.json`), marked as reused: the learning rates a second seed trains with."""
    if protocol != "fair":
        raise ConfigError("--tuned-from reuses the fair protocol's learning-rate search: drop --protocol shared")
    missing = [m for m in methods if not (directory / m / TUNING_FILE).is_file()]
    if missing:
        raise ConfigError(
            f"--tuned-from {directory}: no {TUNING_FILE} for {', '.join(missing)} (run that comparison "
            "with --tune and these methods first, or leave these methods out)"
        )
    return {
        m: {**json.loads((directory / m / TUNING_FILE).read_text()), "reused_from": str(directory)} for m in methods
    }


def run_comparison(
    methods=None,
    epochs: int = 10,
    output_dir: Path = Path("outputs/compare"),
    extra: list[str] | None = None,
    n_samples: int = 100,
    net_overrides: list[str] = (),
    batch_size: int = 64,
    data: str = "digits",
    subset: int | float | None = None,
    backbone: str = "structure_net",
    evaluations=(),
    posthoc=(),
    ood=None,
    evaluate_extra: list[str] = (),
    protocol: str = "fair",
    lr_grid=None,
    tuned_from: Path | None = None,
    resume: bool = False,
) -> dict[str, dict[str, float]]:
    """Train and test each method on `data` (its training `subset`, if any) into
    ``output_dir/<method>`` under `protocol`, each with the learning rate of `lr_grid` that its
    validation NLL chooses (`tune`; None: its config's, or with `tuned_from` the rate an earlier
    comparison chose, its `<method>/tuning.json`: one search for every seed), then evaluate it with `evaluations` and
    each of `posthoc` (`evaluation_passes`; `ood`: the OOD sets, None: the dataset's default);
    returns its test metrics plus ``train_seconds`` (the fit's wall time) by method; `methods`: the
    methods' config names, None = every one (`compared_methods`). `resume`: continue the comparison
    in `output_dir` (`dbsn.tools.comparison_folder`); without it, `output_dir` must be new or empty."""
    methods = compared_methods() if methods is None else list(methods)
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if lr_grid is not None and protocol != "fair":
        raise ConfigError(
            "--tune chooses each method's own learning rate: it belongs to the fair protocol (--protocol fair)"
        )
    if lr_grid is not None and tuned_from is not None:
        raise ConfigError(
            "--tune searches the learning rates and --tuned-from reuses an earlier search's: give one of them"
        )
    reused = {} if tuned_from is None else reused_tuning(Path(tuned_from), methods, protocol)
    check_output(Path(output_dir), methods, compared_methods(), resume)  # before anything trains
    from hydra import compose, initialize_config_dir

    from dbsn.runtime.console import quiet_console
    from dbsn.runtime.run import train

    quiet_console()  # no Lightning product tip before each method's training
    extra = list(extra or [])
    val_size = next((o.split("=", 1)[1] for o in reversed(extra) if override_key(o) == "data.val_size"), None)
    if posthoc and val_size is None:
        extra.append(f"data.val_size={POSTHOC_VAL_SIZE}")
        Console().print(
            f"--posthoc: every method trains with data.val_size={POSTHOC_VAL_SIZE}, the validation split the "
            "calibrators are fitted on (never the test set; the conformal sets calibrate on it too)",
            soft_wrap=True,
        )
    elif posthoc and val_size in ("0", "0.0", "null"):
        raise ConfigError(
            f"--posthoc {','.join(posthoc)} is fitted on a validation split, and data.val_size={val_size} "
            f"leaves none: drop it (--posthoc adds data.val_size={POSTHOC_VAL_SIZE}) or set a size"
        )
    tuning_split = lr_grid is not None or tuned_from is not None  # every run trains without the search's split
    if tuning_split and val_size is None and not posthoc:
        extra.append(f"data.val_size={TUNE_VAL_SIZE}")
    elif tuning_split and val_size in ("0", "0.0", "null"):
        raise ConfigError(
            f"--tune selects on a validation split, and data.val_size={val_size} leaves none: drop it "
            f"(--tune adds data.val_size={TUNE_VAL_SIZE}) or set a size"
        )
    shared = [*shared_overrides(data, batch_size, subset), *extra]
    passes = evaluation_passes(
        evaluations, posthoc, ood_sets(evaluations, ood, data), data, output_dir, shared, evaluate_extra
    )
    check_passes(passes, Path(output_dir) / methods[0])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        data_cfg = compose("train", overrides=[f"model={methods[0]}", *shared]).data
    num_train, steps_per_epoch = epoch_size(data_cfg)
    results = {}
    for method in methods:
        run_dir = Path(output_dir) / method

        def overrides_at(lr, method=method):
            return method_overrides(
                method, epochs, steps_per_epoch, n_samples, net_overrides, batch_size, backbone, protocol, lr
            )

        tuning, member = reused.get(method), method_config(method).member
        if lr_grid is not None and member is not None and member.name in results:
            # a deep ensemble's members are networks of a method trained alone (map_fixed): their search is its
            tuning = {
                **json.loads((Path(output_dir) / member.name / TUNING_FILE).read_text()),
                "key": lr_key(method),
                "shared_with": member.name,
            }
        elif lr_grid is not None:
            tuning = {
                **tune(method, lr_grid, overrides_at, shared, Path(output_dir), epochs, resume),
                "key": lr_key(method),
            }
            Console().print(
                f"{method}: lr = {tuning['chosen']:g} (validation NLL "
                + ", ".join(f"{k}: {v:.4f}" for k, v in tuning["validation_nll"].items())
                + ")",
                soft_wrap=True,
            )
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[
                    *overrides_at(None if tuning is None else tuning["chosen"]),
                    *shared,
                    f"paths.output_dir={run_dir}",
                    "task_name=compare",
                    *(["resume=true"] if resume else []),
                ],
            )
        done = finished_run(run_dir, validated(cfg)) if resume else None
        if done is not None:
            Console().print(f"{method}: kept, its run in {run_dir} finished with these settings")
        metrics = done["metrics"] if done is not None else train(cfg, run_dir, where="--out")
        if tuning is not None:
            (run_dir / TUNING_FILE).write_text(json.dumps(tuning, indent=2) + "\n")
        record = json.loads((run_dir / "metrics.json").read_text())
        results[method] = {
            **metrics,
            "train_seconds": record["train_seconds"],
            "intervals": record.get("intervals", {}),
            "cost": record.get("cost", {}),
        }
        evaluate_run(run_dir, method, passes)
    write_table(results, Path(output_dir), epochs, batch_size, data, num_train if data_cfg.train_subset else None)
    reference = reference_name(methods, backbone)
    if len(methods) > 1 or passes:
        report = build_report([Path(output_dir)], Path(output_dir) / "report", reference)
        print_paired(report, reference)
        Console().print(f"Report with every table and the Pareto figure: {report.out / 'report.md'}")
    return results


def reference_name(methods, backbone: str) -> str:
    """The method the paired differences are taken against, as the report names it: DBSN if it
    ran, else the first method, `<method>@<backbone>` on a residual network (DBSN and FBN always
    train the cell network)."""
    reference = "dbsn" if "dbsn" in methods else methods[0]
    if method_config(reference).networks == "cells" or backbone == "structure_net":
        return reference
    return f"{reference}@{backbone}"


def print_paired(report, reference: str) -> None:
    """The report's paired differences against `reference` (paired.csv) on the console, and its
    one-line summary of the differences indistinguishable from noise."""
    path = report.out / "paired.csv"
    if not path.is_file():
        return
    import csv

    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    table = Table(
        "method",
        "metric",
        "difference",
        "95 % interval",
        "",
        title=f"Paired differences: method − {reference} "
        "(same test examples; * the interval excludes 0, † also after Holm's correction)",
    )
    for row in rows:
        mark = ("*" if row["excludes_zero"] == "True" else "") + ("†" if row["holm_rejected"] == "True" else "")
        low, high, misses = shown_interval(
            None, float(row["difference"]), float(row["low"]), float(row["high"]), difference=True
        )
        table.add_row(
            row["method"],
            row["metric"],
            f"{float(row['difference']):+.4f}",
            f"[{low:+.4f}, {high:+.4f}]" + (f" {OUTSIDE_NOTE}" if misses else ""),
            mark,
        )
    Console().print(table)
    for line in report.summary:
        Console().print(line)


def _with_interval(key: str, scale: float, digits: int):
    def show(value, interval) -> str:
        if value is None:
            return "–"
        text = f"{scale * value:.{digits}f}"
        if not interval:
            return text
        low, high, misses = shown_interval(key, scale * value, scale * interval[0], scale * interval[1], scale=scale)
        text += f" [{low:.{digits}f}, {high:.{digits}f}]"
        return f"{text} {OUTSIDE_NOTE}" if misses else text

    return show


#: (column, metric key, format of (value, its 95 % interval or None))
COLUMNS = (
    ("error %", "test/error", _with_interval("test/error", 100, 2)),
    ("NLL", "test/nll", _with_interval("test/nll", 1, 4)),
    ("Brier", "test/brier", _with_interval("test/brier", 1, 4)),
    ("CE²", "test/ce2", _with_interval("test/ce2", 1, 5)),
    ("ECE (plug-in, biased)", "test/ece", lambda v, _: "–" if v is None else f"{v:.4f}"),
    ("calibrated NLL", "test/calibrated/nll", _with_interval("test/calibrated/nll", 1, 4)),
    ("train min", "train_seconds", lambda v, _: "–" if v is None else f"{v / 60:.1f}"),
)


def write_table(
    results: dict[str, dict[str, float]],
    output_dir: Path,
    epochs: int,
    batch_size: int = 64,
    data: str = "digits",
    train_subset: int | None = None,
) -> str:
    """Print the results as a table titled with the run's settings; write it to comparison.md
    and, with those settings (`train_subset`: the subset's images, None = the whole training
    split), to comparison.json."""
    rows = [
        [method, *(fmt(m.get(key), (m.get("intervals") or {}).get(key)) for _, key, fmt in COLUMNS)]
        for method, m in results.items()
    ]
    header = ["method", *(name for name, _, _ in COLUMNS)]
    markdown = "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows]) + "\n"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "comparison.md").write_text(markdown)
    (output_dir / "comparison.json").write_text(
        json.dumps(
            {
                "date": date.today().isoformat(),
                "data": data,
                "train_subset": train_subset,
                "epochs": epochs,
                "batch_size": batch_size,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    subset = f", a {train_subset}-image training subset" if train_subset else ""
    table = Table(
        *header,
        title=f"{data}{subset}, {epochs} epochs, batch {batch_size}: value [95 % bootstrap interval "
        "over the test examples]",
    )
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return markdown


def count_or_fraction(text: str) -> int | float:
    """`--subset`'s value as `data.train_subset` reads it: an int, else a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def names(text: str) -> list[str]:
    """A comma-separated option's names (`--evaluations ood,shift`), in order, without repeats."""
    return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="digits", help="a classification dataset of conf/data/")
    parser.add_argument(
        "--subset",
        type=count_or_fraction,
        default=None,
        help="train on a class-stratified subset: a count of images or a fraction (data.train_subset)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--methods",
        default=",".join(compared_methods()),
        help="the methods of conf/model/ to train, comma-separated (default: every one)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--samples",
        type=int,
        default=100,
        help="S, members of the stochastic methods' test ensembles (the test pass costs S forwards "
        "of the whole test set: fewer on a large test set on CPU)",
    )
    parser.add_argument(
        "--backbone",
        choices=backbone_choices(),
        default="structure_net",
        help="the network of the methods that do not need DBSN's cells, at CPU size: the small cell "
        "network (default), ResNet-18 of width 16, WideResNet-16-2, or a backbone of an "
        "extension (model/net/<name>.yaml, at its config's size)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/compare"))
    parser.add_argument(
        "--evaluations",
        type=names,
        default=[],
        help="after each method's training, these evaluations of conf/evaluations/ (comma-separated: "
        "ood,shift,conformal,adversarial) into <method>/evaluation",
    )
    parser.add_argument(
        "--ood",
        type=names,
        default=None,
        help="the OOD evaluation's sets of conf/ood/ (default on digits: photos,noise)",
    )
    parser.add_argument(
        "--ood-scores",
        type=names,
        default=[],
        help="post-hoc OOD scores of conf/ood_score/ (dbsn's or an extension's) for --evaluations ood, "
        "instead of its default list, e.g. energy,knn",
    )
    parser.add_argument(
        "--posthoc",
        type=names,
        default=[],
        help="then each of these post-hoc posteriors of conf/posthoc/ (comma-separated: temperature,"
        "histogram_binning,isotonic,dirichlet,...) into <method>/posthoc/<name>/",
    )
    parser.add_argument(
        "--evaluate-overrides",
        action="append",
        type=shlex.split,
        default=[],
        metavar='"KEY=VALUE ..."',
        help="evaluate.py overrides of the evaluations (evaluations.*, ood.*) and post-hoc passes "
        "(posthoc.*), or of both (the rest); repeatable",
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="fair",
        help="fair (default): each method keeps its authors' relative settings, the schedule's shape is "
        "shared; shared: every method with the paper's one SGD recipe (the earlier comparisons')",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="choose each method's base learning rate from --lr-grid by its validation NLL (a validation "
        f"split of {TUNE_VAL_SIZE:g} held out of training; the test set unseen) before its run",
    )
    parser.add_argument(
        "--lr-grid",
        type=lambda text: [float(v) for v in names(text)],
        default=list(LR_GRID),
        help="the learning rates --tune tries, the same for every method (default: "
        + ",".join(f"{v:g}" for v in LR_GRID)
        + ")",
    )
    parser.add_argument(
        "--tuned-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="train with the learning rates an earlier --tune comparison in DIR chose (its "
        "<method>/tuning.json): one search for every seed (e.g. with seed=1)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the comparison in --out: finished methods are kept, unfinished ones continue from "
        "their last checkpoints (without it, --out must be new or empty)",
    )
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every method")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods.split(",")) - set(compared_methods()))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(compared_methods())}")
    if args.data not in data_choices():
        parser.error(f"unknown dataset {args.data!r}; choose from {', '.join(data_choices())}")
    if any(o.startswith("data=") for o in args.overrides):
        parser.error("choose the dataset with --data, not a data=... override")
    for option, group in (
        ("evaluations", "evaluations"),
        ("ood", "ood"),
        ("ood_scores", "ood_score"),
        ("posthoc", "posthoc"),
    ):
        unknown = sorted(set(getattr(args, option) or ()) - set(conf_choices(group)))
        if unknown:
            parser.error(f"unknown --{option} {unknown}; choose from {', '.join(conf_choices(group))}")
    if args.ood_scores and "ood" not in args.evaluations:
        parser.error("--ood-scores chooses the scores of the OOD evaluation: add --evaluations ood")
    try:
        ood_sets(args.evaluations, args.ood, args.data)
    except ConfigError as err:
        parser.error(str(err))
    if args.ood_scores:
        args.evaluate_overrides.append([f"ood_score=[{','.join(args.ood_scores)}]"])
    return run_comparison(
        args.methods.split(","),
        args.epochs,
        args.out,
        args.overrides,
        batch_size=args.batch_size,
        data=args.data,
        subset=args.subset,
        n_samples=args.samples,
        backbone=args.backbone,
        evaluations=args.evaluations,
        posthoc=args.posthoc,
        ood=args.ood,
        evaluate_extra=[o for chunk in args.evaluate_overrides for o in chunk],
        protocol=args.protocol,
        lr_grid=args.lr_grid if args.tune else None,
        tuned_from=args.tuned_from,
        resume=args.resume,
    )


def cli() -> None:
    """`dbsn-compare`: `main` on the command line's arguments, mistakes in one line (exit status 2)."""
    from dbsn.runtime.errors import one_line_errors

    one_line_errors(main)()


if __name__ == "__main__":
    cli()
