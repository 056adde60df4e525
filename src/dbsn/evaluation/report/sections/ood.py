"""Out-of-distribution detection: every score's AUROC, AUPR and FPR95 per (dataset, OOD set) with
the entropy CDF figures, the near / far OOD group means, and the score-by-method tables."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from dbsn.evaluation.ood import entropy_cdf_figure
from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import (
    INTERVAL_MARKS_NOTE,
    NUM_CLASSES,
    OOD_METRICS,
    STATS,
    fmt,
    md_table,
    mean_std,
    order,
    short,
    slug,
)
from dbsn.evaluation.report.writer import write_figure, write_section
from dbsn.methods.registry import METHOD_ORDER


def ood_records(folder: Path) -> list[Path]:
    """A run's OOD results: one `<set>/metrics.json` per OOD set (an evaluation written before
    several sets were possible has one `metrics.json`, read only when there are no set folders)."""
    per_set = sorted(folder.glob("*/metrics.json"))
    return per_set or [p for p in [folder / "metrics.json"] if p.is_file()]


def score_order(listed: list[list[str]]) -> list[str]:
    """One column order for the OOD scores of several records, read from the records (each lists
    its scores in its evaluation's table order): a score not yet placed goes right after the score
    before it in its record (first if none), so a `_members` variant, or a score that another
    method's evaluation left out, lands where the evaluation puts it."""
    placed: list[str] = []
    for names in listed:
        for i, name in enumerate(names):
            if name not in placed:
                placed.insert(placed.index(names[i - 1]) + 1 if i else 0, name)
    return placed


def ood_section(report: Report, ok: list[Run]) -> str:
    values, bounds, curves = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(list))
    listed = []  # each record's scores, in its order
    for r in ok:
        for path in ood_records(r.path / "evaluation" / "ood"):
            record = json.loads(path.read_text())
            ood = str(record["ood"])
            listed.append(list(record["scores"]))
            for score, metrics in record["scores"].items():
                for metric, value in metrics.items():
                    if isinstance(value, (int, float)):
                        values[r.dataset, ood, r.method, score, metric].append(value)
                        bounds[r.dataset, ood, r.method, score, metric].append(
                            (record.get("intervals") or {}).get(score, {}).get(metric)
                        )
            if (path.parent / "scores.npz").is_file():
                with np.load(path.parent / "scores.npz") as scores:
                    curves[r.dataset, ood][r.method].append(np.asarray(scores["out_entropy"], dtype=float).ravel())
    if not values:
        return ""
    rows, text = [], ""
    scores_in_order = score_order(listed)
    for dataset, ood in sorted({k[:2] for k in values}):
        table = []
        for method in order({k[2] for k in values if k[:2] == (dataset, ood)}, METHOD_ORDER):
            for score in order({k[3] for k in values if k[:3] == (dataset, ood, method)}, scores_in_order):
                cell = {
                    metric: mean_std(
                        values[dataset, ood, method, score, metric], bounds[dataset, ood, method, score, metric]
                    )
                    for metric in sorted({k[4] for k in values if k[:4] == (dataset, ood, method, score)})
                }
                table.append([method, score, *(fmt(cell.get(m), 4, m) for m, _ in OOD_METRICS)])
                rows += [[method, dataset, ood, score, m, *s] for m, s in cell.items()]
        text += f"### {dataset} (in-distribution) vs {ood} (OOD)\n\n"
        text += md_table(["method", "score", *(label for _, label in OOD_METRICS)], table) + "\n"
        if curves[dataset, ood]:
            pooled = {m: np.concatenate(curves[dataset, ood][m]) for m in order(curves[dataset, ood], METHOD_ORDER)}
            name = slug(f"ood_entropy_cdf_{dataset}_{ood}") + ".png"
            figure = entropy_cdf_figure(
                pooled,
                title=f"Predictive entropy on {ood} (trained on {dataset})",
                num_classes=NUM_CLASSES.get(dataset),
            )
            if write_figure(report, figure, name):
                text += (
                    f"![entropy CDF]({name})\n\nEmpirical CDF of the predictive entropy on the {ood} test set, "
                    "pooled over each method's seeds: a curve further right (more high-entropy "
                    "predictions on data it was not trained on) is better.\n\n"
                )
    return write_section(
        report,
        "ood",
        "Out-of-distribution detection",
        "Each score (the predictive's entropy, mutual information and max probability; OpenOOD's max-logit, energy, "
        "Mahalanobis, KNN, ViM and ODIN where evaluated) separates in-distribution test data from the OOD set; AUROC "
        "and AUPR (OOD as positive) higher is better, FPR95 (false-positive rate at 95% true-positive rate) lower is "
        "better; fractions, mean ± std [95 % interval] (n seeds): one seed's interval resamples both test sets; over "
        "seeds, the interval adds the test sets' noise the seeds share at its upper bound. " + INTERVAL_MARKS_NOTE,
        text,
        ["method", "dataset", "ood", "score", "metric", *STATS],
        rows,
    )


