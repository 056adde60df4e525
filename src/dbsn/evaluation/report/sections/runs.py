"""The runs that did not enter the tables: failed, or expected by a sweep and missing."""

from __future__ import annotations

from dbsn.evaluation.report.collect import Report
from dbsn.evaluation.report.format import show


def runs_section(report: Report) -> str:
    text = "## Runs not included\n\n"
    excluded = [r for r in report.runs if r.status != "ok"]
    if not excluded:
        return text + "None: every run found finished and every expected sweep job has a folder.\n\n"
    for r in excluded:
        overrides = " ".join(map(str, r.overrides)) or "no overrides recorded"
        log = f" — SLURM log: `{r.log}`" if r.log else ""
        text += (f"- **{r.status}**: {r.method} on {r.dataset}, seed {r.seed} — `{show(r.path)}` — "
                 f"`{overrides}` ({r.note}){log}\n")
    return text + "\n"
