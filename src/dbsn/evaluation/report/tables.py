"""The report's sections: each reads the finished runs' records and writes its table(s) (markdown and
CSV) and figures into the report folder, returning its part of report.md."""

from __future__ import annotations

import csv
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dbsn.evaluation.attacks import adversarial_figure
from dbsn.evaluation.ood import entropy_cdf_figure
from dbsn.evaluation.plots import save_figure
from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.shift import SHIFT_METRICS, shift_boxplots
from dbsn.methods.registry import METHOD_ORDER, field_backbones

DATASET_ORDER = ("cifar10", "cifar100")
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "svhn": 10, "digits": 10}
OOD_METRICS = (("auroc", "AUROC ↑"), ("aupr", "AUPR ↑"), ("fpr95", "FPR95 ↓"))
ABLATION_S = (1, 10, 100)
INTERVALS_NOTE = ("Mean ± sample standard deviation (ddof = 1) over seeds, then the 95 % interval in brackets: "
                  "Student's t over the seeds, or for a single seed the run's bootstrap interval over the test "
                  "examples (1,000 resamples).")
# (file stem, metric key, scale, decimals, title, explanation)
MAIN_TABLES = (
    ("table1_error", "test/error", 100.0, 2, "Table 1: test error (%)", "Test error in %, lower is better."),
    ("table2_ece", "test/ece", 1.0, 4, "Table 2: expected calibration error",
     "ECE (15 equal-width confidence bins, as a fraction, not %), lower is better: the paper's number. A plug-in "
     "estimate, biased upward by an amount that depends on each model's spread of confidences: compare methods "
     "with the unbiased squared calibration error below, not with this."),
    ("table_ce2", "test/ce2", 1.0, 5, "Squared calibration error (unbiased)",
     "CE² over the ECE's 15 bins, estimated without bias (a U-statistic per bin; 0 in expectation for a calibrated "
     "model, so it can be negative): the calibration error whose intervals cover the truth and whose differences "
     "mean something. Lower is better."),
    ("table_nll", "test/nll", 1.0, 4, "Test negative log-likelihood", "Mean test NLL in nats per example, lower is better."),
)


# ---------------------------------------------------------------------- statistics and output
def _order(names, canonical) -> list[str]:
    """`names` in the order of `canonical`; method names `<method>@<backbone>[+posthoc]` grouped by
    backbone (the cell network first, then the field's backbones by name), each group in the
    canonical order, unknown names last."""
    backbones = ("", *field_backbones())

    def key(name: str):
        base, _, rest = name.partition("@")
        backbone, _, posthoc = rest.partition("+")
        base = base + (f"+{posthoc}" if posthoc else "")
        group = backbones.index(backbone) if backbone in backbones else len(backbones)
        return (group, backbone, canonical.index(base) if base in canonical else len(canonical), base)
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


#: appended to an interval that does not contain its estimate, and why
OUTSIDE_NOTE = "(the estimate lies outside its bootstrap interval: a biased statistic)"


def fmt(stats, digits: int) -> str:
    """`mean ± std [low, high] (n)`; one seed: `value [low, high] (1)`. An interval that does not
    contain its estimate (the percentile interval of a statistic biased under resampling, as the
    plug-in ECE) says so (`OUTSIDE_NOTE`)."""
    if stats is None:
        return "–"
    mean, std, n, *bounds = stats
    text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")
    if bounds and bounds[0] is not None:
        text += f" [{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"
        if not bounds[0] <= mean <= bounds[1]:
            text += " " + OUTSIDE_NOTE
    return f"{text} ({n})"


def short(cell: Cell | None, digits: int, scale: float = 1.0) -> str:
    """`mean ± std` of a cell scaled for display (one seed: the value), "–" for none: the compact
    cells of the tables with many columns."""
    if cell is None:
        return "–"
    return f"{scale * cell.mean:.{digits}f}" + (f" ± {scale * cell.std:.{digits}f}" if cell.std is not None else "")


def _bounds(run: Run, key: str, scale: float = 1.0) -> list[float] | None:
    """The run's bootstrap interval of `key`, scaled, or None."""
    found = run.intervals.get(key)
    return None if found is None else [scale * found[0], scale * found[1]]


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


def _write(report: Report, name: str, text: str) -> Path:
    path = report.out / name
    path.write_text(mark_unconverged(report.unconverged, text))
    report.files.append(path)
    return path


def _write_csv(report: Report, name: str, header: list[str], rows: list[list]) -> None:
    path = report.out / name
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if c is None else c for c in row] for row in rows])
    report.files.append(path)


