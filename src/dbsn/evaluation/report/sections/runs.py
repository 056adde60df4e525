"""Which runs each row pools, and the runs that did not enter the tables: failed, expected by a
sweep and missing, with files of another run (inconsistent), or repeats of a run that did."""

from __future__ import annotations

from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, md_table, order, show
from dbsn.evaluation.report.writer import write_section
from dbsn.methods.registry import METHOD_ORDER


def rows_section(report: Report, ok: list[Run]) -> str:
    """Every row of the tables with the runs it pools (`pooling`): their seeds and folders, and
    what its setting changes from its method's main row."""
    if not ok:
        return ""
    cells: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in ok:
        cells[run.method, run.dataset].append(run)
    rows, csv_rows = [], []
    for dataset in order({d for _, d in cells}, DATASET_ORDER):
        for method in order({m for m, d in cells if d == dataset}, METHOD_ORDER):
            runs = sorted(cells[method, dataset], key=lambda r: (str(r.seed), str(r.path)))
            differences = ", ".join(runs[0].differences) or "–"
            rows.append(
                [
                    method,
                    dataset,
                    len(runs),
                    ", ".join(str(r.seed) for r in runs),
                    differences,
                    "<br>".join(f"`{show(r.path)}`" for r in runs),
                ]
            )
            csv_rows += [[method, r.base_method, dataset, r.seed, "; ".join(r.differences), show(r.path)] for r in runs]
    return write_section(
        report,
        "rows",
        "Rows and the runs they pool",
        "Each row of the tables is the mean over the runs it pools, and a row pools only runs that differ in their "
        "seed alone: the same resolved config (but for keys that do not change the run: output paths, loggers, "
        "progress bars, where the data lives, speed and memory knobs), the same S tested, the same epochs trained "
        "and, for an evaluation, the same evaluation settings. A method's runs of another setting are a row of their "
        "own, named by what differs from the setting most of its runs share.",
        md_table(["row", "dataset", "runs", "seeds", "differs from the method's main row in", "folders"], rows) + "\n",
        ["row", "method", "dataset", "seed", "differences", "path"],
        csv_rows,
    )


def runs_section(report: Report) -> str:
    text = "## Runs not included\n\n"
    excluded = [r for r in report.runs if r.status != "ok"]
    if not excluded:
        return text + "None: every run found finished and every expected sweep job has a folder.\n\n"
    for r in excluded:
        overrides = " ".join(map(str, r.overrides)) or "no overrides recorded"
        log = f" — SLURM log: `{r.log}`" if r.log else ""
        text += (
            f"- **{r.status}**: {r.method} on {r.dataset}, seed {r.seed} — `{show(r.path)}` — "
            f"`{overrides}` ({r.note}){log}\n"
        )
    return text + "\n"
