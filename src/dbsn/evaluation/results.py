"""What an evaluation found, and the one place that writes it down and hands it on.

Every step of an evaluation (the test pass's report, OOD detection, dataset shift, attacks, and
any evaluation a user adds) returns a `Results`: its numbers under flat, stable names, the files
it produced (records, tables, figures), what W&B shows beside them and what the console prints.
None of them writes a file or calls a logger. `write_results` does both for all of them:

- the files, into the evaluation folder (JSON records, CSV tables, NPZ arrays, text, PNG figures);
- the numbers, to every logger of the run (W&B with its metric definitions,
  `dbsn.evaluation.tracking`; Lightning's CSV logger), and the figures, tables and curves to W&B;
- the console tables.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table as RichTable

from dbsn.evaluation.interval_rule import shown_interval
from dbsn.evaluation.plots import save_figure
from dbsn.evaluation.tracking import log_to_wandb, wandb_loggers

__all__ = ["ConsoleTable", "CsvTable", "Results", "interval_numbers", "print_table", "write_results"]


@dataclass
class CsvTable:
    """A CSV file's content: `rows` are dicts (keys beyond `columns` are left out) or lists."""

    columns: list[str]
    rows: list[dict[str, Any]] | list[list[Any]]


@dataclass
class ConsoleTable:
    """A table for the console: first column left-aligned, floats to 4 decimals."""

    title: str
    header: list[str]
    rows: list[list[Any]]


@dataclass
class Results:
    """What one step of an evaluation found.

    Attributes:
        metrics: flat, stable names (`test/error`, `ood/<set>/<score>/auroc`, ...) -> value: the
            numbers handed to every logger and returned by `evaluate`.
        shown_as_curves: numbers returned by `evaluate` under flat names but not handed to the
            loggers one by one, because W&B shows them as `curves` (attack results against ε).
        files: path relative to the evaluation folder -> content, written by its ending:
            `.json` any JSON value, `.csv` a `CsvTable`, `.npz` a dict of arrays, `.txt` a string,
            `.png` a matplotlib `Figure`.
        images: W&B key -> the path (a key of `files`) of a figure to show there.
        tables: W&B key -> (columns, rows): data behind figures, so W&B panels can overlay runs.
        curves: W&B step metric -> rows: curves against a variable of their own (`log_curve`).
        console: tables printed on the console.
        intervals: flat name -> [low, high], the bootstrap interval of a number of `metrics`
            (`dbsn.evaluation.statistics`); loggers get them as `<name>/ci_low`, `<name>/ci_high` and
            `<name>/ci_misses_estimate` (`interval_numbers`).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    shown_as_curves: dict[str, float] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)
    tables: dict[str, tuple[list[str], list[list[Any]]]] = field(default_factory=dict)
    curves: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    console: list[ConsoleTable] = field(default_factory=list)
    intervals: dict[str, list[float]] = field(default_factory=dict)

    def add(self, other: Results) -> Results:
        """Merge `other` into this one (its entries win on equal keys); returns self."""
        self.metrics.update(other.metrics)
        self.shown_as_curves.update(other.shown_as_curves)
        self.files.update(other.files)
        self.images.update(other.images)
        self.tables.update(other.tables)
        self.curves.update(other.curves)
        self.console.extend(other.console)
        self.intervals.update(other.intervals)
        return self

    @property
    def values(self) -> dict[str, float]:
        """Every number under its flat name (what `evaluate` returns)."""
        return {**self.metrics, **self.shown_as_curves}


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """A rich table on the console: first column left-aligned, floats to 4 decimals."""
    table = RichTable(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


def write_file(path: Path, content: Any) -> Path:
    """Write one of `Results.files` by the path's ending (see `Results`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".png":
        return save_figure(content, path)
    if suffix == ".json":
        path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    elif suffix == ".csv":
        with path.open("w", newline="") as f:
            if content.rows and isinstance(content.rows[0], dict):
                writer = csv.DictWriter(f, fieldnames=content.columns, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(content.rows)
            else:
                writer = csv.writer(f)
                writer.writerow(content.columns)
                writer.writerows(content.rows)
    elif suffix == ".npz":
        np.savez_compressed(path, **content)
    elif suffix == ".txt":
        path.write_text(content + "\n", encoding="utf-8")
    else:
        raise ValueError(
            f"{path.name}: no writer for {suffix or 'a file without an ending'} (json, csv, npz, txt, png)"
        )
    return path


def interval_numbers(intervals: dict[str, list[float]], metrics: dict[str, float] | None = None) -> dict[str, float]:
    """How loggers receive each interval, by the rule of every shown interval
    (`dbsn.evaluation.interval_rule`): `<name>/ci_low` and `<name>/ci_high` within the metric's limits,
    and, where `metrics` holds the estimate, `<name>/ci_misses_estimate` (1.0 where the interval does
    not contain it, else 0.0: logged either way, so that a later evaluation into the same W&B run
    replaces an earlier flag)."""
    numbers = {}
    for key, (low, high) in intervals.items():
        estimate = None if metrics is None else metrics.get(key)
        shown = shown_interval(key, estimate, low, high)
        numbers.update({f"{key}/ci_low": shown.low, f"{key}/ci_high": shown.high})
        if estimate is not None:
            numbers[f"{key}/ci_misses_estimate"] = float(shown.misses)
    return numbers


@rank_zero_only
def write_results(results: Results, folder: Path, loggers: list[Logger] | tuple = ()) -> None:
    """Write `results` into `folder` and hand them to `loggers` (see the module docstring)."""
    folder = Path(folder)
    for relative, content in results.files.items():
        if not isinstance(content, Figure) and Path(relative).suffix == ".png":
            raise TypeError(f"{relative}: a .png file takes a matplotlib Figure")
        write_file(folder / relative, content)
    numbers = {**results.metrics, **interval_numbers(results.intervals, results.metrics)}
    log_to_wandb(
        loggers,
        numbers,
        images={key: folder / path for key, path in results.images.items()},
        tables=results.tables,
        curves=results.curves,
    )
    if numbers:
        wandb = wandb_loggers(loggers)
        for logger in loggers or ():
            if logger not in wandb:  # Lightning's CSV (or other) logger: the numbers
                logger.log_metrics(numbers)
    for table in results.console:
        print_table(table.title, table.header, table.rows)