def _slug(text: str) -> str:
    """A file-name stem without spaces or odd characters (data-set names like "photo patches")."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _figure(report: Report, figure, name: str) -> Path:
    path = save_figure(figure, report.out / name)
    report.files.append(path)
    return path


def _show(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _seeds_note(runs: list[Run]) -> str:
    counts = Counter((r.method, r.dataset) for r in runs)
    low, high = min(counts.values()), max(counts.values())
    return f"{low} run(s) per cell" if low == high else f"{low}–{high} runs per cell"


# ---------------------------------------------------------------------- sections
def main_tables(report: Report, ok: list[Run]) -> str:
    methods, datasets = _order({r.method for r in ok}, METHOD_ORDER), _order({r.dataset for r in ok}, DATASET_ORDER)
    sizes = sorted({str(r.n_samples) for r in ok if r.n_samples is not None})
    text = ""
    for stem, key, scale, digits, title, explanation in MAIN_TABLES:
        values, bounds = defaultdict(list), defaultdict(list)
        for r in ok:
            if key in r.metrics:
                values[r.method, r.dataset].append(scale * r.metrics[key])
                bounds[r.method, r.dataset].append(_bounds(r, key, scale))
        stats = {cell: mean_std(v, bounds[cell]) for cell, v in values.items()}
        table = md_table(["method", *datasets], [[m, *(fmt(stats.get((m, d)), digits) for d in datasets)] for m in methods])
        _write(report, f"{stem}.md", f"# {title}\n\n{table}")
        _write_csv(report, f"{stem}.csv", ["method", "dataset", *STATS],
                   [[m, d, *stats[m, d]] for m in methods for d in datasets if (m, d) in stats])
        text += (f"## {title}\n\n{explanation} {INTERVALS_NOTE} (n) is the "
                 f"number of finished runs averaged ({_seeds_note(ok)}); predictions of stochastic methods "
                 f"average S = {', '.join(sizes) or '?'} Monte Carlo samples. Files: `{stem}.md`, `{stem}.csv`.\n\n{table}\n")
    return text


def ood_records(folder: Path) -> list[Path]:
    """A run's OOD results: one `<set>/metrics.json` per OOD set (an evaluation written before
    several sets were possible has one `metrics.json`, read only when there are no set folders)."""
    per_set = sorted(folder.glob("*/metrics.json"))
    return per_set or [p for p in [folder / "metrics.json"] if p.is_file()]


def _score_order(listed: list[list[str]]) -> list[str]:
    """One column order for the OOD scores of several records, read from the records (each lists
    its scores in its evaluation's table order): a score not yet placed goes right after the score
    before it in its record (first if none), so a `_members` variant, or a score that another
    method's evaluation left out, lands where the evaluation puts it."""
    order: list[str] = []
    for names in listed:
        for i, name in enumerate(names):
            if name not in order:
                order.insert(order.index(names[i - 1]) + 1 if i else 0, name)
    return order


def ood_section(report: Report, ok: list[Run]) -> str:
    values, bounds, curves = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(list))
    listed = []  # each record's scores, in its order
    for r in ok:
        for path in ood_records(r.path / "evaluation" / "ood"):
            record = json.loads(path.read_text())
            ood = str(record["ood"])
            listed.append(list(record["scores"]))
            for score, metrics in record["scores"].items():
                for metric, value in metrics.items():
                    if isinstance(value, (int, float)):
                        values[r.dataset, ood, r.method, score, metric].append(value)
                        bounds[r.dataset, ood, r.method, score, metric].append(
                            (record.get("intervals") or {}).get(score, {}).get(metric))
            if (path.parent / "scores.npz").is_file():
                with np.load(path.parent / "scores.npz") as scores:
                    curves[r.dataset, ood][r.method].append(np.asarray(scores["out_entropy"], dtype=float).ravel())
    if not values:
        return ""
    rows, text = [], ""
    score_order = _score_order(listed)
    for dataset, ood in sorted({k[:2] for k in values}):
        table = []
        for method in _order({k[2] for k in values if k[:2] == (dataset, ood)}, METHOD_ORDER):
            for score in _order({k[3] for k in values if k[:3] == (dataset, ood, method)}, score_order):
                cell = {metric: mean_std(values[dataset, ood, method, score, metric], bounds[dataset, ood, method, score, metric])
                        for metric in sorted({k[4] for k in values if k[:4] == (dataset, ood, method, score)})}
                table.append([method, score, *(fmt(cell.get(m), 4) for m, _ in OOD_METRICS)])
                rows += [[method, dataset, ood, score, m, *s] for m, s in cell.items()]
        text += f"### {dataset} (in-distribution) vs {ood} (OOD)\n\n"
        text += md_table(["method", "score", *(label for _, label in OOD_METRICS)], table) + "\n"
        if curves[dataset, ood]:
            pooled = {m: np.concatenate(curves[dataset, ood][m]) for m in _order(curves[dataset, ood], METHOD_ORDER)}
            name = _slug(f"ood_entropy_cdf_{dataset}_{ood}") + ".png"
            figure = entropy_cdf_figure(pooled, title=f"Predictive entropy on {ood} (trained on {dataset})",
                                        num_classes=NUM_CLASSES.get(dataset))
            if _figure(report, figure, name):
                text += (f"![entropy CDF]({name})\n\nEmpirical CDF of the predictive entropy on the {ood} test set, "
                         "pooled over each method's seeds: a curve further right (more high-entropy "
                         "predictions on data it was not trained on) is better.\n\n")
    _write_csv(report, "ood.csv", ["method", "dataset", "ood", "score", "metric", *STATS], rows)
    text = ("## Out-of-distribution detection\n\nEach score (the predictive's entropy, mutual information and "
            "max probability; OpenOOD's max-logit, energy, Mahalanobis, KNN, ViM and ODIN where evaluated) separates in-distribution test data from the OOD set; AUROC and AUPR (OOD as "
            "positive) higher is better, FPR95 (false-positive rate at 95% true-positive rate) lower is better; "
            "fractions, mean ± std [95 % interval] (n seeds): one seed's interval resamples both test sets. Files: `ood.md`, `ood.csv`.\n\n" + text)
    _write(report, "ood.md", text.replace("## ", "# ", 1))
    return text


