"""Calibration under dataset shift (Ovadia et al. 2019, "Can you trust your model's uncertainty?").

The model predicts every corruption of the test set at every severity (CIFAR-10-C / CIFAR-100-C,
`dbsn.data.shift`), and each (corruption, severity) gets the test pass's metrics: error, NLL,
Brier and the 15-bin ECE. Reported under stable names:

    shift/<corruption>/<severity>/<metric>   one corruption at one severity
    shift/mean/<severity>/<metric>           each severity's mean over the corruptions
    shift/mean/<metric>                      the mean over every corruption and severity
                                             (the convention of Hendrycks & Dietterich and RobustBench)

and drawn as Ovadia et al. draw them: per severity, a box over the corruptions of ECE and of
error, one box per method (`shift_boxplots`; `dbsn.evaluation.report` puts a sweep's methods side by
side). Sets made by the generator (`dbsn.data.shift.write_generated_set`) are not the published
files: every output says `generated` (metrics.json's `source`, the figure's title, W&B's
`shift/generated`).

`corrupted_log_probs` is the one place a corrupted set is predicted: it keeps the log-probabilities
in the subject's `cache`, so that the conformal sets under shift (`dbsn.evaluation.conformal`,
`evaluations=[shift,conformal]`, either order) use the same predictions without a second pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from rich.console import Console

from dbsn.data.shift import (
    CORRUPTIONS,
    GENERATED_STANDARD,
    SEVERITIES,
    check_corrupted_files,
    corrupted_split,
    is_generated,
    write_generated_set,
)
from dbsn.evaluation.base import Evaluation, Subject
from dbsn.evaluation.progress import progress
from dbsn.evaluation.results import ConsoleTable, CsvTable, Results
from dbsn.evaluation.statistics import intervals_of
from dbsn.metrics.classification import brier_score, error_rate, expected_calibration_error, negative_log_likelihood
from dbsn.metrics.intervals import weighted_brier, weighted_ece, weighted_error, weighted_nll

__all__ = ["SHIFT_METRICS", "DatasetShift", "corrupted_log_probs", "shift_boxplots", "shift_summary"]

SHIFT_METRICS = ("error", "nll", "brier", "ece")


def _metrics(log_probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    probs = log_probs.exp()
    return {
        "error": float(error_rate(probs, labels)),
        "nll": float(negative_log_likelihood(log_probs, labels)),
        "brier": float(brier_score(probs, labels)),
        "ece": float(expected_calibration_error(probs, labels)),
    }


def _resampled(log_probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """`_metrics` at every row of `weights` (counts of the test images)."""
    log_probs = log_probs.double()
    probs = log_probs.exp()
    return {
        "error": weighted_error(probs, labels, weights),
        "nll": weighted_nll(log_probs, labels, weights),
        "brier": weighted_brier(probs, labels, weights),
        "ece": weighted_ece(probs, labels, weights),
    }


def shift_intervals(resampled: Sequence[tuple[int, dict[str, torch.Tensor]]], level: float) -> dict[str, list[float]]:
    """The 95 % intervals of the means of `shift_summary` from each (severity, metric rows) of the
    corrupted sets, all resampled with the same counts of the same test images: a mean's rows are
    the means of the sets' rows, resample by resample."""
    rows: dict[str, torch.Tensor] = {}
    for severity in sorted({s for s, _ in resampled}):
        at = [r for s, r in resampled if s == severity]
        rows.update({f"shift/mean/{severity}/{m}": torch.stack([r[m] for r in at]).mean(0) for m in SHIFT_METRICS})
    rows.update({f"shift/mean/{m}": torch.stack([r[m] for _, r in resampled]).mean(0) for m in SHIFT_METRICS})
    return intervals_of(rows, level)


def shift_summary(rows: Sequence[dict]) -> dict[str, float]:
    """The flat metric names of per-(corruption, severity) rows, with the per-severity and overall
    means over corruptions."""
    out = {f"shift/{r['corruption']}/{r['severity']}/{m}": r[m] for r in rows for m in SHIFT_METRICS}
    for severity in sorted({r["severity"] for r in rows}):
        at = [r for r in rows if r["severity"] == severity]
        out.update({f"shift/mean/{severity}/{m}": float(np.mean([r[m] for r in at])) for m in SHIFT_METRICS})
    out.update({f"shift/mean/{m}": float(np.mean([r[m] for r in rows])) for m in SHIFT_METRICS})
    return out


