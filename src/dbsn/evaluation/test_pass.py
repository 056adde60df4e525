"""The test pass: what every training and every evaluation run reports about its test set.

`run_test_pass` runs the method's Bayes-ensemble prediction over the test split once (Lightning's
`trainer.test`) with a `PredictionRecorder` attached (`dbsn.evaluation.recorder`): the method logs
its metrics (`test/{error,nll,brier,ece}`, the entropy decomposition, for segmentation mIoU and
per-class IoU); the recorder keeps per-example predictions and scores and the metrics of every
smaller ensemble (the MC-sample ablation). `prediction_results` turns both into `Results`:

- `metrics.json`: every test metric, plus the calibration beyond the equal-width ECE
  (`test/adaptive_ece`, `test/classwise_ece`) and the selective-prediction metrics of each
  uncertainty score (`selective/<score>/{aurc,eaurc,augrc,risk@80}`, `selective/optimal_aurc`),
  with the facts of the run (`record`);
- `reliability_diagram.png`, `risk_coverage.png` (classifiers), `uncertainty_maps.png`
  (segmentation), `ablation/` (the MC-sample ablation), `structure/` (the learned structure
  posterior, where the method has one and `structure` is asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dbsn import __version__
from dbsn.evaluation.ablation import CALIBRATED_NLL_FILE, ablation_figure
from dbsn.evaluation.ablation import COLUMNS as ABLATION_COLUMNS
from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, shown_interval
from dbsn.evaluation.plots import reliability_diagram
from dbsn.evaluation.recorder import PredictionRecorder, sample_ablation
from dbsn.evaluation.results import ConsoleTable, CsvTable, Results
from dbsn.evaluation.statistics import PREDICTIONS_FILE, SELECTIVE_SCORES, Statistics, calibrate, recorded_statistics
from dbsn.evaluation.structure import edge_names_of, structure_files
from dbsn.metrics.calibration import adaptive_expected_calibration_error, classwise_expected_calibration_error
from dbsn.metrics.classification import reliability_bins
from dbsn.metrics.selective import risk_coverage_curve, risk_coverage_figure, score_as_uncertainty, selective_metrics

__all__ = ["SELECTIVE_SCORES", "add_calibrated_ablation", "prediction_quality", "prediction_results", "run_test_pass"]

#: the metrics printed first, in this order (the rest follow alphabetically)
METRIC_NAMES = (
    "error",
    "miou",
    "global_acc",
    "nll",
    "brier",
    "ece",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
)
#: the ensemble sizes the console shows of the MC-sample ablation (all are written)
SHOWN_ABLATION_SIZES = {1, 2, 5, 10, 20, 30, 50, 100}


def add_calibrated_ablation(recorded: PredictionRecorder, seed: int) -> None:
    """Each row of the MC-sample ablation gets the calibrated NLL of its ensemble (temperature by
    test-time 2-fold cross-validation, `seed`ed), where the ablation kept its ensembles (a deep
    ensemble's 1..M): the curve the deep-ensemble equivalent reads; `recorded.calibrated_ablation`
    keeps it example by example, for the equivalent's interval."""
    ablation, rows = recorded.ablation, recorded.ablation_rows
    kept = None if ablation is None or rows is None or recorded.targets is None else ablation.kept
    if kept is None:
        return
    targets, per_example = recorded.targets, []
    for row, log_probs in zip(rows, kept):
        calibrated, _ = calibrate(log_probs.double(), targets, seed=seed)
        per_example.append(-calibrated.gather(1, targets[:, None])[:, 0])
        row["calibrated_nll"] = float(per_example[-1].mean())
    recorded.calibrated_ablation = torch.stack(per_example)


def run_test_pass(
    trainer, model, datamodule, ablation_sizes: Sequence[int] | None = None
) -> tuple[dict[str, float], PredictionRecorder]:
    """`trainer.test` of `model` on `datamodule`'s test split without the trainer's loggers
    (`write_results` hands the numbers on), recorded by a `PredictionRecorder` with the MC-sample
    ablation of the ensembles of the first s members, s in `ablation_sizes` (None: every s up to
    100, then 200, 500, 1000, ... and S; []: none; `sample_ablation`). Returns every test metric (the logged ones and
    `prediction_quality`) and the recorder."""
    recorder = PredictionRecorder(sample_ablation(model, ablation_sizes))
    loggers, trainer.loggers = trainer.loggers, []
    trainer.callbacks.append(recorder)
    try:
        trainer.test(model, datamodule=datamodule, verbose=False)
    finally:
        trainer.loggers = loggers
        trainer.callbacks.remove(recorder)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
    return {**metrics, **prediction_quality(recorder)}, recorder


def _errors_and_scores(recorded: PredictionRecorder) -> tuple[Tensor, dict[str, Tensor]] | None:
    if recorded.log_probs is None or recorded.scores is None:
        return None
    errors = (recorded.log_probs.argmax(-1) != recorded.targets).double()
    return errors, {k: recorded.scores[k] for k in SELECTIVE_SCORES if k in recorded.scores}


def prediction_quality(recorded: PredictionRecorder) -> dict[str, float]:
    """Of the test pass's Bayes ensemble (classification; {} otherwise): the equal-mass and
    classwise ECE beside the logged equal-width one, and the selective-prediction metrics of each
    uncertainty score (accepting the most certain predictions first)."""
    found = _errors_and_scores(recorded)
    if found is None:
        return {}
    probs, targets = recorded.log_probs.exp(), recorded.targets
    out = {
        "test/adaptive_ece": adaptive_expected_calibration_error(probs, targets, n_bins=15).item(),
        "test/classwise_ece": classwise_expected_calibration_error(probs, targets, n_bins=15).item(),
    }
    out.update(selective_metrics(*found))  # test/ece is the test pass's own
    return out


def reliability_table(probs, targets, n_bins: int = 10) -> tuple[list[str], list[list[float]]]:
    """The reliability diagram's bins as a W&B table (empty bins left out)."""
    bins = reliability_bins(probs, targets, n_bins)
    columns = ["lower", "upper", "confidence", "accuracy", "count"]
    rows = [[float(bins[c][i]) for c in columns] for i in range(n_bins) if bins["count"][i] > 0]
    return columns, rows


def risk_coverage_results(recorded: PredictionRecorder, title: str) -> Results:
    """The risk–coverage curves of the test pass (`risk_coverage.png`, W&B image and table)."""
    found = _errors_and_scores(recorded)
    if found is None:
        return Results()
    errors, scores = found
    rows = []
    for name, score in scores.items():
        coverage, risk = risk_coverage_curve(errors, score_as_uncertainty(name, score))
        keep = np.unique(np.linspace(0, len(coverage) - 1, min(len(coverage), 101)).round().astype(int))
        rows += [[name, float(coverage[i]), float(risk[i])] for i in keep]
    return Results(
        files={"risk_coverage.png": risk_coverage_figure(errors, scores, title=f"{title}: selective prediction")},
        images={"selective/risk_coverage": "risk_coverage.png"},
        tables={"selective/risk_coverage_curve": (["score", "coverage", "risk"], rows)},
    )


def ablation_results(rows: list[dict], title: str, calibrated_nll: Tensor | None = None) -> Results:
    """The MC-sample ablation: `ablation/results.{csv,json}`, its plot, a console table; with each
    size's per-example `calibrated_nll` (sizes, N), `CALIBRATED_NLL_FILE`."""
    shown = [r for r in rows if r["n_samples"] in SHOWN_ABLATION_SIZES or r is rows[-1]]
    columns = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    results = Results(
        files={
            "ablation/results.csv": CsvTable(list(ABLATION_COLUMNS), rows),
            "ablation/results.json": rows,
            "ablation/ablation.png": ablation_figure({title: rows}, title=f"{title}: Monte Carlo samples"),
        },
        images={"test/sample_ablation": "ablation/ablation.png"},
        tables={"test/sample_ablation_table": (columns, [[r[c] for c in columns] for r in rows])},
        curves={"ablation/n_samples": [{f"ablation/{c}": float(r[c]) for c in columns} for r in rows]},
        console=[
            ConsoleTable(
                "MC-sample ablation",
                ["S", "error", "NLL", "ECE"],
                [[r["n_samples"], r["error"], r["nll"], r["ece"]] for r in shown],
            )
        ],
    )
    if calibrated_nll is not None:
        results.files[CALIBRATED_NLL_FILE] = {
            "sizes": np.array([int(r["n_samples"]) for r in rows]),
            "nll": calibrated_nll.float().numpy(),
        }
    return results


@torch.no_grad()
def structure_results(model, title: str, n_samples: int = 100) -> Results:
    """The structure posterior of a method that learns one (DBSN, FBN, MAP), in `structure/`."""
    probs = model.structure_probabilities()
    net = getattr(model, "net", None)
    if probs is None or net is None:
        return Results()
    files = structure_files(
        probs,
        model.prediction_structures(n_samples),
        net.edges,
        net.op_names,
        f"{title}: structure posterior",
        labels=edge_names_of(model),
    )
    return Results(
        files={f"structure/{name}": content for name, content in files.items()},
        images={"structure/final": "structure/final.png"},
    )


def uncertainty_maps(maps: list[dict], datamodule, title: str):
    """The paper's Figure 2 for the kept test images: input, ground truth, prediction, entropy
    and mutual information (segmentation)."""
    from dbsn.metrics.segmentation import uncertainty_grid

    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (datamodule.mean, datamodule.std))
    rows = [{**m, "image": (m["image"] * std + mean).clamp(0, 1)} for m in maps]
    return uncertainty_grid(
        rows,
        datamodule.PALETTE,
        datamodule.CLASS_NAMES,
        datamodule.ignore_index,
        title=f"{title}: pixel-wise uncertainty",
    )