def _per_method_table(report: Report, ok: list[Run], stem: str, title: str, explanation: str,
                      columns: list[tuple[str, str, float, int]]) -> str:
    """One row per (method, dataset), one column per (label, metric key, scale, digits) read from
    each run's test-pass metrics; "" when no run has any of them."""
    values, bounds = defaultdict(list), defaultdict(list)
    for r in ok:
        for label, key, scale, _ in columns:
            if key in r.metrics:
                values[r.method, r.dataset, label].append(scale * r.metrics[key])
                bounds[r.method, r.dataset, label].append(_bounds(r, key, scale))
    if not values:
        return ""
    methods = _order({k[0] for k in values}, METHOD_ORDER)
    cells = sorted({k[:2] for k in values}, key=lambda k: (k[1], methods.index(k[0])))
    rows, csv_rows = [], []
    for method, dataset in cells:
        stats = {label: mean_std(values[method, dataset, label], bounds[method, dataset, label])
                 for label, *_ in columns if values[method, dataset, label]}
        rows.append([method, dataset, *(fmt(stats.get(label), digits) for label, _, _, digits in columns)])
        csv_rows += [[method, dataset, label, *stats[label]] for label, *_ in columns if label in stats]
    table = md_table(["method", "dataset", *(label for label, *_ in columns)], rows)
    _write(report, f"{stem}.md", f"# {title}\n\n{table}")
    _write_csv(report, f"{stem}.csv", ["method", "dataset", "metric", *STATS], csv_rows)
    return f"## {title}\n\n{explanation} Mean ± std over seeds [95 % interval] (n). Files: `{stem}.md`, `{stem}.csv`.\n\n{table}\n"


def calibration_section(report: Report, ok: list[Run]) -> str:
    return _per_method_table(
        report, ok, "calibration", "Calibration beyond equal-width ECE",
        "The unbiased squared calibration error (CE², the one to compare: its interval covers the truth), then "
        "three plug-in ECEs of the test pass's Bayes ensemble, 15 bins each, biased upward: equal-width (Table 2's), "
        "equal-mass (bins of equal counts, which equal-width ECE's empty high-confidence bins hide) and classwise "
        "(every class's probability against its indicator, averaged over classes; Kull et al. 2019); then NLL, Brier and ECE "
        "calibrated (Ashukha et al. 2020): after one temperature fitted on the validation split, or without one by "
        "test-time 2-fold cross-validation (metrics.json's `calibration` says which), so that methods are compared "
        "at their best temperature. Lower is better.",
        [("CE² (unbiased)", "test/ce2", 1.0, 5), ("ECE", "test/ece", 1.0, 4), ("equal-mass ECE", "test/adaptive_ece", 1.0, 4),
         ("classwise ECE", "test/classwise_ece", 1.0, 4), ("calibrated NLL", "test/calibrated/nll", 1.0, 4),
         ("calibrated Brier", "test/calibrated/brier", 1.0, 4), ("calibrated CE²", "test/calibrated/ce2", 1.0, 5),
         ("calibrated ECE", "test/calibrated/ece", 1.0, 4)])


def selective_section(report: Report, ok: list[Run]) -> str:
    scores = (("max_probability", "MSP"), ("predictive_entropy", "entropy"), ("mutual_information", "MI"))
    columns = [(f"AURC ({short})", f"selective/{score}/aurc", 1000.0, 2) for score, short in scores]
    columns += [(f"E-AURC ({short})", f"selective/{score}/eaurc", 1000.0, 2) for score, short in scores[:2]]
    columns += [("AUGRC (MSP)", "selective/max_probability/augrc", 1000.0, 2),
                ("risk@80 % (MSP, %)", "selective/max_probability/risk@80", 100.0, 2)]
    return _per_method_table(
        report, ok, "selective", "Selective prediction",
        "How well each uncertainty score ranks the errors, accepting the most certain predictions first: AURC "
        "(area under the risk–coverage curve), E-AURC (its excess over the oracle's, which depends only on the "
        "error rate), AUGRC (Traub et al. 2024) in units of 1e-3, and the error rate of the 80 % most certain "
        "predictions. Lower is better; tied scores are accepted together.", columns)