@torch.inference_mode()
def _predict(model, datamodule, images: torch.Tensor, device: torch.device, batch_size: int) -> torch.Tensor:
    return torch.cat(
        [
            model.predict_log_probs(datamodule.preprocess(batch.to(device))).float().cpu()
            for batch in images.split(batch_size)
        ]
    )


def corrupted_log_probs(
    subject: Subject, folder: Path, corruption: str, severity: int, batch_size: int = 500
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's log-probabilities (n, C) of one corrupted set (`folder`'s `corruption` at
    `severity`) and its labels (n,): predicted once per subject, kept in `subject.cache` for every
    evaluation that asks again (float32 on the CPU: 4 bytes per class and image, 30 MB for the 75
    sets of CIFAR-10-C, 300 MB for CIFAR-100-C)."""
    key = ("shift", str(Path(folder).resolve()), str(corruption), int(severity))
    if key not in subject.cache:
        images, labels = corrupted_split(folder, corruption, severity)
        subject.model.eval()
        subject.model.enable_test_noise()
        log_probs = _predict(subject.model, subject.datamodule, images, subject.device, batch_size)
        subject.cache[key] = (log_probs, labels)
    return subject.cache[key]


class DatasetShift(Evaluation):
    """Every corruption at every severity of the published CIFAR-10-C / -100-C files, or of a
    generated set (`evaluations=[shift]`); see the module docstring.

    Args:
        root: the folder of the published layout; None: `<data root>/<dataset name>-C`.
        corruptions: which ones; None: the 15 standard corruptions (the 14 the generator makes,
            not frost, for a generated set).
        severities: which severities (1..5).
        generate: where `root` holds no files, generate them from the test set first (labelled
            generated everywhere; files already there, published or generated, are never replaced).
        seed: of the generated corruptions.
        batch_size: images per prediction batch.
    """

    name = "shift"

    def __init__(
        self,
        root: str | None = None,
        corruptions: Sequence[str] | None = None,
        severities: Sequence[int] = SEVERITIES,
        generate: bool = False,
        seed: int = 0,
        batch_size: int = 500,
    ) -> None:
        self.root, self.corruptions = root, list(corruptions) if corruptions else None
        self.severities = [int(s) for s in (severities or SEVERITIES)]
        self.generate, self.seed, self.batch_size = bool(generate), int(seed), int(batch_size or 500)

    def folder(self, datamodule) -> Path:
        return Path(self.root or Path(datamodule.root) / f"{datamodule.name}-C")

    def plan(self, folder: Path) -> tuple[bool, list[str]]:
        """Whether to generate a corrupted set into `folder`, and the corruptions evaluated: files
        already there win over `generate` (published or generated, never overwritten)."""
        generate = self.generate and not (Path(folder) / "labels.npy").is_file()
        default = GENERATED_STANDARD if generate or is_generated(folder) else CORRUPTIONS
        return generate, list(self.corruptions or default)

    def check(self, subject: Subject) -> None:
        """The files of every chosen corruption are there (each missing one named, with how to
        get it), unless they will be generated."""
        super().check(subject)
        folder = self.folder(subject.datamodule)
        generate, corruptions = self.plan(folder)
        if not generate:
            check_corrupted_files(folder, corruptions)

    def prepare(self, subject: Subject) -> tuple[Path, list[str], bool]:
        """The folder, the corruptions evaluated and whether the set is generated; generates it
        first where `plan` says so (whichever evaluation asks first: `shift` or `conformal`)."""
        datamodule = subject.datamodule
        folder = self.folder(datamodule)
        generate, corruptions = self.plan(folder)
        if generate:
            datamodule.setup("test")
            Console().print(
                f"Generating {len(corruptions)} corruptions of the {datamodule.name} test set into {folder} "
                "(labelled as generated; not the published files)"
            )
            write_generated_set(
                folder,
                datamodule.test_set.images,
                datamodule.test_set.labels,
                corruptions,
                seed=self.seed,
                source=f"{datamodule.name} test set",
            )
        check_corrupted_files(folder, corruptions)
        return folder, corruptions, is_generated(folder)

    def run(self, subject: Subject) -> Results:
        model = subject.model
        folder, corruptions, generated = self.prepare(subject)
        source = "generated (dbsn.data.shift: not the published files)" if generated else "published"
        rows, resampled, weights = [], [], {}
        steps = [(c, s) for c in corruptions for s in self.severities]
        for corruption, severity in progress(steps, desc="Dataset shift", enabled=subject.progress):
            log_probs, labels = corrupted_log_probs(subject, folder, corruption, severity, self.batch_size)
            rows.append({"corruption": corruption, "severity": int(severity), **_metrics(log_probs, labels)})
            if len(labels) not in weights:  # every corrupted set: the same resamples of the same test images
                weights[len(labels)] = subject.statistics.weights(len(labels))
            resampled.append((int(severity), _resampled(log_probs, labels, weights[len(labels)])))
        means = shift_summary(rows)
        intervals = shift_intervals(resampled, subject.statistics.level)
        record = {
            "source": source,
            "generated": generated,
            "folder": str(folder),
            "n_samples": model.num_members,
            "corruptions": list(corruptions),
            "severities": self.severities,
            "rows": rows,
            "metrics": means,
            "intervals": intervals,
            "statistics": {
                **subject.statistics.record(),
                "interval": ("percentile bootstrap over the test images, every corrupted set resampled alike"),
            },
        }
        title = subject.title
        figure = shift_boxplots(
            {title: rows},
            title=f"{title}: dataset shift ({'generated corruptions' if generated else 'published files'})",
        )
        columns = ["corruption", "severity", *SHIFT_METRICS]
        summary = [[str(sv), *(means[f"shift/mean/{sv}/{m}"] for m in SHIFT_METRICS)] for sv in self.severities]
        return Results(
            metrics={**means, "shift/generated": float(generated)},
            intervals=intervals,
            files={
                "shift/metrics.json": record,
                "shift/shift.csv": CsvTable(columns, rows),
                "shift/shift_boxplots.png": figure,
            },
            images={"shift/boxplots": "shift/shift_boxplots.png"},
            tables={"shift/table": (columns, [[r[c] for c in columns] for r in rows])},
            console=[
                ConsoleTable(
                    f"Shift, {'generated' if generated else 'published'}: mean of {len(corruptions)} corruptions",
                    ["severity", *SHIFT_METRICS],
                    summary + [["all", *(means[f"shift/mean/{m}"] for m in SHIFT_METRICS)]],
                )
            ],
        )


def shift_boxplots(
    per_method: dict[str, Sequence[dict]], metrics: Sequence[str] = ("ece", "error"), title: str | None = None
) -> Figure:
    """Ovadia et al.'s figure: for each metric a panel, for each severity (0 = the clean test set
    when rows of severity 0 are given) a group of boxes over the corruptions, one box per method."""
    methods = list(per_method)
    severities = sorted({r["severity"] for rows in per_method.values() for r in rows}) or list(SEVERITIES)
    figure = Figure(figsize=(4.5 * len(metrics), 3.6), layout="constrained")
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    width = 0.8 / max(len(methods), 1)
    colours = [f"C{i}" for i in range(len(methods))]
    for ax, metric in zip(axes, metrics):
        for i, name in enumerate(methods):
            data = [[r[metric] for r in per_method[name] if r["severity"] == s] for s in severities]
            positions = [k + (i - (len(methods) - 1) / 2) * width for k in range(len(severities))]
            boxes = ax.boxplot(
                data, positions=positions, widths=width * 0.9, patch_artist=True, showfliers=True, manage_ticks=False
            )
            for patch in boxes["boxes"]:
                patch.set_facecolor(colours[i])
                patch.set_alpha(0.6)
            ax.plot([], [], color=colours[i], linewidth=6, alpha=0.6, label=name)
        ax.set_xticks(range(len(severities)), [str(s) for s in severities])
        ax.set_xlabel("corruption severity")
        ax.set_ylabel(metric.upper() if metric == "ece" else metric)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left", fontsize="small")
    if title:
        figure.suptitle(title)
    return figure
