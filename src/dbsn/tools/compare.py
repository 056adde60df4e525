"""A small end-to-end comparison of every method on any classification dataset (CPU-sized).

    python -m dbsn.tools.compare [--data digits] [--subset N] [--epochs 10] [--methods dbsn,map,...]
                           [--backbone structure_net|resnet18|wrn28_10] [--batch-size 64] [--out DIR]
                           [overrides ...]

`--data` is any classification dataset of conf/data/ (default: the embedded digits, minutes on
CPU, no files needed); `--subset N` trains on a seeded, class-stratified N images (or a fraction
N < 1) of its training split (`data.train_subset`; the test set stays whole); the overrides are
train.py's, for every method (`data.root=...`, `trainer=gpu`; the default is `trainer=cpu`).
E.g. CIFAR-10 on a 5,000-image subset on CPU:

    python -m dbsn.tools.compare --data cifar10 --subset 5000 --epochs 10 data.root=/path

Every method trains the paper's small network (B = 4, one cell per stage, ~41K parameters), or
with `--backbone resnet18|wrn28_10` a narrow ResNet-18 (width 16) / WideResNet-16-2 (DBSN, FBN and
VOGN-FBN stay on the cell network), with the same data, batch, epochs and weight optimiser
settings, and is tested with S = 100 members where it samples (MC dropout, BBB, DBSN; the
single-pass ensembles with their M members, SNGP in one pass). Schedules written for 100 CIFAR epochs are compressed into the run, the
only per-method settings, from the run's real steps per epoch (its training images over the
batch size, counted once before any method trains, so that a missing dataset fails first):
DBSN, FBN and VOGN-FBN get the quick preset's structure schedules (τ reaches 1 and β reaches
0.5 within the run, θ's Adam at 10x the paper's lr); VOGN and VOGN-FBN warm their KL weight up
over the first 10 % of the steps (the paper: 1000 steps). NEK-FAC is left out: it is defined on
VGG16-BN, not on this network. Prints and writes (comparison.md, comparison.json) a table of
error / NLL / Brier / ECE / calibrated NLL, each with its 95 % bootstrap interval over the test
examples, and training time, titled with the dataset; then the paired differences of every method
against DBSN (or the first method) on the same test examples, with the line naming the differences
indistinguishable from noise, from the report that it writes into DIR/report (every table, the
cost table and the Pareto figure; training time as a ratio to DBSN: the paper's Table 5
comparison is `--methods dbsn,vogn,vogn_fbn --batch-size 32`).
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import date
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from dbsn.evaluation.report import build_report
from dbsn.runtime.config import CONF_DIR
from dbsn.structure.schedules import REFERENCE_BATCH

METHODS = ("dbsn", "map", "map_fixed", "mc_dropout", "bbb", "fbn", "deep_ensemble", "vogn", "vogn_fbn",
           "batch_ensemble", "packed_ensemble", "mimo", "sngp")
STRUCTURE_SAMPLING = ("dbsn", "fbn", "vogn_fbn")
VOGN_METHODS = ("vogn", "vogn_fbn")
#: Methods whose members are fixed by the network (M), or that predict in one pass: S does not apply.
FIXED_MEMBERS = ("map", "map_fixed", "deep_ensemble", "batch_ensemble", "packed_ensemble", "mimo", "sngp")
#: The networks a comparison runs on, at CPU size: DBSN's small cell network (the paper's B = 4, one
#: cell per stage), a ResNet-18 of width 16 and a WideResNet-16-2. Methods that need DBSN's cells
#: (dbsn, fbn, vogn_fbn) run on the cell network whatever the backbone.
BACKBONES = {"structure_net": ["num_nodes=4", "cells_per_stage=1"], "resnet18": ["width=16"],
             "wrn28_10": ["depth=16", "widen_factor=2"]}
#: Methods whose configs carry their authors' optimiser recipe (conf/field's sweeps use them); a comparison
#: trains every method with the same one, `SHARED_OPTIMIZER` (conf/model/optim/sgd.yaml: the paper's).
OWN_RECIPES = ("batch_ensemble", "packed_ensemble", "mimo", "sngp")
SHARED_OPTIMIZER = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1.0e-4, "nesterov": "false", "grad_clip_norm": 5.0,
                    "milestones": "[0.5,0.75]", "gamma": 0.1, "warmup_epochs": 0}
#: MC dropout on a network without cells (conf/field's choices): after every convolution, or WRN's own layers.
DROPOUT_PLACEMENT = {"resnet18": "every_conv", "wrn28_10": "existing"}


def data_choices() -> list[str]:
    """The classification datasets of conf/data/ (CamVid is segmentation: these methods classify)."""
    from hydra.utils import get_class

    from dbsn.data import ImageClassificationDataModule

    return sorted(path.stem for path in (CONF_DIR / "data").glob("*.yaml")
                  if issubclass(get_class(OmegaConf.load(path)._target_), ImageClassificationDataModule))


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


def method_overrides(method: str, epochs: int, steps_per_epoch: int, n_samples: int = 100,
                     net_overrides: list[str] = (), batch_size: int = 64, backbone: str = "structure_net") -> list[str]:
    """One method's model on `backbone` (at the CPU size of `BACKBONES`; the cell network for
    the methods that need cells) and the schedules compressed into `epochs` of `steps_per_epoch`
    steps of `batch_size` images: τ's progress counts examples seen / REFERENCE_BATCH (τ
    reaches 1 at the end), β's counts epochs (0.5 at 80 %), VOGN's KL warm-up counts steps."""
    model = "model.member" if method == "deep_ensemble" else "model"
    net = "structure_net" if method in STRUCTURE_SAMPLING else backbone
    choice = "model/net@model.member.net" if method == "deep_ensemble" else "model/net"  # the members' network
    overrides = [f"model={method}", f"{choice}={net}", f"trainer.max_epochs={epochs}",
                 "trainer.log_every_n_steps=10", *[f"{model}.net.{o}" for o in BACKBONES[net]],
                 *[f"{model}.net.{o}" for o in net_overrides]]
    if method == "deep_ensemble":
        overrides.append("model.size=3")
    if method in OWN_RECIPES:  # the shared weight optimiser, not the method's published recipe
        overrides += [f"model.optim.{key}={value}" for key, value in SHARED_OPTIMIZER.items()]
    if method == "mimo":  # the recipe is for one network's mean NLL
        overrides.append("model.member_loss=mean")
    if method == "mc_dropout" and net in DROPOUT_PLACEMENT:  # no cells: after every conv, or WRN's own dropout layers
        overrides.append(f"model.weights.placement={DROPOUT_PLACEMENT[net]}")
    if method not in FIXED_MEMBERS:
        overrides.append(f"model.prediction.n_samples={n_samples}")
    total = epochs * steps_per_epoch
    if method in STRUCTURE_SAMPLING:  # compress the 100-epoch schedules into this run
        overrides += [f"model.tau.decay={math.log(3.0) / (total * batch_size / REFERENCE_BATCH):.3e}",
                      f"model.beta.decay_per_epoch={0.5 / (0.8 * epochs):.4f}",
                      "model.structure_optim.lr=3e-3"]
        if method not in VOGN_METHODS:  # VOGN-FBN: one structure per weight sample, no T
            overrides.append("model.train_samples=1")
    if method in VOGN_METHODS:
        overrides.append(f"model.vogn.kl_warmup_steps={max(1, total // 10)}")
    if method in ("mc_dropout", "bbb", *STRUCTURE_SAMPLING):
        overrides.append("model.prediction.samples_per_forward=4")
    return overrides


def run_comparison(methods=METHODS, epochs: int = 10, output_dir: Path = Path("outputs/compare"),
                   extra: list[str] | None = None, n_samples: int = 100,
                   net_overrides: list[str] = (), batch_size: int = 64, data: str = "digits",
                   subset: int | float | None = None, backbone: str = "structure_net") -> dict[str, dict[str, float]]:
    """Train and test each method on `data` (its training `subset`, if any) into
    ``output_dir/<method>``; returns its test metrics plus ``train_seconds`` (the fit's wall
    time) by method."""
    from hydra import compose, initialize_config_dir

    from dbsn.runtime.run import train

    shared = [*shared_overrides(data, batch_size, subset), *(extra or [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        data_cfg = compose("train", overrides=[f"model={methods[0]}", *shared]).data
    num_train, steps_per_epoch = epoch_size(data_cfg)
    results = {}
    for method in methods:
        run_dir = Path(output_dir) / method
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[
                *method_overrides(method, epochs, steps_per_epoch, n_samples, net_overrides, batch_size, backbone),
                *shared, f"paths.output_dir={run_dir}", "task_name=compare"])
        metrics = train(cfg, run_dir)
        record = json.loads((run_dir / "metrics.json").read_text())
        results[method] = {**metrics, "train_seconds": record["train_seconds"], "intervals": record.get("intervals", {}),
                           "cost": record.get("cost", {})}
    write_table(results, Path(output_dir), epochs, batch_size, data, num_train if data_cfg.train_subset else None)
    reference = "dbsn" if "dbsn" in methods else methods[0]
    if len(methods) > 1:
        print_paired(build_report([Path(output_dir)], Path(output_dir) / "report", reference), reference)
    return results


def print_paired(report, reference: str) -> None:
    """The report's paired differences against `reference` (paired.csv) on the console, and its
    one-line summary of the differences indistinguishable from noise."""
    path = report.out / "paired.csv"
    if not path.is_file():
        return
    import csv

    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    table = Table("method", "metric", "difference", "95 % interval", "", title=f"Paired differences: method − {reference} "
                  "(same test examples; * the interval excludes 0, † also after Holm's correction)")
    for row in rows:
        mark = ("*" if row["excludes_zero"] == "True" else "") + ("†" if row["holm_rejected"] == "True" else "")
        table.add_row(row["method"], row["metric"], f"{float(row['difference']):+.4f}",
                      f"[{float(row['low']):+.4f}, {float(row['high']):+.4f}]", mark)
    Console().print(table)
    for line in report.summary:
        Console().print(line)
    Console().print(f"Report with every table and the Pareto figure: {report.out / 'report.md'}")


def _with_interval(scale: float, digits: int):
    def show(value, interval) -> str:
        if value is None:
            return "–"
        text = f"{scale * value:.{digits}f}"
        return text if not interval else f"{text} [{scale * interval[0]:.{digits}f}, {scale * interval[1]:.{digits}f}]"
    return show


#: (column, metric key, format of (value, its 95 % interval or None))
COLUMNS = (("error %", "test/error", _with_interval(100, 2)), ("NLL", "test/nll", _with_interval(1, 4)),
           ("Brier", "test/brier", _with_interval(1, 4)), ("ECE", "test/ece", _with_interval(1, 4)),
           ("calibrated NLL", "test/calibrated/nll", _with_interval(1, 4)),
           ("train min", "train_seconds", lambda v, _: "–" if v is None else f"{v / 60:.1f}"))


def write_table(results: dict[str, dict[str, float]], output_dir: Path, epochs: int, batch_size: int = 64,
                data: str = "digits", train_subset: int | None = None) -> str:
    """Print the results as a table titled with the run's settings; write it to comparison.md
    and, with those settings (`train_subset`: the subset's images, None = the whole training
    split), to comparison.json."""
    rows = [[method, *(fmt(m.get(key), (m.get("intervals") or {}).get(key)) for _, key, fmt in COLUMNS)]
            for method, m in results.items()]
    header = ["method", *(name for name, _, _ in COLUMNS)]
    markdown = "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows]) + "\n"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "comparison.md").write_text(markdown)
    (output_dir / "comparison.json").write_text(json.dumps(
        {"date": date.today().isoformat(), "data": data, "train_subset": train_subset, "epochs": epochs,
         "batch_size": batch_size, "results": results}, indent=2) + "\n")
    subset = f", a {train_subset}-image training subset" if train_subset else ""
    table = Table(*header, title=f"{data}{subset}, {epochs} epochs, batch {batch_size}: value [95 % bootstrap interval "
                                "over the test examples]")
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="digits", help="a classification dataset of conf/data/")
    parser.add_argument("--subset", type=count_or_fraction, default=None,
                        help="train on a class-stratified subset: a count of images or a fraction (data.train_subset)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=100,
                        help="S, members of the stochastic methods' test ensembles (the test pass costs S forwards "
                             "of the whole test set: fewer on a large test set on CPU)")
    parser.add_argument("--backbone", choices=sorted(BACKBONES), default="structure_net",
                        help="the network of the methods that do not need DBSN's cells, at CPU size: the small cell "
                             "network (default), ResNet-18 of width 16, WideResNet-16-2")
    parser.add_argument("--out", type=Path, default=Path("outputs/compare"))
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every method")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if args.data not in data_choices():
        parser.error(f"unknown dataset {args.data!r}; choose from {', '.join(data_choices())}")
    if any(o.startswith("data=") for o in args.overrides):
        parser.error("choose the dataset with --data, not a data=... override")
    return run_comparison(args.methods.split(","), args.epochs, args.out, args.overrides, batch_size=args.batch_size,
                          data=args.data, subset=args.subset, n_samples=args.samples, backbone=args.backbone)


def cli() -> None:
    """`dbsn-compare`: `main` on the command line's arguments, mistakes in one line (exit status 2)."""
    from dbsn.runtime.errors import one_line_errors

    one_line_errors(main)()


if __name__ == "__main__":
    cli()
