"""Conformal prediction sets of a classifier's Bayes-ensemble predictive (`evaluations=[conformal]`).

The test pass's log-probabilities become prediction sets that hold the label with probability at
least 1 − α (split conformal prediction; the scores, q̂ and the set metrics are in
`dbsn.metrics.conformal`). The sets are calibrated on examples the evaluation never measures:
`calibration=validation` (the run's validation split, predicted here by the same ensemble),
`test` (a seeded `calibration_fraction` of the test examples calibrates, the rest is evaluated),
or `auto` (validation where the run has one, else test; metrics.json says which).

For every level of `levels` and score of `scores` (thr, aps, aps_randomized, raps,
raps_randomized; RAPS's k_reg and λ tuned on 30 % of the calibration examples, as the authors'
code) it logs `conformal/<level>/<score>/{coverage,size,empty,ssc,class_coverage_min}` with
bootstrap intervals (q̂ held fixed). Sets are never empty by default (`allow_empty_sets=false`: an
empty set gets the top label, the authors' and lightning-uq-box's convention, so coverage can only
rise). Given a `DatasetShift` (`evaluations=[shift,conformal]`), the clean-calibrated sets are
also measured on every corruption × severity (`.../shift/...`), where exchangeability no longer
holds. Files, names and conventions in full: docs/evaluation.md ("Conformal prediction sets").
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from rich.console import Console
from torch import Tensor

from dbsn.data.shift import SEVERITIES, check_corrupted_files
from dbsn.evaluation.base import Evaluation, EvaluationError, Subject
from dbsn.evaluation.plots import FLAGGED_NOTE, interval_bar
from dbsn.evaluation.progress import progress
from dbsn.evaluation.results import ConsoleTable, CsvTable, Results
from dbsn.evaluation.shift import DatasetShift, corrupted_log_probs
from dbsn.evaluation.statistics import intervals_of, validation_predictions
from dbsn.metrics.conformal import (
    SCORES,
    SET_METRICS,
    TUNING_FRACTION,
    calibrate,
    quantile_rank,
    set_metrics,
    set_rule,
    size_strata,
    stratum_name,
    tuning_size,
    weighted_set_metrics,
)

__all__ = [
    "CALIBRATIONS",
    "ConformalPrediction",
    "calibration_split",
    "conformal_figure",
    "level_name",
    "minimum_calibration",
]

#: where the sets are calibrated: `auto` picks validation where the run has a validation split
CALIBRATIONS = ("auto", "validation", "test")
#: what is measured of the sets on each corrupted set
SHIFT_SET_METRICS = ("coverage", "size")


def level_name(level: float) -> str:
    """How names write a level 1 − α: 100·(1 − α), e.g. '90', '95', '97.5'."""
    return f"{round(100 * float(level), 6):g}"


def calibration_split(n: int, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """(calibration, evaluation) sorted indices of n test examples: a seeded permutation's first
    round(fraction · n) calibrate, the rest are evaluated (disjoint, together all n)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    n_calibration = round(fraction * n)
    return order[:n_calibration].sort().values, order[n_calibration:].sort().values


def minimum_calibration(level: float, score: str, k_reg: int | None = None, lam: float | None = None) -> int:
    """The fewest calibration examples for which `score`'s q̂ at `level` is finite: ⌈(n + 1)(1 − α)⌉
    ≤ n for the examples that give q̂ and, where RAPS is tuned, for its tuning part too."""
    tuned = SCORES[score][1] and (k_reg is None or lam is None)
    n = 1
    while True:
        parts = [n - tuning_size(n, score), tuning_size(n, score)] if tuned else [n]
        if all(m >= 1 and quantile_rank(m, 1 - level) <= m for m in parts):
            return n
        n += 1


def _generator(seed: int, *parts: Any) -> torch.Generator:
    """A generator of its own for each (level, score): one's draws never shift another's."""
    stream = zlib.crc32("/".join(map(str, parts)).encode())
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + stream)


