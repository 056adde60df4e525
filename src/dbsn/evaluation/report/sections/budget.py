"""What every row's runs trained: epochs, optimiser steps, images seen, the training split and the
wall time (`Run.budget`, from metrics.json; `dbsn.evaluation.budget` records it), which recipe of the
field's ran (`budget.recipe`: the authors' or the shared budget, conf/budget/), and what a row trains
differently from the rest: a held-out split, a sampler's temperature. Every other table's rows are
rows of this one (the same name and dataset), so each number can be read against what it cost."""

from __future__ import annotations

import statistics
from collections import defaultdict

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, md_table, order
from dbsn.evaluation.report.writer import write_section
from dbsn.methods.registry import METHOD_ORDER

__all__ = ["BUDGET_COLUMNS", "budget_section", "row_budgets"]

#: the table's columns after row and dataset
BUDGET_COLUMNS = ["recipe", "epochs", "steps", "images seen", "training images", "time", "notes"]


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _images(value: float) -> str:
    return f"{value / 1e6:,.2f} M" if value >= 1e6 else _count(value)


def _span(values: list, runs: int, form=_count, unit: str = "") -> str:
    """The runs' values of one budget entry: one value, or their range `low–high` where they differ;
    `(k of n runs)` where only k recorded it; "–" where none did."""
    known = [v for v in values if v is not None]
    if not known:
        return "–"
    low, high = form(min(known)), form(max(known))
    text = (low if low == high else f"{low}–{high}") + unit
    return text + (f" ({len(known)} of {runs} runs)" if len(known) < runs else "")


def _time(seconds: list, runs: int) -> str:
    """The wall time of training: in minutes below an hour, else hours, the runs' range where they differ."""
    known = [s for s in seconds if s is not None]
    scale, unit = (60.0, " min") if not known or max(known) < 3600 else (3600.0, " h")
    return _span([None if s is None else s / scale for s in seconds], runs, lambda v: f"{v:,.1f}", unit)


def _recipe(runs: list[Run]) -> str:
    """The field's budget the runs trained under (`budget.recipe`), "–" for a run of no field sweep."""
    found = {(r.config.get("budget") or {}).get("recipe") for r in runs}
    return ", ".join(sorted(str(f) for f in found if f)) or "–"


def _notes(runs: list[Run]) -> str:
    """What the row trains differently from a plain run on the whole training set: a held-out
    validation split (DDU's authors' 5,000 of 50,000), a sampler's temperature and its noise, a
    post-hoc posterior fitted after its run."""
    notes = []
    held = {(r.config.get("data") or {}).get("val_size") for r in runs} - {None, 0}
    if held:
        trained = sorted({r.budget.get("train_images") for r in runs} - {None})
        shown = ", ".join(f"{v:,}" if isinstance(v, int) else f"{v:g}" for v in sorted(held, key=float))
        notes.append(
            f"validation split of {shown} held out"
            + (f" (trains on {', '.join(f'{n:,}' for n in trained)})" if trained else "")
        )
    temperatures = sorted({r.budget["sampler_temperature"] for r in runs if "sampler_temperature" in r.budget})
    if temperatures:
        sizes = {r.budget.get("train_images") for r in runs}
        inverse = len(sizes) == 1 and None not in sizes and all(abs(t * min(sizes) - 1) < 1e-6 for t in temperatures)
        text = f"temperature T = {', '.join(f'{t:.2g}' for t in temperatures)}" + (
            f" = 1/N (N = {min(sizes):,})" if inverse else ""
        )
        noise = [r.budget["sampler_noise_std_max"] for r in runs if "sampler_noise_std_max" in r.budget]
        if noise:
            text += f", noise sd at most {max(noise):.1e} a step"
        notes.append(text)
    if any(r.path.parent.name == "posthoc" for r in runs):
        notes.append("a post-hoc posterior: its training run's budget, the fit after it not counted")
    return "; ".join(notes) or "–"


