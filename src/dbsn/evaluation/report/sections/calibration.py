"""Calibration beyond the main tables: the plug-in ECEs beside the unbiased CE² and the metrics
after a temperature, and each method after every post-hoc calibrator it was evaluated with."""

from __future__ import annotations

from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import STATS, md_table, mean_std, order, short
from dbsn.evaluation.report.pooling import row_name
from dbsn.evaluation.report.population import PopulationCells
from dbsn.evaluation.report.sections.accuracy import per_method_table
from dbsn.evaluation.report.writer import write_section
from dbsn.methods.registry import METHOD_ORDER


def calibration_section(report: Report, ok: list[Run], cells: PopulationCells | None = None) -> str:
    return per_method_table(
        report,
        ok,
        "calibration",
        "Calibration beyond equal-width ECE",
        "The unbiased squared calibration error (CE², the one to compare: its interval covers the truth), then "
        "three plug-in ECEs of the test pass's Bayes ensemble, 15 bins each, biased upward: equal-width (Table 2's), "
        "equal-mass (bins of equal counts, which equal-width ECE's empty high-confidence bins hide) and classwise "
        "(every class's probability against its indicator, averaged over classes; Kull et al. 2019); then NLL, Brier and ECE "
        "calibrated (Ashukha et al. 2020): after one temperature fitted on the validation split, or without one by "
        "test-time 2-fold cross-validation (metrics.json's `calibration` says which), so that methods are compared "
        "at their best temperature. Lower is better.",
        [
            ("CE² (unbiased)", "test/ce2", 1.0, 5),
            ("ECE", "test/ece", 1.0, 4),
            ("equal-mass ECE", "test/adaptive_ece", 1.0, 4),
            ("classwise ECE", "test/classwise_ece", 1.0, 4),
            ("calibrated NLL", "test/calibrated/nll", 1.0, 4),
            ("calibrated Brier", "test/calibrated/brier", 1.0, 4),
            ("calibrated CE²", "test/calibrated/ce2", 1.0, 5),
            ("calibrated ECE", "test/calibrated/ece", 1.0, 4),
        ],
        cells,
    )


def calibrators_section(report: Report, ok: list[Run]) -> str:
    """Each method uncalibrated and after every post-hoc calibrator it was evaluated with
    (`evaluate.py ckpt_path=<run> posthoc=<calibrator>`): test NLL, ECE and error, one row per
    method, one column per calibrator the runs name (metrics.json's `calibrator`; the column is the
    last part of the run's method, `<method>+<name>`), in alphabetical order; "" when no run has a
    calibrator."""
    values: dict[tuple, list[float]] = defaultdict(list)
    found = False
    for r in ok:  # a row per trained setting, a column per calibrator and evaluation setting (`pooling.row_name`)
        base, posthoc = r.method, ""
        if r.calibrator:
            base, _, posthoc = r.base_method.rpartition("+")
            trained = r.differences[: len(r.differences) - len(r.evaluation_differences)]
            base, posthoc = row_name(base, trained), row_name(posthoc, r.evaluation_differences)
        found |= bool(posthoc)
        for key in ("test/nll", "test/ece", "test/error"):
            if key in r.metrics:
                values[r.dataset, base, posthoc, key].append(float(r.metrics[key]))
    if not found:
        return ""
    text, rows = "", []
    columns = ["", *sorted({k[2] for k in values} - {""})]
    for dataset in sorted({k[0] for k in values}):
        methods = order(
            {
                k[1]
                for k in values
                if k[0] == dataset and any((dataset, k[1], c, "test/nll") in values for c in columns[1:])
            },
            METHOD_ORDER,
        )
        for key, label, scale, digits in (
            ("test/nll", "test NLL ↓", 1.0, 4),
            ("test/ece", "ECE ↓", 1.0, 4),
            ("test/error", "test error (%) (argmax moves under some calibrators)", 100.0, 2),
        ):
            table = []
            for method in methods:
                cells = []
                for calibrator in columns:
                    seen = values.get((dataset, method, calibrator, key))
                    cell = mean_std([scale * v for v in seen]) if seen else None
                    cells.append(short(cell, digits) + ("" if cell is None else f" ({cell.n})"))
                    if cell is not None:
                        rows.append([method, dataset, calibrator or "none", key, *cell])
                table.append([method, *cells])
            text += f"### {dataset}: {label}\n\n" + md_table(["method", *(c or "none" for c in columns)], table) + "\n"
    return write_section(
        report,
        "calibrators",
        "Post-hoc calibrators",
        "Every method as trained (none) and after each calibrator fitted on the validation split (`evaluate.py "
        "ckpt_path=<run> posthoc=<calibrator>`; `docs/evaluation.md` describes them). Mean ± std over seeds (n). A "
        "calibrator that may move a prediction's class (its runs record `calibrator_argmax_changed`) changes the error "
        "too, so the error is shown.",
        text,
        ["method", "dataset", "calibrator", "metric", *STATS],
        rows,
    )