class ConformalPrediction(Evaluation):
    """Conformal prediction sets of the test pass's predictive, calibrated on the validation split
    or on part of the test set, optionally measured under dataset shift; see the module docstring.

    Args:
        levels: the coverages 1 − α the sets are calibrated for, each in (0, 1).
        scores: conformity scores (`dbsn.metrics.conformal.SCORES`).
        calibration: `auto`, `validation` or `test` (see the module docstring).
        calibration_fraction: with test calibration, the share of the test examples that calibrates.
        raps_k_reg: RAPS's k_reg; None (default): tuned on `TUNING_FRACTION` of the calibration
            examples, as the authors' code.
        raps_lambda: RAPS's λ; None (default): tuned as `raps_k_reg` is.
        allow_empty_sets: False (default): a set that s ≤ q̂ leaves empty gets the top label alone
            (the authors' `allow_zero_sets=False`); True: the bare rule, empty sets kept.
        shift: the dataset-shift settings (a `DatasetShift`; the yaml hands over
            `evaluations.shift` when that is chosen); None: no shift.
    """

    name = "conformal"

    def __init__(
        self,
        levels: Sequence[float] = (0.9, 0.95),
        scores: Sequence[str] = ("thr", "aps", "aps_randomized", "raps", "raps_randomized"),
        calibration: str = "auto",
        calibration_fraction: float = 0.5,
        raps_k_reg: int | None = None,
        raps_lambda: float | None = None,
        shift: DatasetShift | None = None,
        allow_empty_sets: bool = False,
    ) -> None:
        self.levels = [float(level) for level in levels or ()]
        self.scores = [str(score) for score in scores or ()]
        self.calibration, self.calibration_fraction = str(calibration), float(calibration_fraction)
        self.raps_k_reg = None if raps_k_reg is None else int(raps_k_reg)
        self.raps_lambda = None if raps_lambda is None else float(raps_lambda)
        self.shift = shift
        self.allow_empty_sets = allow_empty_sets

    # ------------------------------------------------------------------ what it will use
    def source(self, datamodule) -> str:
        """Where the sets are calibrated: 'validation' or 'test' (`auto` resolved)."""
        if self.calibration == "auto":
            return "validation" if getattr(datamodule, "has_val", False) else "test"
        return self.calibration

    def split_sizes(self, datamodule) -> tuple[int, int]:
        """(calibration, evaluation) example counts (reads the splits' sizes)."""
        datamodule.setup("test")
        n_test = len(datamodule.test_set)
        if self.source(datamodule) == "validation":
            if getattr(datamodule, "val_set", None) is None:
                datamodule.setup("validate")
            return (len(datamodule.val_set) if datamodule.val_set is not None else 0), n_test
        n_calibration = round(self.calibration_fraction * n_test)
        return n_calibration, n_test - n_calibration

    def check(self, subject: Subject) -> None:
        """The settings, a validation split where one is asked for, enough calibration examples for
        every level and score (else q̂ = +inf: every set would hold every label), and the shift
        files; each refusal one line."""
        super().check(subject)
        key = "evaluations.conformal"
        bad = [level for level in self.levels if not 0 < level < 1]
        if bad or not self.levels:
            raise EvaluationError(
                f"{key}.levels: coverages 1 − α strictly between 0 and 1 (e.g. [0.9,0.95]), got {self.levels}."
            )
        unknown = [score for score in self.scores if score not in SCORES]
        if unknown or not self.scores or len(set(self.scores)) != len(self.scores):
            raise EvaluationError(
                f"{key}.scores: {'unknown ' + str(unknown) if unknown else 'got ' + str(self.scores)}; "
                f"choose distinct names from {list(SCORES)}."
            )
        if self.calibration not in CALIBRATIONS:
            raise EvaluationError(f"{key}.calibration={self.calibration!r}: choose one of {list(CALIBRATIONS)}.")
        if not 0 < self.calibration_fraction < 1:
            raise EvaluationError(
                f"{key}.calibration_fraction={self.calibration_fraction}: the share of the test set "
                "that calibrates lies strictly between 0 and 1."
            )
        if self.raps_k_reg is not None and self.raps_k_reg < 0:
            raise EvaluationError(f"{key}.raps_k_reg={self.raps_k_reg}: a rank >= 0, or null to tune it.")
        if self.raps_lambda is not None and self.raps_lambda < 0:
            raise EvaluationError(f"{key}.raps_lambda={self.raps_lambda}: a penalty >= 0, or null to tune it.")
        if not isinstance(self.allow_empty_sets, bool):
            raise EvaluationError(
                f"{key}.allow_empty_sets={self.allow_empty_sets!r}: true (keep the empty sets of "
                "s ≤ q̂) or false (the top label where a set would be empty)."
            )
        datamodule = subject.datamodule
        if self.calibration == "validation" and not getattr(datamodule, "has_val", False):
            raise EvaluationError(
                f"{key}.calibration=validation needs a validation split, and this run has none "
                "(data.val_size=0 in training): use calibration=test (a seeded part of the test set) "
                "or auto, or train with data.val_size=<n>."
            )
        n_calibration, n_evaluation = self.split_sizes(datamodule)
        where = (
            "validation split"
            if self.source(datamodule) == "validation"
            else f"test split (calibration_fraction={self.calibration_fraction})"
        )
        if n_evaluation < 1:
            raise EvaluationError(
                f"{key}.calibration_fraction={self.calibration_fraction} leaves no test example to evaluate: lower it."
            )
        for level in self.levels:
            for score in self.scores:
                needed = minimum_calibration(level, score, self.raps_k_reg, self.raps_lambda)
                if n_calibration < needed:
                    tuned = " (30 % of them tune RAPS)" if needed > minimum_calibration(level, "thr") else ""
                    raise EvaluationError(
                        f"{key}: level {level} with {score} needs at least {needed} calibration examples{tuned}, the "
                        f"{where} has {n_calibration}: with fewer, ⌈(n + 1)(1 − α)⌉ > n and every set holds every "
                        "label; lower the level or calibrate on more examples."
                    )
        if self.shift is not None:
            self.shift.check(subject)
            if self.source(datamodule) == "test":
                self._check_shift_matches(datamodule)

    def _check_shift_matches(self, datamodule) -> None:
        """Test calibration measures the corrupted sets at the evaluation examples: they must be the
        test images, as many, in the same order (generated sets are; published ones of this test set too)."""
        folder = self.shift.folder(datamodule)
        generate, corruptions = self.shift.plan(folder)
        if generate:
            return
        labels, _ = check_corrupted_files(folder, corruptions)
        per_severity = len(labels) // len(SEVERITIES)
        if per_severity != len(datamodule.test_set) or not np.array_equal(
            np.asarray(labels[:per_severity]), datamodule.test_set.labels.numpy()
        ):
            raise EvaluationError(
                f"evaluations.conformal: {folder} holds {per_severity} images per severity whose labels "
                f"are not the {len(datamodule.test_set)} test labels in order, so test calibration "
                "cannot pick the evaluation examples out of them: use calibration=validation."
            )

    # ------------------------------------------------------------------ evaluation
    def run(self, subject: Subject) -> Results:
        model, datamodule, statistics = subject.model, subject.datamodule, subject.statistics
        log_probs, targets = subject.test_pass.log_probs, subject.test_pass.targets
        probs = log_probs.double().exp()
        source = self.source(datamodule)
        if source == "validation":
            with torch.inference_mode():
                found = validation_predictions(model, datamodule)
            if found is None:
                raise EvaluationError("evaluations.conformal: the validation split is empty: use calibration=test.")
            calibration_probs, calibration_targets = found[0].double().exp(), found[1]
            evaluation = torch.arange(len(targets))
        else:
            calibrating, evaluation = calibration_split(len(targets), self.calibration_fraction, statistics.seed)
            calibration_probs, calibration_targets = probs[calibrating], targets[calibrating]
        Console().print(
            f"Conformal sets calibrated on the {source} split ({len(calibration_targets)} examples; "
            f"calibration={self.calibration}), evaluated on {len(evaluation)} test examples; sets: "
            f"{set_rule(self.allow_empty_sets)} (allow_empty_sets={str(self.allow_empty_sets).lower()})"
        )
        probs, targets = probs[evaluation], targets[evaluation]
        strata = size_strata(probs.shape[1])
        weights = statistics.weights(len(targets))
        shift = self._shift_sets(subject, evaluation if source == "test" else None)
        metrics: dict[str, float] = {}
        resampled: dict[str, Tensor] = {}
        results = []
        for level in self.levels:
            for score in self.scores:
                generator = _generator(statistics.seed, level, score)
                calibrated = calibrate(
                    calibration_probs,
                    calibration_targets,
                    score,
                    1 - level,
                    generator,
                    self.raps_k_reg,
                    self.raps_lambda,
                    allow_empty_sets=self.allow_empty_sets,
                )
                sets = calibrated.sets(probs, generator)
                found = set_metrics(sets, targets, strata)
                prefix = f"conformal/{level_name(level)}/{score}"
                metrics.update({f"{prefix}/{m}": found[m] for m in SET_METRICS})
                rows = weighted_set_metrics(sets, targets, weights, strata)
                resampled.update({f"{prefix}/{m}": rows[m] for m in SET_METRICS})
                entry = {**calibrated.record(), **found}
                if shift is not None:
                    entry["shift"] = self._under_shift(
                        calibrated, generator, shift, prefix, metrics, resampled, statistics
                    )
                results.append(entry)
        intervals = intervals_of(resampled, statistics.level)
        return self._results(
            subject,
            source,
            len(calibration_targets),
            len(targets),
            results,
            metrics,
            intervals,
            shift,
            None if source == "validation" else (calibrating, evaluation),
        )

    def _shift_sets(self, subject: Subject, evaluation: Tensor | None) -> dict[str, Any] | None:
        """The corrupted sets' probabilities and labels by (corruption, severity), at the evaluation
        examples (`evaluation`; None: all), with where they come from."""
        if self.shift is None:
            return None
        folder, corruptions, generated = self.shift.prepare(subject)
        sets = {}
        steps = [(c, s) for c in corruptions for s in self.shift.severities]
        for corruption, severity in progress(steps, desc="Conformal sets under shift", enabled=subject.progress):
            log_probs, labels = corrupted_log_probs(subject, folder, corruption, severity, self.shift.batch_size)
            if evaluation is not None:
                if len(labels) != len(subject.test_pass.targets):
                    raise EvaluationError(
                        f"evaluations.conformal: {folder}'s {corruption} has {len(labels)} images "
                        "per severity, not the test set's: use calibration=validation."
                    )
                log_probs, labels = log_probs[evaluation], labels[evaluation]
            sets[corruption, int(severity)] = (log_probs.double().exp(), labels)
        return {
            "folder": str(folder),
            "corruptions": list(corruptions),
            "severities": list(self.shift.severities),
            "generated": generated,
            "sets": sets,
        }

    def _under_shift(
        self,
        calibrated,
        generator: torch.Generator,
        shift: dict[str, Any],
        prefix: str,
        metrics: dict[str, float],
        resampled: dict[str, Tensor],
        statistics,
    ) -> dict[str, Any]:
        """Coverage and size of `calibrated`'s sets on every corrupted set, their means per severity
        and overall (into `metrics`, with their resampled rows: every set resampled alike)."""
        rows, found, weights = [], {}, {}
        for (corruption, severity), (probs, labels) in shift["sets"].items():
            sets = calibrated.sets(probs, generator)
            if len(labels) not in weights:
                weights[len(labels)] = statistics.weights(len(labels))
            plain = weighted_set_metrics(sets, labels, weights[len(labels)])
            found[corruption, severity] = {m: plain[m] for m in SHIFT_SET_METRICS}
            rows.append(
                {"corruption": corruption, "severity": severity, **{m: float(plain[m][0]) for m in SHIFT_SET_METRICS}}
            )
        means = {}
        for severity in shift["severities"]:
            at = [v for (_, s), v in found.items() if s == int(severity)]
            for m in SHIFT_SET_METRICS:
                resampled[f"{prefix}/shift/{severity}/{m}"] = torch.stack([v[m] for v in at]).mean(0)
        for m in SHIFT_SET_METRICS:
            resampled[f"{prefix}/shift/{m}"] = torch.stack([v[m] for v in found.values()]).mean(0)
        for key in [k for k in resampled if k.startswith(f"{prefix}/shift/")]:
            means[key] = float(resampled[key][0])
        metrics.update(means)
        return {"rows": rows, "means": means}

    def _results(
        self,
        subject: Subject,
        source: str,
        n_calibration: int,
        n_evaluation: int,
        results: list[dict],
        metrics: dict[str, float],
        intervals: dict[str, list[float]],
        shift: dict[str, Any] | None,
        split: tuple[Tensor, Tensor] | None,
    ) -> Results:
        statistics = subject.statistics
        calibration = {
            "asked": self.calibration,
            "source": source,
            "n_calibration": n_calibration,
            "n_evaluation": n_evaluation,
            "seed": statistics.seed,
            **({"calibration_fraction": self.calibration_fraction} if source == "test" else {}),
            "raps_tuning_fraction": TUNING_FRACTION,
        }
        shift_record = None if shift is None else {k: v for k, v in shift.items() if k != "sets"}
        record = {
            "calibration": calibration,
            "levels": self.levels,
            "scores": self.scores,
            "allow_empty_sets": self.allow_empty_sets,
            "set_rule": set_rule(self.allow_empty_sets),
            "n_samples": subject.model.num_members,
            "strata": [stratum_name(s) for s in size_strata(subject.test_pass.log_probs.shape[1])],
            "results": results,
            "shift": shift_record,
            "metrics": metrics,
            "intervals": intervals,
            "statistics": {
                **statistics.record(),
                "interval": ("percentile bootstrap over the evaluation examples, q̂ (and RAPS's k_reg, λ) held fixed"),
            },
        }
        columns = [
            "level",
            "score",
            "qhat",
            "k_reg",
            "lambda",
            "n_calibration",
            "n_tuning",
            "allow_empty_sets",
            *SET_METRICS,
        ]
        if shift is not None:
            columns += ["shift_coverage", "shift_size"]
        rows = []
        for r in results:
            prefix = f"conformal/{level_name(r['level'])}/{r['score']}"
            row = {**r, "level": level_name(r["level"])}
            if shift is not None:
                row.update({f"shift_{m}": metrics[f"{prefix}/shift/{m}"] for m in SHIFT_SET_METRICS})
            rows.append(row)
        table = [[r[c] for c in columns] for r in rows]
        where = f"{source} split, {n_calibration} examples" + (
            " (calibration=auto)" if self.calibration == "auto" else ""
        )
        console = [
            ConsoleTable(
                f"Conformal sets: calibrated on the {where}; {n_evaluation} test examples evaluated; "
                f"sets {set_rule(self.allow_empty_sets)}",
                ["level", "score", *SET_METRICS],
                [[r["level"], r["score"], *(r[m] for m in SET_METRICS)] for r in rows],
            )
        ]
        if shift is not None:

            def cell(prefix: str) -> str:
                return f"{metrics[f'{prefix}/coverage']:.3f} / {metrics[f'{prefix}/size']:.2f}"

            console.append(
                ConsoleTable(
                    f"Conformal sets under shift ({'generated' if shift['generated'] else 'published'} corruptions, "
                    "mean over corruptions): coverage / mean size",
                    ["level", "score", *map(str, shift["severities"]), "all"],
                    [
                        [
                            r["level"],
                            r["score"],
                            *(cell(f"conformal/{r['level']}/{r['score']}/shift/{s}") for s in shift["severities"]),
                            cell(f"conformal/{r['level']}/{r['score']}/shift"),
                        ]
                        for r in rows
                    ],
                )
            )
        files: dict[str, Any] = {
            "conformal/metrics.json": record,
            "conformal/conformal.csv": CsvTable(columns, rows),
            "conformal/conformal.png": conformal_figure(results, intervals, subject.title),
        }
        if split is not None:
            files["conformal/split.npz"] = {"calibration": split[0].numpy(), "evaluation": split[1].numpy()}
        return Results(
            metrics=metrics,
            intervals=intervals,
            files=files,
            images={"conformal/figure": "conformal/conformal.png"},
            tables={"conformal/table": (columns, table)},
            console=console,
        )