def row_budgets(ok: list[Run]) -> dict[tuple[str, str], dict]:
    """Each (row, dataset)'s budget over its runs: the table's text per column, and the numbers."""
    cells = defaultdict(list)
    for run in ok:
        cells[run.method, run.dataset].append(run)
    out = {}
    for (method, dataset), runs in cells.items():
        entry = {
            key: [r.budget.get(key) for r in runs] for key in ("epochs", "steps", "images", "train_images", "seconds")
        }
        n = len(runs)
        out[method, dataset] = {
            "runs": n,
            "numbers": entry,
            "text": {
                "recipe": _recipe(runs),
                "epochs": _span(entry["epochs"], n),
                "steps": _span(entry["steps"], n),
                "images seen": _span(entry["images"], n, _images),
                "training images": _span(entry["train_images"], n),
                "time": _time(entry["seconds"], n),
                "notes": _notes(runs),
            },
        }
    return out


def _bounds(values: list) -> list:
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else [None, None]


def budget_section(report: Report, ok: list[Run]) -> str:
    """The budget of every row of the report's tables (module docstring)."""
    if not ok:
        return ""
    budgets = row_budgets(ok)
    datasets = order({d for _, d in budgets}, DATASET_ORDER)
    rows, csv_rows = [], []
    for dataset in datasets:
        for method in order({m for m, d in budgets if d == dataset}, METHOD_ORDER):
            found = budgets[method, dataset]
            rows.append([method, dataset, *(found["text"][c] for c in BUDGET_COLUMNS)])
            numbers = found["numbers"]
            seconds = [s for s in numbers["seconds"] if s is not None]
            csv_rows.append(
                [
                    method,
                    dataset,
                    found["text"]["recipe"],
                    found["runs"],
                    *(b for key in ("epochs", "steps", "images", "train_images") for b in _bounds(numbers[key])),
                    statistics.fmean(seconds) if seconds else None,
                    *_bounds(numbers["seconds"]),
                    found["text"]["notes"],
                ]
            )
    recipes = defaultdict(int)
    for found in budgets.values():
        for recipe in found["text"]["recipe"].split(", "):
            recipes[recipe] += 1
    shared = sorted(
        {
            f"{backbone} {epochs}"
            for r in ok
            if (r.config.get("budget") or {}).get("recipe") == "shared"
            for backbone, epochs in ((r.config["budget"].get("epochs") or {}).items())
        }
    )
    ran = []
    if recipes.get("authors"):
        ran.append(
            f"{recipes['authors']} row(s) ran the authors' recipes of the field's sweeps (`budget=authors`: "
            "each method its own epochs)"
        )
    if recipes.get("shared"):
        ran.append(
            f"{recipes['shared']} row(s) the shared budget (`budget=shared`: every method on a backbone "
            f"the same epochs{': ' + ', '.join(shared) if shared else ''})"
        )
    if recipes.get("–"):
        ran.append(f"{recipes['–']} row(s) are of no field sweep (their own `trainer.max_epochs`)")
    intro = (
        "What each row's runs trained, the budget its numbers in every other table were bought with (the same "
        "row and dataset): epochs; optimiser steps (one per training batch, every optimiser of the method "
        "stepping once); images seen (the training examples drawn over all devices, an example repeated inside "
        "a step or shared by an ensemble's members counted once); the training split's size; the training's "
        "wall time (only comparable on the same hardware). A row pooling runs that differ shows their range, "
        "and '–' where a run (of an older version) did not record it. Budgets differ between recipes: compare "
        "rows with their budgets. " + ("; ".join(ran) + "." if ran else "")
    )
    return write_section(
        report,
        "budget",
        "Training budgets",
        intro,
        md_table(["row", "dataset", *BUDGET_COLUMNS], rows) + "\n",
        [
            "row",
            "dataset",
            "recipe",
            "runs",
            "epochs_min",
            "epochs_max",
            "steps_min",
            "steps_max",
            "images_min",
            "images_max",
            "train_images_min",
            "train_images_max",
            "mean_seconds",
            "seconds_min",
            "seconds_max",
            "notes",
        ],
        csv_rows,
    )
