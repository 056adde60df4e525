"""The report's comparisons between methods: paired differences against a reference method and
the deep-ensemble equivalent (each method's cost with the Pareto view: `sections.cost`).

**Paired differences.** Two methods tested on the same test set are scored on the same bootstrap
resamples of the test examples (`predictions.npz`, `dbsn.evaluation.statistics`), so the test
set's shared noise cancels in the difference (method − reference). Per seed: the difference with
its 95 % percentile interval; over k seeds: `seeds.combine_seeds` (Student's t with the seeds'
variance plus the test noise they share). `*`: the interval excludes zero. Multiple comparisons:
the family is every (method, metric) of one dataset, its p-values (with one seed, normal theory on
the bootstrap's standard error, so that no 2 / (B + 1) floor stops Holm) adjusted by Holm's
step-down procedure at 0.05, `†`; where Holm's first step is out of reach at few seeds
(`seeds.holm_reachable`) the table says so. Calibration is compared with the unbiased CE²
(`metrics.calibration.squared_calibration_error`), not the biased plug-in ECE, by its own paired
test (`metrics.ce2_inference`, `report.ce2_pairs`) rather than the bootstrap, which is far too
wide near 0. Calibrated metrics are paired only where both runs fitted their temperature the same way.

**The deep-ensemble equivalent** (Ashukha et al., ICLR 2020): the number of members of a deep
ensemble whose calibrated NLL (test-time cross-validation on both sides) equals a method's
(`dbsn.metrics.ensemble_equivalent`), with an interval carrying both sides' test noise; the table
names what an interval leaves out. In full: docs/evaluation.md ("How sure the numbers are").
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from dbsn.evaluation.ablation import CALIBRATED_NLL_FILE
from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, shown_interval
from dbsn.evaluation.report.ce2_pairs import CE2_ROWS, ce2_differences
from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, fmt, md_table, mean_std, order
from dbsn.evaluation.report.seeds import (
    SeedLevel,
    combine_seeds,
    holm_note,
    holm_reachable,
    holm_threshold,
    resampled_covariance,
)
from dbsn.evaluation.report.writer import write_section
from dbsn.evaluation.statistics import PREDICTIONS_FILE, Statistics, calibrate, intervals_of
from dbsn.methods.registry import METHOD_ORDER
from dbsn.metrics.ensemble_equivalent import (
    METHOD_RUNS,
    deep_ensemble_equivalent,
    deep_ensemble_equivalent_interval,
    equivalent_interval,
)
from dbsn.metrics.intervals import weighted_brier, weighted_error, weighted_nll, weighted_squared_calibration_error

__all__ = [
    "PAIRED_METRICS",
    "SeedLevel",
    "combine_seeds",
    "equivalent_section",
    "holm",
    "paired_differences",
    "paired_section",
]

#: (label, statistic of (log-probabilities, calibrated log-probabilities or None, targets, weights))
PAIRED_METRICS = {
    "error": lambda lp, cal, y, w: weighted_error(lp.exp(), y, w),
    "NLL": lambda lp, cal, y, w: weighted_nll(lp, y, w),
    "Brier": lambda lp, cal, y, w: weighted_brier(lp.exp(), y, w),
    "CE²": lambda lp, cal, y, w: weighted_squared_calibration_error(lp.exp(), y, w),
    "calibrated NLL": lambda lp, cal, y, w: None if cal is None else weighted_nll(cal, y, w),
    "calibrated CE²": lambda lp, cal, y, w: (
        None if cal is None else weighted_squared_calibration_error(cal.exp(), y, w)
    ),
}


def load_predictions(run: Run) -> dict[str, torch.Tensor] | None:
    """The run's `predictions.npz` as float64 / int64 tensors, or None. A post-hoc posterior's run
    folder (`<run>/posthoc/<name>/`) keeps its metrics.json at the top and its predictions in its
    `evaluation/`, which is where they were made."""
    path = Path(run.path) / PREDICTIONS_FILE
    if not path.is_file() and Path(run.path).parent.name == "posthoc":
        path = Path(run.path) / "evaluation" / PREDICTIONS_FILE
    if not path.is_file():
        return None
    with np.load(path) as arrays:
        out = {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
    return {k: (v.double() if v.is_floating_point() else v.long()) for k, v in out.items()}


def _metric_rows(predictions: dict[str, torch.Tensor], weights: torch.Tensor) -> dict[str, torch.Tensor]:
    log_probs, targets = predictions["log_probs"], predictions["targets"]
    calibrated = predictions.get("calibrated_log_probs")
    rows = {
        name: f(log_probs, calibrated, targets, weights) for name, f in PAIRED_METRICS.items() if name not in CE2_ROWS
    }  # CE² is paired by its own test (`ce2_differences`), not resampled
    return {k: v for k, v in rows.items() if v is not None}


def holm(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down rejections of the family: sorted p-values p_(i) are rejected while
    p_(i) <= alpha / (m - i + 1), i = 1..m."""
    m = len(p_values)
    rejected = [False] * m
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        if p_values[index] > alpha / (m - rank):
            break
        rejected[index] = True
    return rejected


