"""The paper's main tables (test error, ECE, the unbiased CE², NLL: one column per dataset) and
the per-(method, dataset) table of any test-pass metrics that the calibration and selective
sections build on."""

from __future__ import annotations

from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, INTERVAL_MARKS_NOTE, STATS, fmt, md_table, order, seeds_note
from dbsn.evaluation.report.population import PopulationCells
from dbsn.evaluation.report.writer import write_section
from dbsn.methods.registry import METHOD_ORDER

INTERVALS_NOTE = (
    "Mean ± sample standard deviation (ddof = 1) over seeds, then in brackets the 95 % interval of "
    "the method's population metric (its mean over seeds and test sets): Student's t on the seeds' "
    "spread plus the test set's noise they share, measured by scoring every seed on the same "
    "bootstrap resamples of the test examples (the seeds share one test set, so its noise moves them "
    "alike and their spread leaves it out); for a single seed, the run's bootstrap interval over the "
    "test examples, which holds the test set's noise only, not the seeds'. " + INTERVAL_MARKS_NOTE
)
# (file stem, metric key, scale, decimals, title, explanation)
MAIN_TABLES = (
    ("table1_error", "test/error", 100.0, 2, "Table 1: test error (%)", "Test error in %, lower is better."),
    (
        "table2_ece",
        "test/ece",
        1.0,
        4,
        "Table 2: expected calibration error",
        "ECE (15 equal-width confidence bins, as a fraction, not %), lower is better: the paper's number. A plug-in "
        "estimate, biased upward by an amount that depends on each model's spread of confidences: compare methods "
        "with the unbiased squared calibration error below, not with this.",
    ),
    (
        "table_ce2",
        "test/ce2",
        1.0,
        5,
        "Squared calibration error (unbiased)",
        "CE² over the ECE's 15 bins, estimated without bias (a U-statistic per bin; 0 in expectation for a calibrated "
        "model, so it can be negative): the calibration error whose intervals cover the truth and whose differences "
        "mean something. Lower is better.",
    ),
    (
        "table_nll",
        "test/nll",
        1.0,
        4,
        "Test negative log-likelihood",
        "Mean test NLL in nats per example, lower is better.",
    ),
)


def main_tables(report: Report, ok: list[Run], cells: PopulationCells | None = None) -> str:
    """The main tables; `cells` makes the cells (its bootstrap; shared with the other tables of
    test-pass metrics so that each run is scored once)."""
    cells = cells or PopulationCells()
    methods, datasets = order({r.method for r in ok}, METHOD_ORDER), order({r.dataset for r in ok}, DATASET_ORDER)
    sizes = sorted({str(r.n_samples) for r in ok if r.n_samples is not None})
    text = ""
    for stem, key, scale, digits, title, explanation in MAIN_TABLES:
        runs = defaultdict(list)
        for r in ok:
            if key in r.metrics:
                runs[r.method, r.dataset].append(r)
        stats = {cell: cells.cell(found, key, scale) for cell, found in runs.items()}
        table = md_table(
            ["method", *datasets],
            [[m, *(fmt(stats.get((m, d)), digits, key, scale) for d in datasets)] for m in methods],
        )
        text += write_section(
            report,
            stem,
            title,
            f"{explanation} {INTERVALS_NOTE} (n) is the number of finished runs averaged ({seeds_note(ok)}); predictions "
            f"of stochastic methods average S = {', '.join(sizes) or '?'} Monte Carlo samples.",
            f"{table}\n",
            ["method", "dataset", *STATS],
            [[m, d, *stats[m, d]] for m in methods for d in datasets if (m, d) in stats],
            page=table,
        )
    return text


def per_method_table(
    report: Report,
    ok: list[Run],
    stem: str,
    title: str,
    explanation: str,
    columns: list[tuple[str, str, float, int]],
    cells: PopulationCells | None = None,
) -> str:
    """One row per (method, dataset), one column per (label, metric key, scale, digits) read from
    each run's test-pass metrics, cells as the main tables' (`cells`); "" when no run has any of them."""
    cells = cells or PopulationCells()
    values = defaultdict(list)
    for r in ok:
        for label, key, scale, _ in columns:
            if key in r.metrics:
                values[r.method, r.dataset, label].append(r)
    if not values:
        return ""
    methods = order({k[0] for k in values}, METHOD_ORDER)
    rows, csv_rows = [], []
    for method, dataset in sorted({k[:2] for k in values}, key=lambda k: (k[1], methods.index(k[0]))):
        stats = {
            label: cells.cell(values[method, dataset, label], key, scale)
            for label, key, scale, _ in columns
            if values[method, dataset, label]
        }
        rows.append(
            [method, dataset, *(fmt(stats.get(label), digits, key, scale) for label, key, scale, digits in columns)]
        )
        csv_rows += [[method, dataset, label, *stats[label]] for label, *_ in columns if label in stats]
    table = md_table(["method", "dataset", *(label for label, *_ in columns)], rows)
    return write_section(
        report,
        stem,
        title,
        f"{explanation} {INTERVALS_NOTE} (n): the runs averaged.",
        f"{table}\n",
        ["method", "dataset", "metric", *STATS],
        csv_rows,
        page=table,
    )
