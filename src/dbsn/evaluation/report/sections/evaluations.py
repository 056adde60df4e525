"""Any evaluation the report has no section for (a user's own): every number of its summary.json."""

from __future__ import annotations

import json
from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import STATS, fmt, md_table, mean_std, show, slug
from dbsn.evaluation.report.writer import write_section
from dbsn.methods.registry import METHOD_ORDER

#: evaluations with a section of their own; any other evaluation's numbers (its
#: `<name>/summary.json`) go into `other_evaluations_section`
OWN_SECTIONS = ("ood", "shift", "adversarial", "conformal")


def other_evaluations_section(report: Report, ok: list[Run]) -> str:
    """One table per evaluation the report has no section for (a user's own, by its name):
    every number of its summary, per (method, dataset), mean ± std over seeds."""
    found: dict[str, dict[tuple[str, str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        for path in sorted((r.path / "evaluation").glob("*/summary.json")):
            name = path.parent.name
            if name in OWN_SECTIONS:
                continue
            try:
                metrics = json.loads(path.read_text())["metrics"]
            except (ValueError, KeyError, TypeError):
                report.warnings.append(f"unreadable {show(path)}")
                continue
            for key, value in metrics.items():
                found[name][r.method, r.dataset, key].append(float(value))
    text = ""
    for name in sorted(found):
        cells = found[name]
        cell_order = sorted(
            cells,
            key=lambda k: (k[1], METHOD_ORDER.index(k[0]) if k[0] in METHOD_ORDER else len(METHOD_ORDER), k[0], k[2]),
        )
        stats = {cell: mean_std(cells[cell]) for cell in cell_order}
        table = md_table(
            ["method", "dataset", "metric", "value"], [[*cell, fmt(stats[cell], 4, cell[2])] for cell in cell_order]
        )
        text += write_section(
            report,
            f"evaluation_{slug(name)}",
            f"Evaluation: {name}",
            f"Every number of `evaluations=[{name}]` (its `summary.json`), mean ± std over seeds (n).",
            f"{table}\n",
            ["method", "dataset", "metric", *STATS],
            [[*cell, *stats[cell]] for cell in cell_order],
            page=table,
        )
    return text
