"""What each method costs: parameters, FLOPs, epoch time and peak memory with one Pareto figure
(quality against prediction FLOPs) per dataset, and the training wall time beside DBSN's."""

from __future__ import annotations

import statistics
from collections import defaultdict

import numpy as np

from dbsn.evaluation.plots import pareto_figure
from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, fmt, md_table, mean_std, order
from dbsn.evaluation.report.writer import write_figure, write_section
from dbsn.methods.registry import METHOD_ORDER

#: the cost table's columns: (label, key of metrics.json's `cost`, scale, format)
COST_COLUMNS = (
    ("parameters", "params", 1.0, "{:,.0f}"),
    ("training MFLOPs / image", "train_flops_per_image", 1e-6, "{:,.1f}"),
    ("prediction MFLOPs / image", "predict_flops_per_image", 1e-6, "{:,.1f}"),
    ("S", "n_samples", 1.0, "{:.0f}"),
    ("s / epoch", "epoch_seconds", 1.0, "{:,.1f}"),
    ("peak memory MiB", "peak_memory_mib", 1.0, "{:,.0f}"),
)


def cost_section(report: Report, ok: list[Run]) -> str:
    """Each method's cost (metrics.json's `cost`, mean over seeds) and one Pareto figure per dataset:
    calibrated NLL, the unbiased CE² and error against prediction FLOPs per image, with their intervals
    (drawn within each metric's limits: `plots.interval_bar`)."""
    cells = defaultdict(list)
    for run in ok:
        if run.cost:
            cells[run.method, run.dataset].append(run)
    if not cells:
        return ""
    rows, csv_rows, figures = [], [], ""
    for dataset in order({d for _, d in cells}, DATASET_ORDER):
        points = []
        for method in order({m for m, d in cells if d == dataset}, METHOD_ORDER):
            runs = cells[method, dataset]
            means = {}
            for _, key, scale, _ in COST_COLUMNS:
                values = [r.cost[key] for r in runs if r.cost.get(key) is not None]
                means[key] = scale * float(np.mean(values)) if values else None
            rows.append(
                [
                    method,
                    dataset,
                    *("–" if means[key] is None else form.format(means[key]) for _, key, _, form in COST_COLUMNS),
                ]
            )
            csv_rows.append(
                [method, dataset, *(means[key] for _, key, _, _ in COST_COLUMNS), runs[0].cost.get("peak_memory_of")]
            )
            point = (
                {"method": method, "flops": 1e6 * means["predict_flops_per_image"]}
                if means["predict_flops_per_image"]
                else None
            )
            for label, key in (("calibrated_nll", "test/calibrated/nll"), ("ce2", "test/ce2"), ("error", "test/error")):
                values = [r.metrics[key] for r in runs if key in r.metrics]
                if point is not None and values:
                    cell = mean_std(values, [r.intervals.get(key) for r in runs if key in r.metrics])
                    point[label] = cell.mean
                    if cell.low is not None:
                        point[f"{label}_low"], point[f"{label}_high"] = cell.low, cell.high
            if point is not None:
                points.append(point)
        if len(points) > 1:
            name = f"pareto_{dataset}.png"
            if write_figure(report, pareto_figure(points, title=f"Quality against prediction cost on {dataset}"), name):
                figures += (
                    f"![Pareto view]({name})\n\nCalibrated NLL, the unbiased CE² (the calibration error the "
                    f"paired tests compare) and error of every method on {dataset} against its prediction "
                    "FLOPs per image (log scale), with 95 % intervals within each metric's limits (a hollow "
                    "marker: the estimate lies outside its interval); the dashed steps are the best value "
                    "reached at or below each cost, stepping down at each method no other beats on both axes."
                    "\n\n"
                )
    return write_section(
        report,
        "cost",
        "Cost",
        "What each method costs (metrics.json's `cost`, mean over seeds): parameters learned, FLOPs of one training "
        "step's forward and backward per image (all T structures, every member) and of the prediction at its S, counted "
        "by torch's FlopCounterMode (matmuls and convolutions, 2 per multiply-add), the training epoch's wall time (only "
        "comparable on the same hardware) and the process's peak memory (the GPU allocator's on a GPU, the resident set "
        "on a CPU).",
        md_table(["method", "dataset", *(label for label, *_ in COST_COLUMNS)], rows) + "\n" + figures,
        ["method", "dataset", *(key for _, key, _, _ in COST_COLUMNS), "peak_memory_of"],
        csv_rows,
    )


def time_section(report: Report, ok: list[Run]) -> str:
    """Training wall time per method and dataset, and its ratio to DBSN's on the same data (the
    paper's Table 5 compares DBSN's 1.2 h with VOGN's 13 h)."""
    values, epochs = defaultdict(list), defaultdict(set)
    for r in ok:
        if r.train_seconds is not None:
            values[r.method, r.dataset].append(r.train_seconds / 60.0)
            epochs[r.method, r.dataset].add(r.epochs)
    if not values:
        return ""
    rows, table = [], []
    for dataset in order({d for _, d in values}, DATASET_ORDER):
        reference = values.get(("dbsn", dataset))
        for method in order({m for m, d in values if d == dataset}, METHOD_ORDER):
            stats = mean_std(values[method, dataset])
            ratio = stats[0] / statistics.fmean(reference) if reference else None
            shown_epochs = ", ".join(str(e) for e in sorted(epochs[method, dataset], key=str))
            table.append(
                [
                    method,
                    dataset,
                    fmt(stats, 1, "train_seconds", 1 / 60),
                    shown_epochs,
                    "–" if ratio is None else f"{ratio:.2f}",
                ]
            )
            rows.append([method, dataset, *stats, shown_epochs, ratio])
    return write_section(
        report,
        "time",
        "Training time",
        "Wall time of training (the fit, validation included, resumed parts added up), in minutes, mean ± std [95 % t "
        "interval] (n runs), and its ratio to DBSN's mean on the same data. Only comparable between runs on the same "
        "hardware.",
        md_table(["method", "dataset", "minutes", "epochs", "× DBSN"], table) + "\n",
        [
            "method",
            "dataset",
            "mean_minutes",
            "std_minutes",
            "n",
            "low_minutes",
            "high_minutes",
            "interval",
            "epochs",
            "ratio_to_dbsn",
        ],
        rows,
    )
