"""Conformal prediction sets (`evaluations=[conformal]`): coverage and set sizes of THR, APS and
RAPS per dataset and nominal level."""

from __future__ import annotations

import json
from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import STATS, md_table, mean_std, order, short
from dbsn.evaluation.report.writer import write_section
from dbsn.methods.registry import METHOD_ORDER

#: the conformal table's columns: (metric under conformal/<level>/<score>/, label, digits)
CONFORMAL_COLUMNS = (
    ("coverage", "coverage", 3),
    ("size", "mean size ↓", 2),
    ("ssc", "size-stratified coverage ↑", 3),
    ("class_coverage_min", "lowest class coverage ↑", 3),
    ("empty", "empty sets", 3),
    ("shift/coverage", "coverage under shift", 3),
    ("shift/size", "size under shift", 2),
)
CONFORMAL_SCORES = ("thr", "aps", "aps_randomized", "raps", "raps_randomized")
#: how the conformal table names each empty-set convention (`evaluations.conformal.allow_empty_sets`)
CONFORMAL_SET_RULES = {
    False: "never empty: the top label alone where {y : s ≤ q̂} is empty (allow_empty_sets=false, "
    "the authors' allow_zero_sets=False)",
    True: "{y : s ≤ q̂}, empty sets kept (allow_empty_sets=true)",
}


def conformal_section(report: Report, ok: list[Run]) -> str:
    """Conformal prediction sets (`evaluations=[conformal]`): per dataset and level, one row per
    (method, score) with coverage, mean set size, size-stratified and classwise coverage, the share
    of empty sets and, where the shift evaluation ran beside it, coverage and size under shift
    (means over corruptions and severities); "" when no run has them. Each table says which
    empty-set convention its runs used (`allow_empty_sets` in metrics.json; absent: written before
    the setting, when empty sets were always kept); runs of different conventions are never
    averaged together, and a table holding both gets a column `empty sets allowed`."""
    values: dict[tuple, list[float]] = defaultdict(list)
    for r in ok:
        path = r.path / "evaluation" / "conformal" / "metrics.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        allow = bool(record.get("allow_empty_sets", True))
        for key, value in (record.get("metrics") or {}).items():
            parts = key.split("/")
            if len(parts) >= 4 and parts[0] == "conformal" and isinstance(value, (int, float)):
                values[r.dataset, parts[1], r.method, allow, parts[2], "/".join(parts[3:])].append(float(value))
    if not values:
        return ""
    text, rows = "", []
    for dataset, level in sorted({k[:2] for k in values}, key=lambda k: (k[0], float(k[1]))):
        keys = [k for k in values if k[:2] == (dataset, level)]
        columns = [c for c in CONFORMAL_COLUMNS if any(k[5] == c[0] for k in keys)]
        rules = sorted({k[3] for k in keys})
        table = []
        for method in order({k[2] for k in keys}, METHOD_ORDER):
            for allow in sorted({k[3] for k in keys if k[2] == method}):
                for score in order({k[4] for k in keys if k[2:4] == (method, allow)}, CONFORMAL_SCORES):
                    cells = []
                    for metric, _, digits in columns:
                        found = values.get((dataset, level, method, allow, score, metric))
                        cell = mean_std(found) if found else None
                        cells.append(short(cell, digits))
                        if cell is not None:
                            rows.append([method, dataset, level, score, str(allow).lower(), metric, *cell])
                    table.append([method, score, *(["yes" if allow else "no"] if len(rules) > 1 else []), *cells])
        if len(rules) > 1:
            line = (
                "Sets: both conventions ran; `empty sets allowed` no: "
                + CONFORMAL_SET_RULES[False]
                + "; yes: "
                + CONFORMAL_SET_RULES[True]
                + "."
            )
        else:
            line = "Sets: " + CONFORMAL_SET_RULES[rules[0]] + "."
        header = [
            "method",
            "score",
            *(["empty sets allowed"] if len(rules) > 1 else []),
            *(label for _, label, _ in columns),
        ]
        text += f"### {dataset}, nominal coverage {level} %\n\n{line}\n\n" + md_table(header, table) + "\n"
    return write_section(
        report,
        "conformal",
        "Conformal prediction sets",
        "Sets of labels from each method's predictive that hold the true label with the nominal probability "
        "(`evaluate.py evaluations=[conformal]`), calibrated on a split that never overlaps the evaluated images: THR "
        "(Sadinle et al. 2019), APS (Romano et al. 2020) and RAPS (Angelopoulos et al. 2021), each also randomised. By "
        "default a set is never empty: where the rule s ≤ q̂ leaves none, it holds the top label (the authors' "
        "convention; this only adds labels, so coverage can only rise); `evaluations.conformal.allow_empty_sets=true` "
        "keeps empty sets. Each table says which ran. Coverage should be at least the nominal level; at equal coverage "
        "smaller sets are better; size-stratified and lowest class coverage show whether sets adapt to difficulty (no "
        "conformal method guarantees them); under shift the calibration split stays clean, so coverage falls. Mean ± "
        "std over seeds.",
        text,
        ["method", "dataset", "level", "score", "allow_empty_sets", "metric", *STATS],
        rows,
    )