def shift_section(report: Report, ok: list[Run]) -> str:
    per_method: dict[tuple[str, str], dict[tuple[str, int], dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    sources = set()
    for r in ok:
        path = r.path / "evaluation" / "shift" / "metrics.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        sources.add(record.get("source", "published"))
        for row in record["rows"]:
            for metric in SHIFT_METRICS:
                per_method[r.dataset, r.method][row["corruption"], int(row["severity"])][metric].append(row[metric])
    if not per_method:
        return ""
    generated = any(source != "published" for source in sources)
    text, csv_rows = "", []
    for dataset in _order({d for d, _ in per_method}, DATASET_ORDER):
        methods = _order({m for d, m in per_method if d == dataset}, METHOD_ORDER)
        # each corruption x severity averaged over the method's seeds, then boxes over corruptions
        rows_of = {m: [{"corruption": c, "severity": sv, **{k: float(np.mean(v)) for k, v in metrics.items()}}
                       for (c, sv), metrics in per_method[dataset, m].items()] for m in methods}
        severities = sorted({row["severity"] for rows in rows_of.values() for row in rows})
        table = []
        for m in methods:
            for metric in ("error", "ece", "nll"):
                means = [np.mean([row[metric] for row in rows_of[m] if row["severity"] == sv]) for sv in severities]
                overall = float(np.mean([row[metric] for row in rows_of[m]]))
                table.append([m, metric, *(f"{v:.4f}" for v in means), f"{overall:.4f}"])
                csv_rows += [[m, dataset, metric, sv, float(v)] for sv, v in zip(severities, means)]
        name = _slug(f"shift_boxplots_{dataset}") + ".png"
        label = "generated corruptions, not the published files" if generated else "published files"
        _figure(report, shift_boxplots(rows_of, title=f"{dataset}: dataset shift ({label})"), name)
        text += (f"### {dataset}\n\n" + md_table(["method", "metric", *(f"severity {sv}" for sv in severities), "mean"], table)
                 + f"\n![dataset shift]({name})\n\n")
    _write_csv(report, "shift.csv", ["method", "dataset", "metric", "severity", "mean over corruptions"], csv_rows)
    text = ("## Dataset shift\n\nEvery corruption of the test set at every severity ("
            + ("generated corruptions, made by `dbsn.data.shift`'s generator with CIFAR-10-C's parameters: NOT the "
               "published CIFAR-10-C / -100-C files" if generated else "the published CIFAR-10-C / -100-C files")
            + "), as in Ovadia et al. (2019): each severity's mean over corruptions (each corruption averaged over "
            "seeds first), and box plots over corruptions of ECE and error, one box per method. Files: `shift.md`, "
            "`shift.csv`.\n\n" + text)
    _write(report, "shift.md", text.replace("## ", "# ", 1))
    return text


def ood_groups_section(report: Report, ok: list[Run]) -> str:
    values, bounds = defaultdict(list), defaultdict(list)
    groups_seen: dict[str, list[str]] = {}
    for r in ok:
        path = r.path / "evaluation" / "ood" / "groups.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        groups_seen.update(record.get("groups", {}))
        for key, value in record["metrics"].items():
            _, group, score, metric = key.split("/")
            values[r.dataset, r.method, group, score, metric].append(value)
            bounds[r.dataset, r.method, group, score, metric].append((record.get("intervals") or {}).get(key))
    if not values:
        return ""
    table, csv_rows = [], []
    for dataset, method, group, score in sorted({k[:4] for k in values}, key=lambda k: (k[0], METHOD_ORDER.index(k[1])
                                                if k[1] in METHOD_ORDER else 99, k[1], k[2], k[3])):
        cell = {m: mean_std(values[dataset, method, group, score, m], bounds[dataset, method, group, score, m]) for m, _ in OOD_METRICS
                if values[dataset, method, group, score, m]}
        table.append([method, dataset, group, score, *(fmt(cell.get(m), 4) for m, _ in OOD_METRICS)])
        csv_rows += [[method, dataset, group, score, m, *st] for m, st in cell.items()]
    _write_csv(report, "ood_groups.csv", ["method", "dataset", "group", "score", "metric", *STATS], csv_rows)
    described = "; ".join(f"{g}: {', '.join(sets)}" for g, sets in groups_seen.items())
    text = ("## Near and far OOD\n\nMeans over the OOD sets of each group (" + described + "), as OpenOOD v1.5 "
            "reports them; OOD is the positive class of AUROC, AUPR and FPR95. Files: `ood_groups.csv`.\n\n"
            + md_table(["method", "dataset", "group", "score", *(label for _, label in OOD_METRICS)], table) + "\n")
    return text


def _read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def adversarial_section(report: Report, ok: list[Run]) -> str:
    values = defaultdict(lambda: defaultdict(list))  # (dataset, method, attack, eps) -> column -> values
    for r in ok:
        path = r.path / "evaluation" / "adversarial" / "results.csv"
        for row in _read_rows(path) if path.is_file() else []:
            cell = values[r.dataset, r.method, row["attack"], round(float(row["epsilon"]), 6)]
            for column in ("accuracy", "mean_entropy", "n_examples"):
                cell[column].append(float(row[column]))
    if not values:
        return ""
    text, rows = "", []
    for dataset in _order({k[0] for k in values}, DATASET_ORDER):
        methods = _order({k[1] for k in values if k[0] == dataset}, METHOD_ORDER)
        epsilons = sorted({k[3] for k in values if k[0] == dataset})
        attacks = {m: _order({k[2] for k in values if k[:2] == (dataset, m)}, ("fgsm", "bim")) for m in methods}
        curves = {m: [] for m in methods}
        for m in methods:
            for a in attacks[m]:
                for e in epsilons:
                    if (dataset, m, a, e) in values:
                        cell = {c: statistics.fmean(v) for c, v in values[dataset, m, a, e].items()}
                        rows.append([m, dataset, a, e, cell["accuracy"], cell["mean_entropy"],
                                     len(values[dataset, m, a, e]["accuracy"])])
                        curves[m].append({"attack": a, "epsilon": e, "accuracy": cell["accuracy"],
                                          "mean_entropy": cell["mean_entropy"], "n_examples": round(cell["n_examples"])})
        for column, label, digits in (("accuracy", "accuracy ↑", 4), ("mean_entropy", "mean predictive entropy (nats)", 4)):
            table = [[m, a, *(fmt(mean_std(values[dataset, m, a, e][column]), digits) if (dataset, m, a, e) in values
                             else "–" for e in epsilons)]
                     for m in methods for a in attacks[m]]
            text += f"### {dataset}: {label}\n\n" + md_table(["method", "attack", *(f"ε={e:g}" for e in epsilons)], table) + "\n"
        name = _slug(f"adversarial_{dataset}") + ".png"
        if _figure(report, adversarial_figure(curves, title=f"Adversarial attacks on {dataset}"), name):
            text += f"![adversarial]({name})\n\n"
    _write_csv(report, "adversarial.csv", ["method", "dataset", "attack", "epsilon", "accuracy", "mean_entropy", "n"], rows)
    text = ("## Adversarial robustness\n\nFGSM and BIM attacks on the posterior predictive at perturbation size ε "
            "(pixel scale [0, 1]): test accuracy (higher is better) and mean predictive entropy (a model that knows it "
            "is being fooled grows more uncertain as ε grows), mean ± std (n seeds). Files: `adversarial.md`, "
            "`adversarial.csv`.\n\n" + text)
    _write(report, "adversarial.md", text.replace("## ", "# ", 1))
    return text


def ablation_section(report: Report, ok: list[Run]) -> str:
    values = defaultdict(lambda: defaultdict(list))  # (method, dataset, S) -> column -> values
    for r in ok:
        path = r.path / "evaluation" / "ablation" / "results.csv"
        for row in _read_rows(path) if path.is_file() else []:
            cell = values[r.method, r.dataset, int(float(row["n_samples"]))]
            for column in ("error", "nll", "brier", "ece"):
                if row.get(column) not in (None, ""):
                    cell[column].append(float(row[column]) * (100.0 if column == "error" else 1.0))
    if not values:
        return ""
    found = sorted({k[2] for k in values})
    shown = [s for s in ABLATION_S if s in found] or found
    pairs = [(m, d) for d in _order({k[1] for k in values}, DATASET_ORDER)
             for m in _order({k[0] for k in values if k[1] == d}, METHOD_ORDER)]
    columns = (("error", "error %", 2), ("nll", "NLL", 4), ("ece", "ECE", 4))
    header = ["method", "dataset", *(f"{label} S={s}" for _, label, _ in columns for s in shown), "seeds"]
    table, rows = [], []
    for m, d in pairs:
        cells = [(values.get((m, d, s), {}).get(c), digits) for c, _, digits in columns for s in shown]
        seeds = max(len(v) for s in found for v in values.get((m, d, s), {}).values())
        table.append([m, d, *(f"{statistics.fmean(v):.{digits}f}" if v else "–" for v, digits in cells), seeds])
        for s in found:
            cell = values.get((m, d, s))
            if cell:
                rows.append([m, d, s, *(statistics.fmean(cell[c]) if cell.get(c) else None
                                        for c in ("error", "nll", "brier", "ece")), len(cell["error"])])
    _write_csv(report, "ablation.csv", ["method", "dataset", "n_samples", "error_pct", "nll", "brier", "ece", "n"], rows)
    text = ("## Number of Monte Carlo samples S\n\nTest error (%), NLL and ECE of the Bayes ensemble of S samples "
            f"(lower is better for all three), mean over seeds; S ∈ {{{', '.join(map(str, found))}}} measured "
            "(all of them in `ablation.csv`). Files: `ablation.md`, `ablation.csv`.\n\n" + md_table(header, table) + "\n")
    _write(report, "ablation.md", text.replace("## ", "# ", 1))
    return text


def time_section(report: Report, ok: list[Run]) -> str:
    """Training wall time per method and dataset, and its ratio to DBSN's on the same data (the
    paper's Table 5 compares DBSN's 1.2 h with VOGN's 13 h)."""
    values, epochs = defaultdict(list), defaultdict(set)
    for r in ok:
        if r.train_seconds is not None:
            values[r.method, r.dataset].append(r.train_seconds / 60.0)
            epochs[r.method, r.dataset].add(r.epochs)
    if not values:
        return ""
    rows, table = [], []
    for dataset in _order({d for _, d in values}, DATASET_ORDER):
        reference = values.get(("dbsn", dataset))
        for method in _order({m for m, d in values if d == dataset}, METHOD_ORDER):
            stats = mean_std(values[method, dataset])
            ratio = stats[0] / statistics.fmean(reference) if reference else None
            shown_epochs = ", ".join(str(e) for e in sorted(epochs[method, dataset], key=str))
            table.append([method, dataset, fmt(stats, 1), shown_epochs, "–" if ratio is None else f"{ratio:.2f}"])
            rows.append([method, dataset, *stats, shown_epochs, ratio])
    _write_csv(report, "time.csv", ["method", "dataset", "mean_minutes", "std_minutes", "n", "low_minutes", "high_minutes",
                                    "epochs", "ratio_to_dbsn"], rows)
    text = ("## Training time\n\nWall time of training (the fit, validation included, resumed parts added up), in "
            "minutes, mean ± std [95 % t interval] (n runs), and its ratio to DBSN's mean on the same data. Only comparable between "
            "runs on the same hardware. Files: `time.md`, `time.csv`.\n\n"
            + md_table(["method", "dataset", "minutes", "epochs", "× DBSN"], table) + "\n")
    _write(report, "time.md", text.replace("## ", "# ", 1))
    return text


def runs_section(report: Report) -> str:
    text = "## Runs not included\n\n"
    excluded = [r for r in report.runs if r.status != "ok"]
    if not excluded:
        return text + "None: every run found finished and every expected sweep job has a folder.\n\n"
    for r in excluded:
        overrides = " ".join(map(str, r.overrides)) or "no overrides recorded"
        log = f" — SLURM log: `{r.log}`" if r.log else ""
        text += (f"- **{r.status}**: {r.method} on {r.dataset}, seed {r.seed} — `{_show(r.path)}` — "
                 f"`{overrides}` ({r.note}){log}\n")
    return text + "\n"


#: evaluations with a section of their own above; any other evaluation's numbers (its
#: `<name>/summary.json`) go into `other_evaluations_section`
OWN_SECTIONS = ("ood", "shift", "adversarial", "conformal")


def other_evaluations_section(report: Report, ok: list[Run]) -> str:
    """One table per evaluation the report has no section for (a user's own, by its name):
    every number of its summary, per (method, dataset), mean ± std over seeds."""
    found: dict[str, dict[tuple[str, str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        for path in sorted((r.path / "evaluation").glob("*/summary.json")):
            name = path.parent.name
            if name in OWN_SECTIONS:
                continue
            try:
                metrics = json.loads(path.read_text())["metrics"]
            except (ValueError, KeyError, TypeError):
                report.warnings.append(f"unreadable {_show(path)}")
                continue
            for key, value in metrics.items():
                found[name][r.method, r.dataset, key].append(float(value))
    text = ""
    for name in sorted(found):
        cells = found[name]
        order = sorted(cells, key=lambda k: (k[1], METHOD_ORDER.index(k[0]) if k[0] in METHOD_ORDER else len(METHOD_ORDER),
                                            k[0], k[2]))
        stats = {cell: mean_std(cells[cell]) for cell in order}
        table = md_table(["method", "dataset", "metric", "value"], [[*cell, fmt(stats[cell], 4)] for cell in order])
        stem = f"evaluation_{_slug(name)}"
        _write(report, f"{stem}.md", f"# Evaluation: {name}\n\n{table}")
        _write_csv(report, f"{stem}.csv", ["method", "dataset", "metric", *STATS],
                   [[*cell, *stats[cell]] for cell in order])
        text += (f"## Evaluation: {name}\n\nEvery number of `evaluations=[{name}]` (its `summary.json`), mean ± std "
                 f"over seeds (n). Files: `{stem}.md`, `{stem}.csv`.\n\n{table}\n")
    return text


def ood_scores_section(report: Report, ok: list[Run]) -> str:
    """Score by method: for each in-distribution set and each OOD set or near / far group, one row
    per method and one column per detection score, AUROC and FPR95 in %: which score detects best
    for which method, and whether a method's own uncertainty beats a plain network's logits or
    features."""
    values: dict[tuple, list[float]] = defaultdict(list)
    listed = []  # each record's scores, in its order
    for r in ok:
        folder = r.path / "evaluation" / "ood"
        for path in ood_records(folder):
            record = json.loads(path.read_text())
            listed.append(list(record["scores"]))
            for score, metrics in record["scores"].items():
                for metric in ("auroc", "fpr95"):
                    if isinstance(metrics.get(metric), (int, float)):
                        values[r.dataset, str(record["ood"]), r.method, score, metric].append(metrics[metric])
        groups = folder / "groups.json"
        if groups.is_file():
            for key, value in json.loads(groups.read_text())["metrics"].items():
                _, group, score, metric = key.split("/")
                if metric in ("auroc", "fpr95"):
                    values[r.dataset, f"{group} (group mean)", r.method, score, metric].append(value)
    if not values:
        return ""
    text, rows = "", []
    score_order = _score_order(listed)
    for dataset, target in sorted({k[:2] for k in values}, key=lambda k: (k[0], "group mean" not in k[1], k[1])):
        keys = [k for k in values if k[:2] == (dataset, target)]
        scores = _order({k[3] for k in keys}, score_order)
        methods = _order({k[2] for k in keys}, METHOD_ORDER)
        for metric, label in (("auroc", "AUROC (%) ↑"), ("fpr95", "FPR95 (%) ↓")):
            table = []
            for method in methods:
                cells = []
                for score in scores:
                    found = values.get((dataset, target, method, score, metric))
                    cell = mean_std(found) if found else None
                    cells.append(short(cell, 1, 100.0))
                    if cell is not None:
                        rows.append([method, dataset, target, score, metric, *cell])
                table.append([method, *cells])
            text += f"### {dataset} vs {target}: {label}\n\n" + md_table(["method", *scores], table) + "\n"
    _write_csv(report, "ood_scores.csv", ["method", "dataset", "ood", "score", "metric", *STATS], rows)
    text = ("## OOD detection by score and method\n\nOne column per detection score (higher is more OOD for every "
            "score; `_members`: averaged over the members rather than computed on their mean logits or predictive; "
            "what each is computed on: each run's `ood/<set>/metrics.json`, `computed_on`), one row per method; mean ± std over "
            "seeds, in %. A dash: the score was not evaluated or does not apply (ViM needs a linear last layer; "
            "a `_members` score needs more than one member). Files: `ood_scores.md`, `ood_scores.csv`.\n\n" + text)
    _write(report, "ood_scores.md", text.replace("## ", "# ", 1))
    return text


def calibrators_section(report: Report, ok: list[Run]) -> str:
    """Each method uncalibrated and after every post-hoc calibrator it was evaluated with
    (`evaluate.py ckpt_path=<run> posthoc=<calibrator>`): test NLL, ECE and error, one row per
    method, one column per calibrator the runs name (metrics.json's `calibrator`; the column is the
    last part of the run's method, `<method>+<name>`), in alphabetical order; "" when no run has a
    calibrator."""
    values: dict[tuple, list[float]] = defaultdict(list)
    found = False
    for r in ok:
        base, _, posthoc = r.method.rpartition("+")
        base, posthoc = (base, posthoc) if r.calibrator else (r.method, "")
        found |= bool(posthoc)
        for key in ("test/nll", "test/ece", "test/error"):
            if key in r.metrics:
                values[r.dataset, base, posthoc, key].append(float(r.metrics[key]))
    if not found:
        return ""
    text, rows = "", []
    columns = ["", *sorted({k[2] for k in values} - {""})]
    for dataset in sorted({k[0] for k in values}):
        methods = _order({k[1] for k in values if k[0] == dataset and any(
            (dataset, k[1], c, "test/nll") in values for c in columns[1:])}, METHOD_ORDER)
        for key, label, scale, digits in (("test/nll", "test NLL ↓", 1.0, 4), ("test/ece", "ECE ↓", 1.0, 4),
                                          ("test/error", "test error (%) (argmax moves under some calibrators)", 100.0, 2)):
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
    _write_csv(report, "calibrators.csv", ["method", "dataset", "calibrator", "metric", *STATS], rows)
    text = ("## Post-hoc calibrators\n\nEvery method as trained (none) and after each calibrator fitted on the "
            "validation split (`evaluate.py ckpt_path=<run> posthoc=<calibrator>`; `docs/evaluation.md` describes "
            "them). Mean ± std over seeds (n). A calibrator that may move a prediction's class (its runs record "
            "`calibrator_argmax_changed`) changes the error too, so the error is shown. "
            "Files: `calibrators.md`, `calibrators.csv`.\n\n" + text)
    _write(report, "calibrators.md", text.replace("## ", "# ", 1))
    return text


#: the conformal table's columns: (metric under conformal/<level>/<score>/, label, digits)
CONFORMAL_COLUMNS = (("coverage", "coverage", 3), ("size", "mean size ↓", 2), ("ssc", "size-stratified coverage ↑", 3),
                     ("class_coverage_min", "lowest class coverage ↑", 3), ("empty", "empty sets", 3),
                     ("shift/coverage", "coverage under shift", 3), ("shift/size", "size under shift", 2))
CONFORMAL_SCORES = ("thr", "aps", "aps_randomized", "raps", "raps_randomized")
#: how the conformal table names each empty-set convention (`evaluations.conformal.allow_empty_sets`)
CONFORMAL_SET_RULES = {False: "never empty: the top label alone where {y : s ≤ q̂} is empty (allow_empty_sets=false, "
                              "the authors' allow_zero_sets=False)",
                       True: "{y : s ≤ q̂}, empty sets kept (allow_empty_sets=true)"}


def conformal_section(report: Report, ok: list[Run]) -> str:
    """Conformal prediction sets (`evaluations=[conformal]`): per dataset and level, one row per
    (method, score) with coverage, mean set size, size-stratified and classwise coverage, the share
    of empty sets and, where the shift evaluation ran beside it, coverage and size under shift
    (means over corruptions and severities); "" when no run has them. Each table says which
    empty-set convention its runs used (`allow_empty_sets` in metrics.json; absent: written before
    the setting, when empty sets were always kept); runs of different conventions are never
    averaged together, and a table holding both gets a column `empty sets allowed`."""
    values: dict[tuple, list[float]] = defaultdict(list)
    for r in ok:
        path = r.path / "evaluation" / "conformal" / "metrics.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        allow = bool(record.get("allow_empty_sets", True))
        for key, value in (record.get("metrics") or {}).items():
            parts = key.split("/")
            if len(parts) >= 4 and parts[0] == "conformal" and isinstance(value, (int, float)):
                values[r.dataset, parts[1], r.method, allow, parts[2], "/".join(parts[3:])].append(float(value))
    if not values:
        return ""
    text, rows = "", []
    for dataset, level in sorted({k[:2] for k in values}, key=lambda k: (k[0], float(k[1]))):
        keys = [k for k in values if k[:2] == (dataset, level)]
        columns = [c for c in CONFORMAL_COLUMNS if any(k[5] == c[0] for k in keys)]
        rules = sorted({k[3] for k in keys})
        table = []
        for method in _order({k[2] for k in keys}, METHOD_ORDER):
            for allow in sorted({k[3] for k in keys if k[2] == method}):
                for score in _order({k[4] for k in keys if k[2:4] == (method, allow)}, CONFORMAL_SCORES):
                    cells = []
                    for metric, _, digits in columns:
                        found = values.get((dataset, level, method, allow, score, metric))
                        cell = mean_std(found) if found else None
                        cells.append(short(cell, digits))
                        if cell is not None:
                            rows.append([method, dataset, level, score, str(allow).lower(), metric, *cell])
                    table.append([method, score, *(["yes" if allow else "no"] if len(rules) > 1 else []), *cells])
        if len(rules) > 1:
            line = ("Sets: both conventions ran; `empty sets allowed` no: " + CONFORMAL_SET_RULES[False] + "; yes: "
                    + CONFORMAL_SET_RULES[True] + ".")
        else:
            line = "Sets: " + CONFORMAL_SET_RULES[rules[0]] + "."
        header = ["method", "score", *(["empty sets allowed"] if len(rules) > 1 else []),
                  *(label for _, label, _ in columns)]
        text += f"### {dataset}, nominal coverage {level} %\n\n{line}\n\n" + md_table(header, table) + "\n"
    _write_csv(report, "conformal.csv", ["method", "dataset", "level", "score", "allow_empty_sets", "metric", *STATS],
               rows)
    text = ("## Conformal prediction sets\n\nSets of labels from each method's predictive that hold the true label "
            "with the nominal probability (`evaluate.py evaluations=[conformal]`), calibrated on a split that never "
            "overlaps the evaluated images: THR (Sadinle et al. 2019), APS (Romano et al. 2020) and RAPS (Angelopoulos "
            "et al. 2021), each also randomised. By default a set is never empty: where the rule s ≤ q̂ leaves none, "
            "it holds the top label (the authors' convention; this only adds labels, so coverage can only rise); "
            "`evaluations.conformal.allow_empty_sets=true` keeps empty sets. Each table says which ran. Coverage "
            "should be at least the nominal level; at equal coverage "
            "smaller sets are better; size-stratified and lowest class coverage show whether sets adapt to "
            "difficulty (no conformal method guarantees them); under shift the calibration split stays clean, so "
            "coverage falls. Mean ± std over seeds. Files: `conformal.md`, `conformal.csv`.\n\n" + text)
    _write(report, "conformal.md", text.replace("## ", "# ", 1))
    return text


# ---------------------------------------------------------------------- the learning-rate search
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
    for dataset in _order({r.dataset for r in tuned}, DATASET_ORDER):
        curves, chosen = {}, {}
        for method in _order({r.method for r in tuned if r.dataset == dataset}, METHOD_ORDER):
            runs = [r for r in tuned if r.method == method and r.dataset == dataset]
            per_run = [{float(lr): float(v) for lr, v in r.tuning["validation_nll"].items()} for r in runs]
            for run, curve in zip(runs, per_run):
                rows.append([method, dataset, str(run.seed), *(("diverged" if curve.get(lr) == float("inf") else
                                                                 "–" if lr not in curve else f"{curve[lr]:.4f}") for lr in grid),
                             f"{run.tuning['chosen']:g}"])
                csv_rows.append([method, dataset, run.seed, *(curve.get(lr) for lr in grid), run.tuning["chosen"]])
            mean = {lr: statistics.fmean(c[lr] for c in per_run) for lr in grid if all(lr in c for c in per_run)}
            curves[method] = mean
            chosen[method] = min((lr for lr in mean if mean[lr] < float("inf")), key=mean.get, default=None)
        name = f"tuning_{dataset}.png"
        if _figure(report, tuning_figure(curves, chosen, title=f"Learning-rate search on {dataset}"), name):
            figures += f"![Learning-rate search]({name})\n\n"
    header = ["method", "dataset", "seed", *(f"lr {lr:g}" for lr in grid), "chosen"]
    _write_csv(report, "tuning.csv", ["method", "dataset", "seed", *(f"val_nll_lr_{lr:g}" for lr in grid), "chosen"], csv_rows)
    text = ("## Learning-rate search\n\nEach method's base learning rate, chosen from one grid for every method by the "
            "validation NLL after the last epoch (a validation split held out of the training set; the test set unseen), "
            "in runs of the comparison's epochs, batch and schedule shape; the method then trained and tested with it. "
            "The figure plots the mean over seeds, each method's choice starred. Files: `tuning.md`, `tuning.csv`.\n\n"
            + md_table(header, rows) + "\n"
            + (f"{len(reused)} further run(s) trained with a search above (another seed's, `--tuned-from`, or a deep "
               "ensemble's members', map_fixed's), not repeated here: "
               + ", ".join(sorted({f"{r.method} seed {r.seed}" for r in reused})) + ".\n\n" if reused else "")
            + figures)
    _write(report, "tuning.md", text.replace("## ", "# ", 1))
    return text
