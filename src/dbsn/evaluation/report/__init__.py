"""Gather training runs into the paper's tables: `dbsn-report DIR [DIR ...] [--out OUT]`.

A run folder is any folder below the DIRs with `resolved_config.yaml` (a post-hoc posterior of a
run, `<run>/posthoc/<name>/`, is a run of method `<run's method>+<name>`), a Hydra job folder that
stopped before writing it, or a SLURM job's folder with `slurm.json`. A run is `ok` with
`metrics.json`, else `failed`; the jobs of a Hydra sweep (`multirun.yaml`) without a folder are
`missing`; a run whose files disagree about which run they belong to is `inconsistent`
(`dbsn.evaluation.identity`). A row pools only runs that differ in their seed alone (`pooling`):
another setting is a row of its own, named by what differs, and a second run of one setting and
seed is a `repeat`. Every run is in runs.csv; only `ok` runs enter the tables, the others are
named in report.md's "Runs not included".

A DIR that does not exist, or that holds no run, is an error. OUT (default outputs/report) must be
new, empty, or a folder an earlier report wrote (`report_files.json`, `folder.ReportFolder`). It
receives report.md and one .md/.csv pair per table (error, ECE, NLL, budget, calibration,
selective prediction, OOD, shift, conformal, calibrators, adversarial, ablation, time, any other
evaluation's summary) with their figures. Cells are mean ± sample std (ddof = 1) over seeds, with
the number of runs in parentheses. Every table: docs/evaluation.md ("The paper's tables").
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path

from dbsn.evaluation.report.collect import Report, Run, find_folders, load_run, missing_runs
from dbsn.evaluation.report.comparisons import equivalent_section, paired_section
from dbsn.evaluation.report.folder import ReportError, ReportFolder
from dbsn.evaluation.report.format import UNCONVERGED_MARK, show
from dbsn.evaluation.report.pooling import REPEAT, pool_runs
from dbsn.evaluation.report.population import PopulationCells
from dbsn.evaluation.report.published import published_section
from dbsn.evaluation.report.sections.ablation import ablation_section
from dbsn.evaluation.report.sections.accuracy import main_tables
from dbsn.evaluation.report.sections.adversarial import adversarial_section
from dbsn.evaluation.report.sections.budget import budget_section
from dbsn.evaluation.report.sections.calibration import calibration_section, calibrators_section
from dbsn.evaluation.report.sections.conformal import conformal_section
from dbsn.evaluation.report.sections.cost import cost_section, time_section
from dbsn.evaluation.report.sections.evaluations import other_evaluations_section
from dbsn.evaluation.report.sections.ood import ood_groups_section, ood_scores_section, ood_section
from dbsn.evaluation.report.sections.runs import rows_section, runs_section
from dbsn.evaluation.report.sections.selective import selective_section
from dbsn.evaluation.report.sections.shift import shift_section
from dbsn.evaluation.report.sections.tuning import tuning_section
from dbsn.evaluation.report.writer import write_csv, write_markdown
from dbsn.evaluation.runs import CONFIG_FILE
from dbsn.evaluation.statistics import Statistics

__all__ = ["Report", "ReportError", "Run", "build_report", "build_sweep_report", "check_sweep_report_folder"]


def _runs_below(dirs: list[Path]) -> tuple[list[Path], list[Path]]:
    """(run folders, sweep roots) below `dirs`; a folder that does not exist, or that holds no run
    and no sweep, is refused (`ReportError`)."""
    for folder in dirs:
        if not Path(folder).exists():
            raise ReportError(
                f"{folder} does not exist: give the folders that hold your runs (e.g. outputs/train, or a "
                "sweep's folder outputs/train/multiruns/<time>)."
            )
    folders, roots = find_folders(dirs)
    for folder in dirs:
        top = Path(folder).resolve()
        if not any(p == top or top in p.parents for p in [*folders, *roots]):
            raise ReportError(
                f"{folder} holds no run: a run folder holds {CONFIG_FILE} (and metrics.json once its run "
                "finished), as train.py writes under outputs/train/runs/<time>/; give such folders, a "
                "folder above them, or a sweep's folder (with multirun.yaml)."
            )
    return folders, roots


def build_report(
    dirs: list[Path],
    out: Path,
    reference: str = "dbsn",
    statistics: Statistics | None = None,
    choose: str = "move them away, or choose a new or empty folder",
) -> Report:
    """Read every run below `dirs` and write the tables, figures and report.md into `out`; paired
    differences against the method `reference`, with `statistics`' bootstrap. `out` must be new,
    empty, or a folder this report wrote before (`ReportFolder`); `choose` ends the refusal of any
    other (how the caller's user picks another folder)."""
    dirs = [Path(d) for d in dirs]
    folder = ReportFolder(Path(out), choose)
    folders, roots = _runs_below(dirs)
    folder.check()  # before anything is written
    runs = [load_run(path) for path in folders]
    report = Report(Path(out), runs, folder=folder)
    for root in roots:
        try:
            runs += missing_runs(root, runs)
        except Exception as err:  # noqa: BLE001 - e.g. a sweeper or sweep type we cannot expand
            report.warnings.append(f"could not expand the sweep in {show(root)}: {err!r}")
    report.warnings += pool_runs(runs)
    folder.begin()
    write_csv(
        report,
        "runs.csv",
        [
            "path",
            "method",
            "row",
            "dataset",
            "seed",
            "status",
            "test/error",
            "test/ece",
            "train_seconds",
            "overrides",
            "note",
            "slurm_log",
        ],
        [
            [
                show(r.path),
                r.base_method,
                r.method,
                r.dataset,
                r.seed,
                r.status,
                r.metrics.get("test/error"),
                r.metrics.get("test/ece"),
                r.train_seconds,
                " ".join(map(str, r.overrides)),
                r.note,
                r.log or "",
            ]
            for r in runs
        ],
    )
    ok = report.with_status("ok")
    report.warnings += _reference_notes(ok, reference)
    for run in ok:
        if run.stale:
            report.warnings.append(f"{run.method} on {run.dataset} (seed {run.seed}, {show(run.path)}): {run.stale}")
    for run in ok:  # a run still learning at its end: its method marked in every table, and said why here
        found = run.convergence
        if found.get("converged") is False:
            report.unconverged.add(run.method)
            report.warnings.append(
                f"{UNCONVERGED_MARK} {run.method} on {run.dataset} (seed {run.seed}) had not converged: its "
                f"training loss's linear fit over its last {found.get('window_epochs')} epochs fell by "
                f"{100 * found['last_tenth_drop']:.0f} % of the final loss across the run's last tenth "
                "(more than 10 %)"
            )
    counts = Counter(r.status for r in runs)
    others = "".join(f", {counts[s]} {s}" for s in ("inconsistent", REPEAT) if counts[s])
    text = (
        f"# Results\n\nGenerated {datetime.now():%Y-%m-%d %H:%M} from {', '.join(show(Path(d).resolve()) for d in dirs)}: "
        f"{len(runs)} runs — {counts['ok']} ok, {counts['failed']} failed, {counts['missing']} missing{others}. "
        "Every run is listed in `runs.csv`; only finished (ok) runs enter the tables. A row pools only runs that "
        "differ in their seed alone; a run of another setting is a row of its own, named by what differs "
        "(see \"Rows and the runs they pool\"). Every row of every table is a row of \"Training budgets\" "
        "(`budget.md`): the epochs, optimiser steps, images seen and training time its runs cost.\n\n"
    )
    if ok:
        cells = PopulationCells(statistics)  # each run scored once, for every table of test-pass metrics
        text += main_tables(report, ok, cells) + budget_section(report, ok) + tuning_section(report, ok)
        text += published_section(report, ok)
        text += paired_section(report, ok, reference, statistics)
        text += calibration_section(report, ok, cells) + calibrators_section(report, ok) + cost_section(report, ok)
        text += equivalent_section(report, ok, statistics=statistics)
        text += selective_section(report, ok, cells)
        text += ood_section(report, ok) + ood_groups_section(report, ok) + ood_scores_section(report, ok)
        text += shift_section(report, ok) + conformal_section(report, ok)
        text += adversarial_section(report, ok) + other_evaluations_section(report, ok) + ablation_section(report, ok)
        text += time_section(report, ok)
    else:
        text += "No finished runs.\n\n"
    text += rows_section(report, ok) + runs_section(report)
    if report.warnings:
        text += "## Notes\n\n" + "".join(f"- {w}\n" for w in report.warnings) + "\n"
    write_markdown(report, "report.md", text)
    folder.finish()
    return report


def _reference_notes(ok: list[Run], reference: str) -> list[str]:
    """A note for each dataset where the reference method's runs are all in rows of other settings:
    no row is called `reference`, so the paired differences against it are left out there."""
    notes = []
    for dataset in sorted({r.dataset for r in ok}):
        rows = {r.method for r in ok if r.dataset == dataset and r.base_method == reference}
        if rows and reference not in rows:
            notes.append(
                f"on {dataset}, no row is {reference}: its runs are in rows of different settings "
                f"({'; '.join(sorted(rows))}), so no paired differences against it are shown; choose one "
                "of them as the reference (dbsn-report --reference '<row>')"
            )
    return notes


def check_sweep_report_folder(folder: Path) -> None:
    """Refuse, before a sweep is evaluated, a `<folder>/report` that holds files the report did not write."""
    ReportFolder(Path(folder) / "report", _sweep_choice(folder)).check()


def _sweep_choice(folder: Path) -> str:
    return f"move them away, or write the sweep's report elsewhere (dbsn-report {folder} --out <a new folder>)"


def build_sweep_report(folder: Path, reference: str = "dbsn", statistics: Statistics | None = None) -> Report:
    """The report of every run under `folder` (a sweep), into `folder/report`."""
    return build_report([folder], Path(folder) / "report", reference, statistics, _sweep_choice(folder))
