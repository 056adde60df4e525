"""The number of Monte Carlo samples S: test error, NLL and ECE of the Bayes ensemble of S samples."""

from __future__ import annotations

import statistics
from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, md_table, order
from dbsn.evaluation.report.writer import read_rows, write_section
from dbsn.methods.registry import METHOD_ORDER

#: the sample sizes shown in the table (where measured; all of them are in ablation.csv)
ABLATION_S = (1, 10, 100)


def ablation_section(report: Report, ok: list[Run]) -> str:
    values = defaultdict(lambda: defaultdict(list))  # (method, dataset, S) -> column -> values
    for r in ok:
        path = r.path / "evaluation" / "ablation" / "results.csv"
        for row in read_rows(path) if path.is_file() else []:
            cell = values[r.method, r.dataset, int(float(row["n_samples"]))]
            for column in ("error", "nll", "brier", "ece"):
                if row.get(column) not in (None, ""):
                    cell[column].append(float(row[column]) * (100.0 if column == "error" else 1.0))
    if not values:
        return ""
    found = sorted({k[2] for k in values})
    shown = [s for s in ABLATION_S if s in found] or found
    pairs = [
        (m, d)
        for d in order({k[1] for k in values}, DATASET_ORDER)
        for m in order({k[0] for k in values if k[1] == d}, METHOD_ORDER)
    ]
    columns = (("error", "error %", 2), ("nll", "NLL", 4), ("ece", "ECE", 4))
    header = ["method", "dataset", *(f"{label} S={s}" for _, label, _ in columns for s in shown), "seeds"]
    table, rows = [], []
    for m, d in pairs:
        cells = [(values.get((m, d, s), {}).get(c), digits) for c, _, digits in columns for s in shown]
        seeds = max(len(v) for s in found for v in values.get((m, d, s), {}).values())
        table.append([m, d, *(f"{statistics.fmean(v):.{digits}f}" if v else "–" for v, digits in cells), seeds])
        for s in found:
            cell = values.get((m, d, s))
            if cell:
                rows.append(
                    [
                        m,
                        d,
                        s,
                        *(statistics.fmean(cell[c]) if cell.get(c) else None for c in ("error", "nll", "brier", "ece")),
                        len(cell["error"]),
                    ]
                )
    return write_section(
        report,
        "ablation",
        "Number of Monte Carlo samples S",
        "Test error (%), NLL and ECE of the Bayes ensemble of S samples (lower is better for all three), mean over "
        f"seeds; S ∈ {{{', '.join(map(str, found))}}} measured (all of them in `ablation.csv`).",
        md_table(header, table) + "\n",
        ["method", "dataset", "n_samples", "error_pct", "nll", "brier", "ece", "n"],
        rows,
    )
