"""Dataset shift (Ovadia et al. 2019): each severity's mean over corruptions and the box plots over
corruptions, one box per method."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, md_table, order, slug
from dbsn.evaluation.report.writer import write_figure, write_section
from dbsn.evaluation.shift import SHIFT_METRICS, shift_boxplots
from dbsn.methods.registry import METHOD_ORDER


def shift_section(report: Report, ok: list[Run]) -> str:
    per_method: dict[tuple[str, str], dict[tuple[str, int], dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    sources = set()
    for r in ok:
        path = r.path / "evaluation" / "shift" / "metrics.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        sources.add(record.get("source", "published"))
        for row in record["rows"]:
            for metric in SHIFT_METRICS:
                per_method[r.dataset, r.method][row["corruption"], int(row["severity"])][metric].append(row[metric])
    if not per_method:
        return ""
    generated = any(source != "published" for source in sources)
    text, csv_rows = "", []
    for dataset in order({d for d, _ in per_method}, DATASET_ORDER):
        methods = order({m for d, m in per_method if d == dataset}, METHOD_ORDER)
        # each corruption x severity averaged over the method's seeds, then boxes over corruptions
        rows_of = {
            m: [
                {"corruption": c, "severity": sv, **{k: float(np.mean(v)) for k, v in metrics.items()}}
                for (c, sv), metrics in per_method[dataset, m].items()
            ]
            for m in methods
        }
        severities = sorted({row["severity"] for rows in rows_of.values() for row in rows})
        table = []
        for m in methods:
            for metric in ("error", "ece", "nll"):
                means = [np.mean([row[metric] for row in rows_of[m] if row["severity"] == sv]) for sv in severities]
                overall = float(np.mean([row[metric] for row in rows_of[m]]))
                table.append([m, metric, *(f"{v:.4f}" for v in means), f"{overall:.4f}"])
                csv_rows += [[m, dataset, metric, sv, float(v)] for sv, v in zip(severities, means)]
        name = slug(f"shift_boxplots_{dataset}") + ".png"
        label = "generated corruptions, not the published files" if generated else "published files"
        write_figure(report, shift_boxplots(rows_of, title=f"{dataset}: dataset shift ({label})"), name)
        text += (
            f"### {dataset}\n\n"
            + md_table(["method", "metric", *(f"severity {sv}" for sv in severities), "mean"], table)
            + f"\n![dataset shift]({name})\n\n"
        )
    return write_section(
        report,
        "shift",
        "Dataset shift",
        "Every corruption of the test set at every severity ("
        + (
            "generated corruptions, made by `dbsn.data.shift`'s generator with CIFAR-10-C's parameters: NOT the "
            "published CIFAR-10-C / -100-C files"
            if generated
            else "the published CIFAR-10-C / -100-C files"
        )
        + "), as in Ovadia et al. (2019): each severity's mean over corruptions (each corruption averaged over seeds "
        "first), and box plots over corruptions of ECE and error, one box per method.",
        text,
        ["method", "dataset", "metric", "severity", "mean over corruptions"],
        csv_rows,
    )