def conformal_figure(
    results: Sequence[dict], intervals: dict[str, list[float]] | None = None, title: str | None = None
) -> Figure:
    """Coverage and mean set size per score, one bar per level (with its interval where given, by the
    rule of every shown interval: `plots.interval_bar`, a bar whose interval misses it hatched); the
    nominal coverage of each level drawn as a dashed line in its colour."""
    intervals = intervals or {}
    levels = list(dict.fromkeys(r["level"] for r in results))
    scores = list(dict.fromkeys(r["score"] for r in results))
    figure = Figure(figsize=(max(7.0, 1.6 * len(scores) + 3), 3.8), layout="constrained")
    axes = figure.subplots(1, 2)
    width, flagged = 0.8 / len(levels), False
    for ax, metric in zip(axes, ("coverage", "size")):
        for i, level in enumerate(levels):
            at = {r["score"]: r for r in results if r["level"] == level}
            x = np.arange(len(scores)) + (i - (len(levels) - 1) / 2) * width
            values = [at[s][metric] if s in at else math.nan for s in scores]
            bars = ax.bar(x, values, width * 0.9, color=f"C{i}", alpha=0.8, label=f"1 − α = {level_name(level)} %")
            for at_x, value, bar, score in zip(x, values, bars, scores):
                bounds = intervals.get(f"conformal/{level_name(level)}/{score}/{metric}")
                if (
                    bounds is not None
                    and not math.isnan(value)
                    and interval_bar(ax, at_x, value, *bounds, metric, "black")
                ):
                    bar.set_hatch("//")
                    flagged = True
            if metric == "coverage":
                ax.axhline(level, color=f"C{i}", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(scores)), scores, rotation=20)
        ax.set_ylabel("coverage (dashed: nominal)" if metric == "coverage" else "mean set size")
        ax.grid(axis="y", alpha=0.3)
    low = min([r["coverage"] for r in results] + list(levels))
    axes[0].set_ylim(max(0.0, low - 0.1), 1.0)
    axes[0].legend(loc="lower right", fontsize="small")
    if flagged:
        figure.text(0.01, 0.01, FLAGGED_NOTE["hatched"], fontsize="x-small", color="gray")
    if title:
        figure.suptitle(f"{title}: conformal prediction sets")
    return figure