def paired_differences(method: dict[int, dict], reference: dict[int, dict], statistics: Statistics) -> dict[str, dict]:
    """{metric: {"seeds": {seed: (value, low, high)}, "combined": (value, low, high), "p": p, "df": df}} of
    method − reference, from each seed's predictions (see the module docstring; df: the t test's degrees
    of freedom, inf for normal theory at one seed)."""
    seeds = sorted(set(method) & set(reference), key=str)
    per_seed: dict[str, list[torch.Tensor]] = defaultdict(list)
    out: dict[str, dict] = defaultdict(lambda: {"seeds": {}})
    for seed in seeds:
        a, b = method[seed], reference[seed]
        weights = statistics.weights(len(a["targets"]))  # the same resamples for both methods
        rows_a, rows_b = _metric_rows(a, weights), _metric_rows(b, weights)
        for name in rows_a.keys() & rows_b.keys():
            difference = rows_a[name] - rows_b[name]
            low, high = intervals_of({name: difference}, statistics.level)[name]
            out[name]["seeds"][seed] = (float(difference[0]), low, high)
            per_seed[name].append(difference)
    for name, differences in per_seed.items():
        rows = torch.stack(differences)  # (seeds, 1 + resamples), the same resamples for every seed
        found = combine_seeds(rows[:, 0], resampled_covariance(rows[:, 1:]), statistics.level)
        low, high = (found.low, found.high) if len(rows) > 1 else next(iter(out[name]["seeds"].values()))[1:]
        out[name]["combined"] = (found.value, low, high)
        out[name]["p"], out[name]["df"] = found.p, found.df
    for name, found in ce2_differences(method, reference, seeds, statistics.level).items():
        out[name]["seeds"] = found.seeds  # CE²'s own test, not the bootstrap (ce2_pairs)
        if found.single is not None:
            out[name]["combined"], out[name]["p"], out[name]["df"] = tuple(found.single[:3]), found.single.p, math.inf
        else:  # k >= 2 seeds: the seeds' spread plus the analytic covariance of their shared test noise
            level = combine_seeds(found.values, found.test_cov, statistics.level)
            out[name]["combined"], out[name]["p"], out[name]["df"] = level[:3], level.p, level.df
    return {name: out[name] for name in PAIRED_METRICS if name in out and "combined" in out[name]}


def _predictions_by_seed(runs: list[Run]) -> dict:
    """{seed: predictions}, each with the run's `calibrated_on` (where its temperature was fitted)."""
    found = {}
    for run in runs:
        predictions = load_predictions(run)
        if predictions is not None:
            found[run.seed] = {**predictions, "calibrated_on": str(run.calibration.get("fitted_on", ""))}
    return found


def _same_calibration(method: dict, reference: dict) -> dict:
    """`method`'s predictions, without its calibrated ones where they were fitted otherwise than the
    reference's (a validation split against test-time cross-validation): those are not paired."""
    if method.get("calibrated_on") == reference.get("calibrated_on"):
        return method
    return {k: v for k, v in method.items() if k != "calibrated_log_probs"}