def ood_groups_section(report: Report, ok: list[Run]) -> str:
    values, bounds = defaultdict(list), defaultdict(list)
    groups_seen: dict[str, list[str]] = {}
    for r in ok:
        path = r.path / "evaluation" / "ood" / "groups.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        groups_seen.update(record.get("groups", {}))
        for key, value in record["metrics"].items():
            _, group, score, metric = key.split("/")
            values[r.dataset, r.method, group, score, metric].append(value)
            bounds[r.dataset, r.method, group, score, metric].append((record.get("intervals") or {}).get(key))
    if not values:
        return ""
    table, csv_rows = [], []
    for dataset, method, group, score in sorted(
        {k[:4] for k in values},
        key=lambda k: (k[0], METHOD_ORDER.index(k[1]) if k[1] in METHOD_ORDER else 99, k[1], k[2], k[3]),
    ):
        cell = {
            m: mean_std(values[dataset, method, group, score, m], bounds[dataset, method, group, score, m])
            for m, _ in OOD_METRICS
            if values[dataset, method, group, score, m]
        }
        table.append([method, dataset, group, score, *(fmt(cell.get(m), 4, m) for m, _ in OOD_METRICS)])
        csv_rows += [[method, dataset, group, score, m, *st] for m, st in cell.items()]
    described = "; ".join(f"{g}: {', '.join(sets)}" for g, sets in groups_seen.items())
    return write_section(
        report,
        "ood_groups",
        "Near and far OOD",
        f"Means over the OOD sets of each group ({described}), as OpenOOD v1.5 reports them; OOD is the positive class "
        "of AUROC, AUPR and FPR95. " + INTERVAL_MARKS_NOTE,
        md_table(["method", "dataset", "group", "score", *(label for _, label in OOD_METRICS)], table) + "\n",
        ["method", "dataset", "group", "score", "metric", *STATS],
        csv_rows,
        markdown=False,
    )


def ood_scores_section(report: Report, ok: list[Run]) -> str:
    """Score by method: for each in-distribution set and each OOD set or near / far group, one row
    per method and one column per detection score, AUROC and FPR95 in %: which score detects best
    for which method, and whether a method's own uncertainty beats a plain network's logits or
    features."""
    values: dict[tuple, list[float]] = defaultdict(list)
    listed = []  # each record's scores, in its order
    for r in ok:
        folder = r.path / "evaluation" / "ood"
        for path in ood_records(folder):
            record = json.loads(path.read_text())
            listed.append(list(record["scores"]))
            for score, metrics in record["scores"].items():
                for metric in ("auroc", "fpr95"):
                    if isinstance(metrics.get(metric), (int, float)):
                        values[r.dataset, str(record["ood"]), r.method, score, metric].append(metrics[metric])
        groups = folder / "groups.json"
        if groups.is_file():
            for key, value in json.loads(groups.read_text())["metrics"].items():
                _, group, score, metric = key.split("/")
                if metric in ("auroc", "fpr95"):
                    values[r.dataset, f"{group} (group mean)", r.method, score, metric].append(value)
    if not values:
        return ""
    text, rows = "", []
    scores_in_order = score_order(listed)
    for dataset, target in sorted({k[:2] for k in values}, key=lambda k: (k[0], "group mean" not in k[1], k[1])):
        keys = [k for k in values if k[:2] == (dataset, target)]
        scores = order({k[3] for k in keys}, scores_in_order)
        methods = order({k[2] for k in keys}, METHOD_ORDER)
        for metric, label in (("auroc", "AUROC (%) ↑"), ("fpr95", "FPR95 (%) ↓")):
            table = []
            for method in methods:
                cells = []
                for score in scores:
                    found = values.get((dataset, target, method, score, metric))
                    cell = mean_std(found) if found else None
                    cells.append(short(cell, 1, 100.0))
                    if cell is not None:
                        rows.append([method, dataset, target, score, metric, *cell])
                table.append([method, *cells])
            text += f"### {dataset} vs {target}: {label}\n\n" + md_table(["method", *scores], table) + "\n"
    return write_section(
        report,
        "ood_scores",
        "OOD detection by score and method",
        "One column per detection score (higher is more OOD for every score; `_members`: averaged over the members "
        "rather than computed on their mean logits or predictive; what each is computed on: each run's "
        "`ood/<set>/metrics.json`, `computed_on`), one row per method; mean ± std over seeds, in %. A dash: the score "
        "was not evaluated or does not apply (ViM needs a linear last layer; a `_members` score needs more than one "
        "member).",
        text,
        ["method", "dataset", "ood", "score", "metric", *STATS],
        rows,
    )
