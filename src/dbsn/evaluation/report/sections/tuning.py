"""The learning-rate search (`dbsn-compare --tune`): each tuned run's validation NLL over the grid,
its chosen rate, and one figure per dataset."""

from __future__ import annotations

import statistics

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, md_table, order
from dbsn.evaluation.report.writer import write_figure, write_section
from dbsn.methods.registry import METHOD_ORDER


def tuning_section(report: Report, ok: list[Run]) -> str:
    """Each tuned run's learning-rate search (`dbsn-compare --tune`'s tuning.json): the validation NLL
    at every rate of the grid, the chosen rate, and one figure per dataset (the mean over seeds)."""
    from dbsn.evaluation.plots import tuning_figure

    shared = lambda r: r.tuning.get("reused_from") or r.tuning.get("shared_with")  # noqa: E731 - another run's search
    tuned = [r for r in ok if r.tuning.get("validation_nll") and not shared(r)]
    reused = [r for r in ok if shared(r)]  # `--tuned-from` (another seed's), a deep ensemble's (map_fixed's)
    if not tuned:
        return ""
    grid = sorted({float(lr) for r in tuned for lr in r.tuning["validation_nll"]})
    rows, csv_rows, figures = [], [], ""
    for dataset in order({r.dataset for r in tuned}, DATASET_ORDER):
        curves, chosen = {}, {}
        for method in order({r.method for r in tuned if r.dataset == dataset}, METHOD_ORDER):
            runs = [r for r in tuned if r.method == method and r.dataset == dataset]
            per_run = [{float(lr): float(v) for lr, v in r.tuning["validation_nll"].items()} for r in runs]
            for run, curve in zip(runs, per_run):
                rows.append(
                    [
                        method,
                        dataset,
                        str(run.seed),
                        *(
                            (
                                "diverged"
                                if curve.get(lr) == float("inf")
                                else "–"
                                if lr not in curve
                                else f"{curve[lr]:.4f}"
                            )
                            for lr in grid
                        ),
                        f"{run.tuning['chosen']:g}",
                    ]
                )
                csv_rows.append([method, dataset, run.seed, *(curve.get(lr) for lr in grid), run.tuning["chosen"]])
            mean = {lr: statistics.fmean(c[lr] for c in per_run) for lr in grid if all(lr in c for c in per_run)}
            curves[method] = mean
            chosen[method] = min((lr for lr in mean if mean[lr] < float("inf")), key=mean.get, default=None)
        name = f"tuning_{dataset}.png"
        if write_figure(report, tuning_figure(curves, chosen, title=f"Learning-rate search on {dataset}"), name):
            figures += f"![Learning-rate search]({name})\n\n"
    header = ["method", "dataset", "seed", *(f"lr {lr:g}" for lr in grid), "chosen"]
    body = (
        md_table(header, rows)
        + "\n"
        + (
            f"{len(reused)} further run(s) trained with a search above (another seed's, `--tuned-from`, or a deep "
            "ensemble's members', map_fixed's), not repeated here: "
            + ", ".join(sorted({f"{r.method} seed {r.seed}" for r in reused}))
            + ".\n\n"
            if reused
            else ""
        )
        + figures
    )
    return write_section(
        report,
        "tuning",
        "Learning-rate search",
        "Each method's base learning rate, chosen from one grid for every method by the validation NLL after the last "
        "epoch (a validation split held out of the training set; the test set unseen), in runs of the comparison's "
        "epochs, batch and schedule shape; the method then trained and tested with it. The figure plots the mean over "
        "seeds, each method's choice starred.",
        body,
        ["method", "dataset", "seed", *(f"val_nll_lr_{lr:g}" for lr in grid), "chosen"],
        csv_rows,
    )