def paired_section(report: Report, ok: list[Run], reference: str = "dbsn", statistics: Statistics | None = None) -> str:
    """The paired differences of every method against `reference`, per dataset (module docstring)."""
    statistics = statistics or Statistics()
    by_cell = defaultdict(list)
    for run in ok:
        by_cell[run.method, run.dataset].append(run)
    text, csv_rows, summary = "", [], []
    for dataset in order({d for _, d in by_cell}, DATASET_ORDER):
        if (reference, dataset) not in by_cell:
            continue
        reference_runs = _predictions_by_seed(by_cell[reference, dataset])
        found = {}
        for method in order({m for m, d in by_cell if d == dataset} - {reference}, METHOD_ORDER):
            runs = _predictions_by_seed(by_cell[method, dataset])
            usable = {
                s: _same_calibration(p, reference_runs[s])
                for s, p in runs.items()
                if s in reference_runs and torch.equal(p["targets"], reference_runs[s]["targets"])
            }
            if usable:
                found[method] = paired_differences(usable, reference_runs, statistics)
        family = [(m, name) for m, metrics in found.items() for name in metrics]
        rejected = dict(zip(family, holm([found[m][name]["p"] for m, name in family])))
        if not family:
            continue
        dfs = {key: found[key[0]][key[1]]["df"] for key in family}
        unreachable = {key: not holm_reachable(len(family), df) for key, df in dfs.items()}
        seeds = sorted({s for m in found.values() for d in m.values() for s in d["seeds"]}, key=str)
        rows, same = [], []
        for method, metrics in found.items():
            for name, d in metrics.items():
                value, low, high = d["combined"]
                excludes = not low <= 0 <= high
                mark = ("*" if excludes else "") + ("†" if rejected[method, name] else "")
                per_seed = [_interval_text(*d["seeds"][s]) if s in d["seeds"] else "–" for s in seeds]
                needs = holm_threshold(len(family), d["df"])
                p_text = f"{d['p']:.3f}" + (f" (Holm needs \\|t\\| ≥ {needs:.1f})" if unreachable[method, name] else "")
                rows.append([method, name, f"{_interval_text(value, low, high)} {mark}".strip(), *per_seed, p_text])
                csv_rows.append(
                    [
                        dataset,
                        method,
                        name,
                        value,
                        low,
                        high,
                        d["p"],
                        excludes,
                        rejected[method, name],
                        json.dumps({str(s): v for s, v in d["seeds"].items()}),
                        d["df"],
                        0.05 / len(family),
                        needs,
                        not unreachable[method, name],
                    ]
                )
                if not excludes:
                    same.append(f"{method} {name}")
        text += (
            f"### {dataset}: method − {reference}\n\n"
            + md_table(["method", "metric", "difference [95 %] (all seeds)", *(f"seed {s}" for s in seeds), "p"], rows)
            + "\n"
        )
        line = (
            f"{dataset}: indistinguishable from {reference} (95 % interval holds 0): "
            + (", ".join(same) if same else "none")
            + "."
        )
        summary.append(line)
        note = holm_note(len(family), [dfs[key] for key in family if unreachable[key]])
        text += line + "\n\n" + (note + "\n\n" if note else "")
    if not text:
        return ""
    text = write_section(
        report,
        "paired",
        f"Paired differences against {reference}",
        f"Every method against {reference} on the same test examples (a paired bootstrap: both scored on the same "
        "resamples), method − reference, so a negative difference in error, NLL, Brier or CE² favours the method. CE² "
        "is the unbiased squared calibration error, paired by its own test rather than the bootstrap (its variance as a "
        "U-statistic, `dbsn.metrics.ce2_inference`): the plug-in ECE, biased by each method's spread of confidences, "
        "is not tested. Calibrated metrics are paired only where both runs fitted their temperature the same way. Per "
        "seed (bootstrap over the test examples), and over all seeds (Student's t on the seeds' spread plus the test "
        "noise the seeds' differences share, measured on the common resamples; CE²: by its variance formula). `*`: the 95 % interval excludes 0; "
        "`†`: still rejected after Holm's correction over every (method, metric) of the dataset (family-wise error "
        "0.05); where Holm's first step needs a |t| out of reach at the comparison's few seeds (more than twice the "
        "|t| it needs with the noise known), the p column gives that |t| and a note below the table says so. Choose "
        "the reference with `--reference` (`report.reference=<method>` in a sweep).",
        text,
        [
            "dataset",
            "method",
            "metric",
            "difference",
            "low",
            "high",
            "p",
            "excludes_zero",
            "holm_rejected",
            "per_seed",
            "df",
            "holm_needs_p",
            "holm_needs_t",
            "holm_reachable",
        ],
        csv_rows,
    )
    report.summary.extend(summary)
    return text


