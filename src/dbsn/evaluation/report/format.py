"""The report's numbers as text: the order of methods and datasets, a cell's mean, spread and
interval over seeds (`Cell`, `mean_std`, `seed_cell`), and how cells, tables and paths are written
(`fmt`, `short`, `md_table`, `mark_unconverged`). Shared by every section; it writes no file."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch

from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, shown_interval
from dbsn.evaluation.report.collect import Run
from dbsn.evaluation.report.seeds import bounded_covariance, combine_seeds
from dbsn.methods.registry import field_backbones

DATASET_ORDER = ("cifar10", "cifar100")
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "svhn": 10, "digits": 10}
OOD_METRICS = (("auroc", "AUROC ↑"), ("aupr", "AUPR ↑"), ("fpr95", "FPR95 ↓"))


def order(names, canonical) -> list[str]:
    """`names` in the order of `canonical`; method names `<method>@<backbone>[+posthoc]` grouped by
    backbone (the cell network first, then the field's backbones by name), each group in the
    canonical order, unknown names last; a method's rows of other settings (`<method> (<what
    differs>)`, `pooling`) right after its own."""
    backbones = ("", *field_backbones())

    def key(name: str):
        method, _, differences = name.partition(" (")
        base, _, rest = method.partition("@")
        backbone, _, posthoc = rest.partition("+")
        base = base + (f"+{posthoc}" if posthoc else "")
        group = backbones.index(backbone) if backbone in backbones else len(backbones)
        return (group, backbone, canonical.index(base) if base in canonical else len(canonical), base, differences)

    return sorted(set(names), key=key)


#: what a cell's interval covers (`Cell.interval`): the seeds and the test set's noise they share, measured on
#: common resamples of the runs' test examples (`predictions.npz`); the same with that noise at its upper bound,
#: from each run's interval alone; one run's test set alone; the seeds alone (no test-set noise known)
SEEDS_AND_TEST, SEEDS_AND_TEST_BOUND, TEST_ONLY, SEEDS_ONLY = (
    "seeds and test set",
    "seeds and test set (bound)",
    "test set only",
    "seeds only",
)
#: the mark `fmt` puts after an interval that is not measured over the seeds and the test set, and what it means
INTERVAL_MARKS = {SEEDS_AND_TEST_BOUND: "§", SEEDS_ONLY: "¶"}
INTERVAL_MARKS_NOTE = (
    "§: the test set's noise the seeds share is at its upper bound (each run's interval, "
    "the seeds' noises taken as fully correlated: no per-example data), a conservative interval; "
    "¶: over the seeds alone, leaving out any noise of a test set they share."
)


class Cell(NamedTuple):
    """A table cell: the mean over seeds, their sample std (ddof = 1; None for one seed), the number
    of seeds, the 95 % interval of the method's population metric (its mean over seeds and test
    sets) and what that interval covers (`interval`): for two or more seeds, Student's t with the
    seeds' variance and the test noise they share (`seeds.combine_seeds`), measured or bounded;
    for one, the run's own bootstrap interval over test examples (None where the run has none)."""

    mean: float
    std: float | None
    n: int
    low: float | None = None
    high: float | None = None
    interval: str = ""


#: the CSV columns of a `Cell`
STATS = ["mean", "std", "n", "low", "high", "interval"]


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Student's t interval of the mean of `values` (at least two)."""
    from scipy.stats import t

    mean, std, n = statistics.fmean(values), statistics.stdev(values), len(values)
    half = float(t.ppf((1 + level) / 2, n - 1)) * std / n**0.5
    return mean - half, mean + half


def seed_cell(values, test_cov, level: float = 0.95, interval: str = SEEDS_AND_TEST) -> Cell:
    """The `Cell` of one value per seed (two or more) whose test-set noise has covariance `test_cov`
    (k, k): the interval of `seeds.combine_seeds`."""
    values = [float(v) for v in values]
    found = combine_seeds(torch.tensor(values, dtype=torch.float64), torch.as_tensor(test_cov), level)
    return Cell(found.value, statistics.stdev(values), len(values), found.low, found.high, interval)


def mean_std(values, intervals=None, level: float = 0.95) -> Cell:
    """The `Cell` of one value per seed; `intervals`: each run's [low, high] at `level` (or None), in the
    same order, given for a metric measured on a test set. Two or more seeds, each with an interval: the
    test noise they share at its bound (`seeds.bounded_covariance`); some without: Student's t over the
    seeds alone, labelled so; no `intervals` at all (a quantity without a test set, as a training time):
    Student's t over the seeds, unlabelled. One seed: its interval."""
    values = [float(v) for v in values]
    if len(values) > 1:
        if intervals is not None and len(intervals) == len(values) and all(b is not None for b in intervals):
            return seed_cell(values, bounded_covariance(intervals, level), level, SEEDS_AND_TEST_BOUND)
        return Cell(
            statistics.fmean(values),
            statistics.stdev(values),
            len(values),
            *t_interval(values, level),
            "" if intervals is None else SEEDS_ONLY,
        )
    bounds = (intervals or [None])[0]
    if bounds is None:
        return Cell(values[0], None, 1)
    return Cell(values[0], None, 1, *bounds, TEST_ONLY)


def run_bounds(run: Run, key: str, scale: float = 1.0) -> list[float] | None:
    """The run's bootstrap interval of `key`, scaled, or None."""
    found = run.intervals.get(key)
    return None if found is None else [scale * found[0], scale * found[1]]


def fmt(stats, digits: int, metric: str | None = None, scale: float = 1.0) -> str:
    """`mean ± std [low, high] (n)`; one seed: `value [low, high] (1)`. The interval as the one rule
    shows every interval (`dbsn.evaluation.interval_rule`): each bound within the limits of `metric`
    (its stable name, the cell's values `scale` times the metric's; None: no limits), and a note
    (`OUTSIDE_NOTE`) where it does not contain its estimate (the percentile interval of a statistic
    biased under resampling, as the plug-in ECE)."""
    if stats is None:
        return "–"
    mean, std, n, *bounds = stats
    text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")
    if bounds and bounds[0] is not None:
        low, high, misses = shown_interval(metric, mean, bounds[0], bounds[1], scale=scale)
        text += f" [{low:.{digits}f}, {high:.{digits}f}]"
        text += INTERVAL_MARKS.get(bounds[2] if len(bounds) > 2 else "", "")
        text += " " + OUTSIDE_NOTE if misses else ""
    return f"{text} ({n})"


def short(cell: Cell | None, digits: int, scale: float = 1.0) -> str:
    """`mean ± std` of a cell scaled for display (one seed: the value), "–" for none: the compact
    cells of the tables with many columns."""
    if cell is None:
        return "–"
    return f"{scale * cell.mean:.{digits}f}" + (f" ± {scale * cell.std:.{digits}f}" if cell.std is not None else "")


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


#: marks, in every table, a method with a run whose training loss still fell steeply at its end
UNCONVERGED_MARK = "‡"


def mark_unconverged(methods: set[str], text: str) -> str:
    """Every markdown table row of `text` whose first cell is one of `methods`, marked `UNCONVERGED_MARK`."""
    if not methods:
        return text
    lines = []
    for line in text.split("\n"):
        if line.startswith("| ") and not line.startswith("|---"):
            cells = line.split(" | ")
            if cells[0][2:] in methods:
                cells[0] = f"{cells[0]} {UNCONVERGED_MARK}"
                line = " | ".join(cells)
        lines.append(line)
    return "\n".join(lines)


def slug(text: str) -> str:
    """A file-name stem without spaces or odd characters (data-set names like "photo patches")."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def show(path: Path) -> str:
    """`path` relative to the working directory where it lies below it, else as it is."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def seeds_note(runs: list[Run]) -> str:
    """How many runs each (method, dataset) cell averages: "3 run(s) per cell" or "2–3 runs per cell"."""
    counts = Counter((r.method, r.dataset) for r in runs)
    low, high = min(counts.values()), max(counts.values())
    return f"{low} run(s) per cell" if low == high else f"{low}–{high} runs per cell"
