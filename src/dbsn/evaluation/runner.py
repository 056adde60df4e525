"""Run the evaluations of the suite on a trained method and write their numbers and figures.

`evaluate.py` (through `dbsn.runtime.run.evaluate`) calls these after the test pass; each writes into
its own sub-folder of the evaluation folder:

- `ood/<set>/`, one folder per OOD set: AUROC, AUPR (OOD and in-distribution as positive) and
  FPR95 of three scores (`metrics.json`),
  per-example scores of both sets (`scores.npz`), the empirical CDF of predictive entropy
  (`entropy_cdf.png`);
- `adversarial/`: accuracy and mean entropy per attack and ε (`results.csv`, `results.json`),
  and their plot (`adversarial.png`);
- `ablation/`: the MC-sample ablation (`results.csv`, `results.json`, `ablation.png`);
- `structure/`: the learned structure posterior (`final.json`, `final.txt`, `final.png`);
- `shift/`: dataset shift (`dbsn.evaluation.shift`): each corruption at each severity
  (`metrics.json`, `shift.csv`) and Ovadia et al.'s box plots (`shift_boxplots.png`).

The test pass's own report (every training and evaluation run) adds calibration beyond the
equal-width ECE (`test/adaptive_ece`, `test/classwise_ece`) and selective prediction for each
uncertainty score (`selective/<score>/{aurc,eaurc,augrc,risk@80}`, `selective/optimal_aurc`,
`risk_coverage.png`): `prediction_quality`.

Every number also goes to W&B when that logger is on (`dbsn.evaluation.tracking.log_to_wandb`): OOD metrics
as `ood/<set>/<score>/<metric>`, attack results against their own x axis `adversarial/epsilon`,
the ablation against `ablation/n_samples`, and the data of the figures as W&B tables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor
from tqdm.auto import tqdm

from dbsn.data.augment import normalize, to_unit_range
from dbsn.evaluation.ablation import ablation_figure, write_ablation
from dbsn.evaluation.attacks import adversarial_evaluation, adversarial_figure, write_results
from dbsn.evaluation.ood import OOD_SCORES, detection_metrics, entropy_cdf_figure
from dbsn.evaluation.structure import edge_names_of, write_structure_posterior
from dbsn.metrics.uncertainty import detection_scores
from dbsn.metrics.calibration import adaptive_expected_calibration_error, classwise_expected_calibration_error
from dbsn.metrics.classification import reliability_bins
from dbsn.metrics.selective import score_as_uncertainty, risk_coverage_curve, risk_coverage_figure, selective_metrics
from dbsn.evaluation.plots import save_figure
from dbsn.evaluation.tracking import log_to_wandb


#: the uncertainty scores whose ranking of errors selective prediction measures
SELECTIVE_SCORES = ("max_probability", "predictive_entropy", "mutual_information")


def _errors_and_scores(model) -> tuple[Tensor, dict[str, Tensor]] | None:
    if model.test_predictions is None or model.test_scores is None:
        return None
    log_probs, targets = model.test_predictions
    errors = (log_probs.argmax(-1) != targets).double()
    return errors, {k: model.test_scores[k] for k in SELECTIVE_SCORES if k in model.test_scores}


def prediction_quality(model) -> dict[str, float]:
    """Of the test pass's Bayes ensemble (classification; {} otherwise): the equal-mass and
    classwise ECE beside the logged equal-width one, and the selective-prediction metrics of each
    uncertainty score (accepting the most certain predictions first)."""
    found = _errors_and_scores(model)
    if found is None:
        return {}
    log_probs, targets = model.test_predictions
    probs = log_probs.exp()
    out = {"test/adaptive_ece": adaptive_expected_calibration_error(probs, targets, n_bins=15).item(),
           "test/classwise_ece": classwise_expected_calibration_error(probs, targets, n_bins=15).item()}
    out.update(selective_metrics(*found))  # test/ece is the test pass's own
    return out


def write_risk_coverage(model, folder: Path, title: str, loggers=()) -> Path | None:
    """The risk–coverage curves of the test pass (`risk_coverage.png`, W&B image and table)."""
    found = _errors_and_scores(model)
    if found is None:
        return None
    errors, scores = found
    path = save_figure(risk_coverage_figure(errors, scores, title=f"{title}: selective prediction"),
                       folder / "risk_coverage.png")
    rows = []
    for name, score in scores.items():
        coverage, risk = risk_coverage_curve(errors, score_as_uncertainty(name, score))
        keep = np.unique(np.linspace(0, len(coverage) - 1, min(len(coverage), 101)).round().astype(int))
        rows += [[name, float(coverage[i]), float(risk[i])] for i in keep]
    log_to_wandb(loggers, images={"selective/risk_coverage": path},
                 tables={"selective/risk_coverage_curve": (["score", "coverage", "risk"], rows)})
    return path


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """A rich table on the console: first column left-aligned, floats to 4 decimals."""
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


# ---------------------------------------------------------------------- out-of-distribution
@torch.no_grad()
def ood_evaluation(model, in_datamodule, ood_datamodule, in_scores: dict[str, Tensor], folder: Path,
                   device: torch.device, title: str, loggers=(), progress: bool = True,
                   set_name: str | None = None) -> dict:
    """Score the OOD set's test split with `model` and compare with the in-distribution scores;
    W&B names start with `ood/<set_name>/` (default: the data module's name).

    OOD images are normalised with the in-distribution statistics (`in_datamodule.preprocess`),
    as the model saw its training data. `in_scores` are the per-example scores of the test
    pass (`model.test_scores`), so the in-distribution set is not predicted twice.
    """
    ood_datamodule.setup("test")
    out: dict[str, list[Tensor]] = {}
    model.eval()
    model.enable_test_noise()
    for images, _ in tqdm(ood_datamodule.test_dataloader(), desc=f"OOD: {ood_datamodule.name}", disable=not progress):
        x = in_datamodule.preprocess(images.to(device))
        for name, value in model.uncertainty_scores(x).items():
            out.setdefault(name, []).append(value.float().cpu())
    out_scores = detection_scores({k: torch.cat(v) for k, v in out.items()})
    in_scores = detection_scores(in_scores)
    record = {
        "in_distribution": in_datamodule.name, "ood": ood_datamodule.name, "n_samples": model.num_members,
        "n_in": len(in_scores["entropy"]), "n_out": len(out_scores["entropy"]),
        "scores": {name: detection_metrics(in_scores[name], out_scores[name]) for name in OOD_SCORES},
        "mean_entropy": {"in": float(in_scores["entropy"].mean()), "out": float(out_scores["entropy"].mean())},
        "note": "OOD is the positive class; every score is higher for 'more OOD' "
                "(max_probability is stored as 1 - max probability).",
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    np.savez_compressed(
        folder / "scores.npz",
        **{f"in_{k}": v.numpy() for k, v in in_scores.items()},
        **{f"out_{k}": v.numpy() for k, v in out_scores.items()},
    )
    figure = entropy_cdf_figure(
        {f"in-distribution ({in_datamodule.name} test)": in_scores["entropy"],
         f"out-of-distribution ({ood_datamodule.name})": out_scores["entropy"]},
        title=f"{title}: predictive entropy", num_classes=in_datamodule.num_classes,
    )
    figure_path = save_figure(figure, folder / "entropy_cdf.png")
    print_table(
        f"OOD detection: {in_datamodule.name} vs {ood_datamodule.name}", ["score", "AUROC", "AUPR", "FPR95"],
        [[name, m["auroc"], m["aupr"], m["fpr95"]] for name, m in record["scores"].items()],
    )
    prefix = f"ood/{set_name or ood_datamodule.name}"
    log_to_wandb(
        loggers,
        {f"{prefix}/{score}/{k}": v for score, m in record["scores"].items() for k, v in m.items()},
        images={f"{prefix}/entropy_cdf": figure_path},
        tables={f"{prefix}/entropy_cdf_{split}": (["entropy", "cdf"], cdf_points(scores["entropy"]))
                for split, scores in (("in", in_scores), ("ood", out_scores))},
    )
    return record


def cdf_points(values: Tensor, max_points: int = 101) -> list[list[float]]:
    """Points (x, F(x)) of the empirical CDF of `values` at up to `max_points` evenly spaced
    ranks, the largest value included: F(x) is the share of values <= x, ties counted."""
    ordered = torch.sort(values.double().flatten()).values
    n = ordered.numel()
    ranks = torch.unique(torch.linspace(0, n - 1, min(n, max_points)).round().long())
    x = ordered[ranks]
    below = torch.searchsorted(ordered, x, right=True)  # how many values are <= each x
    return [[float(v), float(k) / n] for v, k in zip(x, below)]


# ---------------------------------------------------------------------- adversarial
class PixelBatches:
    """Re-iterable test batches in [0, 1] pixel space on `device` (at most `max_examples`)."""

    def __init__(self, loader, device: torch.device, max_examples: int | None = None) -> None:
        self.loader, self.device, self.max_examples = loader, device, max_examples

    def __len__(self) -> int:  # batches, for the progress bar
        if self.max_examples is None:
            return len(self.loader)
        return min(len(self.loader), math.ceil(self.max_examples / self.loader.batch_size))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        seen = 0
        for images, labels in self.loader:
            if self.max_examples is not None:
                images, labels = images[: self.max_examples - seen], labels[: self.max_examples - seen]
            if len(labels) == 0:
                return
            seen += len(labels)
            yield to_unit_range(images.to(self.device)), labels.to(self.device)


def adversarial(model, datamodule, settings, folder: Path, device: torch.device, title: str,
                loggers=(), progress: bool = True) -> list[dict]:
    """FGSM and BIM against the posterior predictive (the paper's Figures 3 a/b and 4).

    `settings`: epsilons, attacks, bim_steps, attack_samples (members of the attacked
    predictive), eval_samples (members that evaluate the attacked images), max_examples,
    batch_size (None: the data's evaluation batch size).
    Attacks run in [0, 1] pixel space; the model sees the images normalised as in training.
    """
    model.eval()
    model.enable_test_noise()
    # cached by the test pass under inference mode; autograd needs normal tensors
    mean, std = (stat.clone() for stat in datamodule.statistics_on(device))

    def attack_log_probs(x: Tensor) -> Tensor:
        return model.predict_log_probs(normalize(x, mean, std), settings["attack_samples"])

    def eval_log_probs(x: Tensor) -> Tensor:  # other members than the attacked ones
        return model.predict_log_probs(normalize(x, mean, std), settings["eval_samples"], first=settings["attack_samples"])

    datamodule.setup("test")
    if settings.get("batch_size"):  # gradients through `attack_samples` members: batches are heavier
        datamodule.eval_batch_size = int(settings["batch_size"])
    batches = PixelBatches(datamodule.test_dataloader(), device, settings.get("max_examples"))
    rows = adversarial_evaluation(
        attack_log_probs, eval_log_probs, batches, epsilons=tuple(settings["epsilons"]),
        attacks=tuple(settings["attacks"]), bim_steps=settings["bim_steps"], progress=progress,
    )
    write_results(rows, folder)
    figure_path = save_figure(adversarial_figure({title: rows}, title=f"{title}: adversarial robustness"),
                              folder / "adversarial.png")
    print_table(
        "Adversarial accuracy / mean entropy", ["attack", "ε", "accuracy", "entropy"],
        [[r["attack"], f"{r['epsilon']:.2f}", r["accuracy"], r["mean_entropy"]] for r in rows],
    )
    log_to_wandb(loggers, images={"adversarial/curves": figure_path},
                 curves={"adversarial/epsilon": adversarial_curve(rows)})
    return rows


def adversarial_curve(rows: list[dict]) -> list[dict[str, float]]:
    """One W&B row per ε: `adversarial/epsilon` and `adversarial/<attack>/{accuracy,mean_entropy}`."""
    points: dict[float, dict[str, float]] = {}
    for r in rows:
        point = points.setdefault(float(r["epsilon"]), {"adversarial/epsilon": float(r["epsilon"])})
        point.update({f"adversarial/{r['attack']}/{k}": float(r[k]) for k in ("accuracy", "mean_entropy")})
    return [points[eps] for eps in sorted(points)]


# ---------------------------------------------------------------------- ablation, structure, reliability
def reliability_table(probs, targets, n_bins: int = 10) -> tuple[list[str], list[list[float]]]:
    """The reliability diagram's bins as a W&B table (empty bins left out)."""
    bins = reliability_bins(probs, targets, n_bins)
    columns = ["lower", "upper", "confidence", "accuracy", "count"]
    rows = [[float(bins[c][i]) for c in columns] for i in range(n_bins) if bins["count"][i] > 0]
    return columns, rows


def write_sample_ablation(rows: list[dict], folder: Path, title: str, loggers=()) -> None:
    """The MC-sample ablation table and its plot."""
    write_ablation(rows, folder)
    figure_path = save_figure(ablation_figure({title: rows}, title=f"{title}: Monte Carlo samples"),
                              folder / "ablation.png")
    shown = [r for r in rows if r["n_samples"] in {1, 2, 5, 10, 20, 30, 50, 100} or r is rows[-1]]
    print_table("MC-sample ablation", ["S", "error", "NLL", "ECE"],
                 [[r["n_samples"], r["error"], r["nll"], r["ece"]] for r in shown])
    columns = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    log_to_wandb(loggers, images={"test/sample_ablation": figure_path},
                 tables={"test/sample_ablation_table": (columns, [[r[c] for c in columns] for r in rows])},
                 curves={"ablation/n_samples": [{f"ablation/{c}": float(r[c]) for c in columns} for r in rows]})


@torch.no_grad()
def write_structure(model, folder: Path, title: str, n_samples: int = 100, loggers=()) -> dict | None:
    """The structure posterior of a method that learns one (DBSN, FBN, MAP); None otherwise."""
    probs = model.structure_probabilities()
    net = getattr(model, "net", None)
    if probs is None or net is None:
        return None
    summary, figure_path = write_structure_posterior(
        probs, model.prediction_structures(n_samples), net.edges, net.op_names, folder,
        f"{title}: structure posterior", labels=edge_names_of(model),
    )
    log_to_wandb(loggers, images={"structure/final": figure_path})
    return summary
