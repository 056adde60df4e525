"""Gather training runs into the paper's tables: `dbsn-report DIR [DIR ...] [--out OUT]`.

A run folder is any folder below the DIRs with `resolved_config.yaml` (post-hoc posteriors of a
run, `<run>/posthoc/<name>/`, are runs of method `<run's method>+<name>`, e.g. map_fixed+laplace; or a Hydra train job
folder that stopped before writing it, or a SLURM job's folder with `slurm.json`; a run that
did not finish is listed with its SLURM log). Its status is `ok` when `metrics.json` exists, else
`failed`; for every Hydra sweep root (a folder with `multirun.yaml`) the expected jobs (the
cartesian product of the sweeper's params and command-line sweeps) without a folder are listed
as `missing`. Every run is in runs.csv; only `ok` runs enter the tables, the others are named
in report.md's "Runs not included".

Writes into OUT (default outputs/report): report.md, runs.csv, table1_error.{md,csv},
table2_ece.{md,csv}, table_nll.{md,csv}, calibration.{md,csv} (equal-width, equal-mass and
classwise ECE), selective.{md,csv} (AURC, E-AURC, AUGRC, risk at 80 % coverage) and, where runs
have evaluation outputs, ood.{md,csv} with one entropy-CDF figure per (dataset, OOD set),
ood_groups.csv (near / far OOD means), ood_scores.{md,csv} (every detection score by method), shift.{md,csv} with Ovadia et al.'s box plots per
dataset, conformal.{md,csv} (coverage and set sizes), calibrators.{md,csv} (each method after every post-hoc
calibrator), adversarial.{md,csv} with one figure per dataset, evaluation_<name>.{md,csv} for any other
evaluation (a user's own: every number of its summary.json), ablation.{md,csv}, published.csv (runs on the field's backbones beside the published figures) and time.{md,csv} (training wall time and its ratio to DBSN's, from
metrics.json's train_seconds). Cells are mean ± sample std (ddof = 1) over seeds, with the number
of runs in parentheses.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path

from dbsn.evaluation.report.collect import Report, Run, find_folders, load_run, missing_runs
from dbsn.evaluation.report.comparisons import equivalent_section, paired_section
from dbsn.evaluation.report.format import UNCONVERGED_MARK, show
from dbsn.evaluation.report.published import published_section
from dbsn.evaluation.report.sections.ablation import ablation_section
from dbsn.evaluation.report.sections.accuracy import main_tables
from dbsn.evaluation.report.sections.adversarial import adversarial_section
from dbsn.evaluation.report.sections.calibration import calibration_section, calibrators_section
from dbsn.evaluation.report.sections.conformal import conformal_section
from dbsn.evaluation.report.sections.cost import cost_section, time_section
from dbsn.evaluation.report.sections.evaluations import other_evaluations_section
from dbsn.evaluation.report.sections.ood import ood_groups_section, ood_scores_section, ood_section
from dbsn.evaluation.report.sections.runs import runs_section
from dbsn.evaluation.report.sections.selective import selective_section
from dbsn.evaluation.report.sections.shift import shift_section
from dbsn.evaluation.report.sections.tuning import tuning_section
from dbsn.evaluation.report.writer import write_csv, write_markdown
from dbsn.evaluation.statistics import Statistics

__all__ = ["Report", "Run", "build_report", "build_sweep_report"]


def build_report(dirs: list[Path], out: Path, reference: str = "dbsn", statistics: Statistics | None = None) -> Report:
    """Read every run below `dirs` and write the tables, figures and report.md into `out`; paired
    differences against the method `reference`, with `statistics`' bootstrap."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    folders, roots = find_folders([Path(d) for d in dirs])
    runs = [load_run(folder) for folder in folders]
    report = Report(out, runs)
    for root in roots:
        try:
            runs += missing_runs(root, runs)
        except Exception as err:  # noqa: BLE001 - e.g. a sweeper or sweep type we cannot expand
            report.warnings.append(f"could not expand the sweep in {show(root)}: {err!r}")
    write_csv(report, "runs.csv", ["path", "method", "dataset", "seed", "status", "test/error", "test/ece", "train_seconds",
                                   "overrides", "note", "slurm_log"],
              [[show(r.path), r.method, r.dataset, r.seed, r.status, r.metrics.get("test/error"),
                r.metrics.get("test/ece"), r.train_seconds, " ".join(map(str, r.overrides)), r.note, r.log or ""]
               for r in runs])
    ok = report.with_status("ok")
    for (method, dataset, seed), count in Counter((r.method, r.dataset, r.seed) for r in ok).items():
        if count > 1:
            report.warnings.append(f"{method} on {dataset} with seed {seed} finished {count} times: all are averaged")
    for run in ok:  # a run still learning at its end: its method marked in every table, and said why here
        found = run.convergence
        if found.get("converged") is False:
            report.unconverged.add(run.method)
            report.warnings.append(f"{UNCONVERGED_MARK} {run.method} on {run.dataset} (seed {run.seed}) had not converged: its "
                                   f"training loss's linear fit over its last {found.get('window_epochs')} epochs fell by "
                                   f"{100 * found['last_tenth_drop']:.0f} % of the final loss across the run's last tenth "
                                   "(more than 10 %)")
    counts = Counter(r.status for r in runs)
    text = (f"# Results\n\nGenerated {datetime.now():%Y-%m-%d %H:%M} from {', '.join(show(Path(d).resolve()) for d in dirs)}: "
            f"{len(runs)} runs — {counts['ok']} ok, {counts['failed']} failed, {counts['missing']} missing. "
            "Every run is listed in `runs.csv`; only finished (ok) runs enter the tables.\n\n")
    if ok:
        text += main_tables(report, ok) + tuning_section(report, ok) + published_section(report, ok)
        text += paired_section(report, ok, reference, statistics)
        text += calibration_section(report, ok) + calibrators_section(report, ok) + cost_section(report, ok) + equivalent_section(report, ok, statistics=statistics)
        text += selective_section(report, ok)
        text += ood_section(report, ok) + ood_groups_section(report, ok) + ood_scores_section(report, ok)
        text += shift_section(report, ok) + conformal_section(report, ok)
        text += adversarial_section(report, ok) + other_evaluations_section(report, ok) + ablation_section(report, ok)
        text += time_section(report, ok)
    else:
        text += "No finished runs.\n\n"
    text += runs_section(report)
    if report.warnings:
        text += "## Notes\n\n" + "".join(f"- {w}\n" for w in report.warnings) + "\n"
    write_markdown(report, "report.md", text)
    return report


def build_sweep_report(folder: Path, reference: str = "dbsn", statistics: Statistics | None = None) -> Report:
    """The report of every run under `folder` (a sweep), into `folder/report`."""
    return build_report([folder], Path(folder) / "report", reference, statistics)