def prediction_results(
    model,
    recorded: PredictionRecorder,
    metrics: dict[str, float],
    title: str,
    record: dict[str, Any] | None = None,
    structure: bool = True,
    datamodule=None,
    statistics: Statistics | None = None,
) -> Results:
    """What the test pass of `model` gives (see the module docstring): its `metrics`
    (`run_test_pass`) and what `recorded` kept of it; `record` adds the run's facts to
    metrics.json. A training run has its structure posterior from the `StructurePosteriorMonitor`
    callback already (`structure=False`). With `statistics`, a classifier's metrics get their
    bootstrap intervals and the calibrated metrics (`dbsn.evaluation.statistics`), and
    `predictions.npz` keeps the per-example predictions the report pairs methods on. The console shows
    each interval by the rule of every shown interval (`dbsn.evaluation.interval_rule`): bounds within
    the metric's limits, a note where it misses its estimate."""
    metrics, intervals, facts, arrays = dict(metrics), {}, {}, None
    found = recorded_statistics(model, recorded, datamodule, statistics) if statistics is not None else None
    if found is not None:
        metrics.update(found.metrics)
        intervals = {key: value for key, value in found.intervals.items() if key in metrics}
        facts, arrays = found.record, found.arrays
    results = Results(
        metrics=metrics,
        intervals=intervals,
        files={
            "metrics.json": {
                "metrics": metrics,
                **({"intervals": intervals} if intervals else {}),
                "dbsn_version": __version__,
                **facts,
                **(record or {}),
            }
        },
    )
    if arrays is not None:
        results.files[PREDICTIONS_FILE] = arrays
    if recorded.log_probs is not None:
        log_probs, targets = recorded.log_probs, recorded.targets
        results.add(
            Results(
                files={
                    "reliability_diagram.png": reliability_diagram(log_probs.exp(), targets, n_bins=10, title=title)
                },
                images={"test/reliability_diagram": "reliability_diagram.png"},
                tables={"test/reliability_bins": reliability_table(log_probs.exp(), targets)},
            )
        )
        results.add(risk_coverage_results(recorded, title))
    if recorded.maps and datamodule is not None:
        results.add(
            Results(
                files={"uncertainty_maps.png": uncertainty_maps(recorded.maps, datamodule, title)},
                images={"test/uncertainty_maps": "uncertainty_maps.png"},
            )
        )
    per_class = [
        [key.removeprefix("test/iou/"), float(value)] for key, value in metrics.items() if key.startswith("test/iou/")
    ]
    if per_class:
        results.tables["test/per_class_iou"] = (["class", "iou"], per_class)
    named = [f"test/{name}" for name in METRIC_NAMES if f"test/{name}" in metrics]
    rows = []
    for key in named + sorted(set(metrics) - set(named)):
        value, found = float(metrics[key]), intervals.get(key)
        shown = None if found is None else shown_interval(key, value, *found)  # the one rule of every interval
        rows.append(
            [
                key,
                value,
                *(("", "") if shown is None else shown[:2]),
                OUTSIDE_NOTE.strip("()") if shown is not None and shown.misses else "",
            ]
        )
    level = f"{100 * statistics.level:g} %" if statistics is not None else ""
    results.console.append(ConsoleTable(title, ["metric", "value", f"{level} low", f"{level} high", "note"], rows))
    if recorded.ablation_rows is not None:
        results.add(ablation_results(recorded.ablation_rows, title, recorded.calibrated_ablation))
    if structure:
        results.add(structure_results(model, title))
    return results
