"""Adversarial robustness: accuracy and mean predictive entropy under FGSM and BIM at every
perturbation size, with one figure per dataset."""

from __future__ import annotations

import statistics
from collections import defaultdict

from dbsn.evaluation.attacks import adversarial_figure
from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, fmt, md_table, mean_std, order, slug
from dbsn.evaluation.report.writer import read_rows, write_figure, write_section
from dbsn.methods.registry import METHOD_ORDER


def adversarial_section(report: Report, ok: list[Run]) -> str:
    values = defaultdict(lambda: defaultdict(list))  # (dataset, method, attack, eps) -> column -> values
    for r in ok:
        path = r.path / "evaluation" / "adversarial" / "results.csv"
        for row in read_rows(path) if path.is_file() else []:
            cell = values[r.dataset, r.method, row["attack"], round(float(row["epsilon"]), 6)]
            for column in ("accuracy", "mean_entropy", "n_examples"):
                cell[column].append(float(row[column]))
    if not values:
        return ""
    text, rows = "", []
    for dataset in order({k[0] for k in values}, DATASET_ORDER):
        methods = order({k[1] for k in values if k[0] == dataset}, METHOD_ORDER)
        epsilons = sorted({k[3] for k in values if k[0] == dataset})
        attacks = {m: order({k[2] for k in values if k[:2] == (dataset, m)}, ("fgsm", "bim")) for m in methods}
        curves = {m: [] for m in methods}
        for m in methods:
            for a in attacks[m]:
                for e in epsilons:
                    if (dataset, m, a, e) in values:
                        cell = {c: statistics.fmean(v) for c, v in values[dataset, m, a, e].items()}
                        rows.append(
                            [
                                m,
                                dataset,
                                a,
                                e,
                                cell["accuracy"],
                                cell["mean_entropy"],
                                len(values[dataset, m, a, e]["accuracy"]),
                            ]
                        )
                        curves[m].append(
                            {
                                "attack": a,
                                "epsilon": e,
                                "accuracy": cell["accuracy"],
                                "mean_entropy": cell["mean_entropy"],
                                "n_examples": round(cell["n_examples"]),
                            }
                        )
        for column, label, digits in (
            ("accuracy", "accuracy ↑", 4),
            ("mean_entropy", "mean predictive entropy (nats)", 4),
        ):
            table = [
                [
                    m,
                    a,
                    *(
                        fmt(mean_std(values[dataset, m, a, e][column]), digits, column)
                        if (dataset, m, a, e) in values
                        else "–"
                        for e in epsilons
                    ),
                ]
                for m in methods
                for a in attacks[m]
            ]
            text += (
                f"### {dataset}: {label}\n\n"
                + md_table(["method", "attack", *(f"ε={e:g}" for e in epsilons)], table)
                + "\n"
            )
        name = slug(f"adversarial_{dataset}") + ".png"
        if write_figure(report, adversarial_figure(curves, title=f"Adversarial attacks on {dataset}"), name):
            text += f"![adversarial]({name})\n\n"
    return write_section(
        report,
        "adversarial",
        "Adversarial robustness",
        "FGSM and BIM attacks on the posterior predictive at perturbation size ε (pixel scale [0, 1]): test accuracy "
        "(higher is better) and mean predictive entropy (a model that knows it is being fooled grows more uncertain as "
        "ε grows), mean ± std (n seeds).",
        text,
        ["method", "dataset", "attack", "epsilon", "accuracy", "mean_entropy", "n"],
        rows,
    )
