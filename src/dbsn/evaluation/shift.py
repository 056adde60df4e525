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
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from dbsn.data.shift import SEVERITIES, check_corrupted_files, corrupted_split, is_generated
from dbsn.evaluation.plots import save_figure
from dbsn.evaluation.tracking import log_to_wandb
from dbsn.metrics.classification import brier_score, error_rate, expected_calibration_error, negative_log_likelihood

__all__ = ["SHIFT_METRICS", "shift_boxplots", "shift_evaluation", "shift_summary"]

SHIFT_METRICS = ("error", "nll", "brier", "ece")


def _metrics(log_probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    probs = log_probs.exp()
    return {"error": float(error_rate(probs, labels)), "nll": float(negative_log_likelihood(log_probs, labels)),
            "brier": float(brier_score(probs, labels)), "ece": float(expected_calibration_error(probs, labels))}


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
    return torch.cat([model.predict_log_probs(datamodule.preprocess(batch.to(device))).float().cpu()
                      for batch in images.split(batch_size)])


def shift_evaluation(model, datamodule, folder: Path, corruptions: Sequence[str], severities: Sequence[int],
                     out: Path, device: torch.device, title: str, loggers=(), progress: bool = True,
                     batch_size: int = 500) -> dict:
    """Predict every corruption of `folder` (the published layout) at every severity with
    `model`'s Bayes ensemble; write `out/metrics.json`, `out/shift.csv` and `out/shift_boxplots.png`
    and log them. The files are checked (and every missing one named) before anything is predicted."""
    folder = Path(folder)
    check_corrupted_files(folder, corruptions)
    generated = is_generated(folder)
    source = "generated (dbsn.data.shift: not the published files)" if generated else "published"
    model.eval()
    model.enable_test_noise()
    rows = []
    steps = [(c, s) for c in corruptions for s in severities]
    for corruption, severity in tqdm(steps, desc="Dataset shift", disable=not progress):
        images, labels = corrupted_split(folder, corruption, severity)
        rows.append({"corruption": corruption, "severity": int(severity),
                     **_metrics(_predict(model, datamodule, images, device, batch_size), labels)})
    results = shift_summary(rows)
    out.mkdir(parents=True, exist_ok=True)
    record = {"source": source, "generated": generated, "folder": str(folder), "n_samples": model.num_members,
              "corruptions": list(corruptions), "severities": [int(s) for s in severities], "rows": rows,
              "metrics": results}
    (out / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    with open(out / "shift.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["corruption", "severity", *SHIFT_METRICS])
        writer.writeheader()
        writer.writerows(rows)
    figure = shift_boxplots({title: rows}, title=f"{title}: dataset shift ({'generated corruptions' if generated else 'published files'})")
    path = save_figure(figure, out / "shift_boxplots.png")
    log_to_wandb(loggers, {**results, "shift/generated": float(generated)}, images={"shift/boxplots": path},
                 tables={"shift/table": (["corruption", "severity", *SHIFT_METRICS],
                                         [[r["corruption"], r["severity"], *(r[m] for m in SHIFT_METRICS)] for r in rows])})
    return record


def shift_boxplots(per_method: dict[str, Sequence[dict]], metrics: Sequence[str] = ("ece", "error"),
                   title: str | None = None) -> Figure:
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
            boxes = ax.boxplot(data, positions=positions, widths=width * 0.9, patch_artist=True, showfliers=True,
                               manage_ticks=False)
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
