"""The report's numbers as text: the order of methods and datasets, a cell's mean, spread and
interval over seeds (`Cell`, `mean_std`), and how cells, tables and paths are written (`fmt`,
`short`, `md_table`, `mark_unconverged`). Shared by every section; it writes no file."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, shown_interval
from dbsn.evaluation.report.collect import Run
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


class Cell(NamedTuple):
    """A table cell: the mean over seeds, their sample std (ddof = 1; None for one seed), the number
    of seeds, and the 95 % interval: Student's t over the seeds for two or more, the run's own
    bootstrap interval over test examples for one (None where the run has none)."""

    mean: float
    std: float | None
    n: int
    low: float | None = None
    high: float | None = None


#: the CSV columns of a `Cell`
STATS = ["mean", "std", "n", "low", "high"]


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Student's t interval of the mean of `values` (at least two)."""
    from scipy.stats import t

    mean, std, n = statistics.fmean(values), statistics.stdev(values), len(values)
    half = float(t.ppf((1 + level) / 2, n - 1)) * std / n ** 0.5
    return mean - half, mean + half


def mean_std(values, intervals=None) -> Cell:
    """The `Cell` of one value per seed; `intervals`: each run's [low, high] (or None), in the same order."""
    values = [float(v) for v in values]
    if len(values) > 1:
        return Cell(statistics.fmean(values), statistics.stdev(values), len(values), *t_interval(values))
    bounds = (intervals or [None])[0]
    return Cell(values[0], None, 1, *(bounds if bounds is not None else (None, None)))


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
        text += f" [{low:.{digits}f}, {high:.{digits}f}]" + (" " + OUTSIDE_NOTE if misses else "")
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