def _interval_text(value: float, low: float, high: float) -> str:
    """A difference (no limit at 0) and its interval, flagged where it misses the difference
    (`dbsn.evaluation.interval_rule`)."""
    low, high, misses = shown_interval(None, value, low, high, difference=True)
    digits = 4 if max(abs(value), abs(low), abs(high)) < 10 else 2
    return f"{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]" + (f" {OUTSIDE_NOTE}" if misses else "")


# ---------------------------------------------------------------------- the deep-ensemble equivalent
#: what the equivalent's interval leaves out where the ensemble's per-example NLLs were not saved
UNSAVED_CURVE = "the ensemble curve's noise (its per-example NLLs were not saved: evaluate it again)"
#: ... and where the method was tested on other examples than the ensemble
OTHER_EXAMPLES = "the ensemble curve's noise (the method was tested on other examples)"


def _ensemble_curve(run: Run) -> tuple[list[int], list[float], torch.Tensor | None] | None:
    """(sizes, calibrated NLLs, each size's calibrated NLL of every test example (sizes, N), or None
    where the evaluation did not save them) of a deep-ensemble run's ablation, or None."""
    path = Path(run.path) / "ablation" / "results.json"
    if not path.is_file():
        return None
    rows = [r for r in json.loads(path.read_text()) if r.get("calibrated_nll") is not None]
    if len(rows) < 2 or rows[0]["n_samples"] != 1:
        return None
    sizes, per_example = [int(r["n_samples"]) for r in rows], None
    if (Path(run.path) / CALIBRATED_NLL_FILE).is_file():
        with np.load(Path(run.path) / CALIBRATED_NLL_FILE) as arrays:
            if [int(s) for s in arrays["sizes"]] == sizes:
                per_example = torch.from_numpy(np.asarray(arrays["nll"])).double()
    return sizes, [float(r["calibrated_nll"]) for r in rows], per_example


def _calibrated_nll(run: Run, statistics: Statistics) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(targets, calibrated NLL of every test example) of a run's predictions (temperature by test-time
    cross-validation), or None."""
    predictions = load_predictions(run)
    if predictions is None:
        return None
    targets = predictions["targets"]
    calibrated, _ = calibrate(predictions["log_probs"], targets, seed=int(statistics.seed))
    return targets, -calibrated.gather(1, targets[:, None])[:, 0]


def equivalent_section(
    report: Report, ok: list[Run], ensemble: str = "deep_ensemble", statistics: Statistics | None = None
) -> str:
    """The deep-ensemble equivalent of every method on each dataset with a deep ensemble whose
    ablation has calibrated NLLs (module docstring)."""
    statistics = statistics or Statistics()
    rows, csv_rows = [], []
    backbone = lambda name: name.partition("@")[2].partition("+")[0]  # noqa: E731 - "" on DBSN's cell network
    shown = lambda v: "> " + str(sizes[-1]) if v == float("inf") else f"{v:.2f}"  # noqa: E731
    for dataset, on in (
        (d, b)
        for d in order({r.dataset for r in ok}, DATASET_ORDER)
        for b in sorted({backbone(r.method) for r in ok if r.dataset == d})
    ):
        # each backbone's methods against the deep ensemble of the same backbone
        name = f"{ensemble}@{on}" if on else ensemble
        found = [(r, c) for r in ok if r.method == name and r.dataset == dataset if (c := _ensemble_curve(r))]
        if not found:
            continue
        sizes = found[0][1][0]
        found = [(r, c) for r, c in found if c[0] == sizes]
        curve = [float(np.mean([c[1][i] for _, c in found])) for i in range(len(sizes))]
        examples = [c[2] for _, c in found]
        ensemble_targets = [None if (p := load_predictions(r)) is None else p["targets"] for r, _ in found]
        saved = all(e is not None for e in examples) and all(t is not None for t in ensemble_targets)
        for method in order({r.method for r in ok if r.dataset == dataset and backbone(r.method) == on}, METHOD_ORDER):
            values, bounds, per_example = [], [], []
            for run in (r for r in ok if r.method == method and r.dataset == dataset):
                calibrated = _calibrated_nll(run, statistics)
                if calibrated is None:
                    continue
                targets, nll = calibrated
                weights = statistics.weights(len(targets))
                resampled = weights @ nll / weights.sum(1)  # row 0: the NLL itself
                values.append(float(resampled[0]))
                bounds.append(intervals_of({"nll": resampled}, statistics.level)["nll"])
                per_example.append((targets, nll))
            if not values:
                continue
            cell = mean_std(values, bounds)
            if method == name:  # the ensemble against its own curve: its size, by definition
                dee = low = high = float(sizes[-1])
                leaves_out = ()
            elif saved and all(torch.equal(t, targets) for t in ensemble_targets for targets, _ in per_example):
                dee, low, high, leaves_out = equivalent_interval(
                    torch.stack([nll for _, nll in per_example]), torch.stack(examples), sizes, statistics.level
                )
            else:  # the method's NLL interval through the curve, taken as exact
                best = min(curve)  # the ensemble's own NLL, recomputed from its float32 predictions, is the curve's end
                snap = lambda v: best if abs(v - best) <= 1e-6 * max(1.0, abs(best)) else v  # noqa: E731
                dee = deep_ensemble_equivalent(snap(cell.mean), sizes, curve)
                low, high = (
                    (None, None)
                    if cell.low is None
                    else deep_ensemble_equivalent_interval(snap(cell.low), snap(cell.high), sizes, curve)
                )
                leaves_out = (OTHER_EXAMPLES if saved else UNSAVED_CURVE, *((METHOD_RUNS,) if len(values) == 1 else ()))
            text = shown(dee)
            if low is not None:
                low, high, misses = shown_interval("deep_ensemble_equivalent", dee, low, high)
                text += f" [{shown(low)}, {shown(high)}]" + (f" {OUTSIDE_NOTE}" if misses else "")
            left_out = "; ".join(leaves_out) or (
                "nothing (its own size, by definition)" if method == name else "nothing"
            )
            rows.append([method, dataset, fmt(cell, 4, "calibrated_nll"), text, left_out])
            csv_rows.append([method, dataset, cell.mean, cell.low, cell.high, dee, low, high, "; ".join(leaves_out)])
    if not rows:
        return ""
    return write_section(
        report,
        "equivalent",
        "Deep-ensemble equivalent",
        "The number of networks a deep ensemble needs to reach each method's calibrated NLL (Ashukha et al. 2020), "
        "interpolated between ensemble sizes; 1 means no better than one network, `> M` better than the largest "
        "ensemble measured. Both NLLs are calibrated by test-time 2-fold cross-validation. The 95 % interval holds "
        "every size at which the ensemble's curve is not distinguishable from the method's NLL: it carries the noise "
        "of both, the method's runs and the ensemble's (their members and seeds) and the test examples they share "
        "(`dbsn.metrics.ensemble_equivalent`). A side with one run has no spread across runs to measure: the last "
        "column names what an interval leaves out, and an interval that leaves anything out is a lower bound on the "
        "uncertainty.",
        md_table(
            ["method", "dataset", "calibrated NLL (CV)", "deep-ensemble equivalent", "the interval leaves out"], rows
        )
        + "\n",
        ["method", "dataset", "calibrated_nll", "nll_low", "nll_high", "dee", "dee_low", "dee_high", "leaves_out"],
        csv_rows,
    )
