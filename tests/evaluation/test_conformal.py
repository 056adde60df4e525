"""The conformal evaluation (dbsn.evaluation.conformal) on the embedded digits: through evaluate.py
beside dataset shift (every name written, calibration and evaluation disjoint, each corrupted set
predicted once for both), the shift settings handed over by the config, calibration on a
validation split, the empty-set convention (from the yaml into the sets, metrics.json, the csv and
the report's conformal table), and the refusals of `check`, one line each, before the test pass.
"""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dbsn.evaluation.base import EvaluationError, Subject
from dbsn.evaluation.conformal import ConformalPrediction, calibration_split, level_name
from dbsn.evaluation.recorder import PredictionRecorder
from dbsn.evaluation.report import build_report
from dbsn.runtime.evaluation import build_evaluator
from dbsn.runtime.run import train
from tests.support.configs import compose_config, evaluate_quietly, tiny_for
from tests.support.fakeruns import DATA, MODELS, write_run

SCORES = ("thr", "aps", "aps_randomized", "raps", "raps_randomized")
METRICS = ("coverage", "size", "empty", "ssc", "class_coverage_min")
SHIFT = [
    "evaluations.shift.generate=true",
    "evaluations.shift.corruptions=[gaussian_noise,contrast]",
    "evaluations.shift.severities=[1,5]",
]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """map_fixed, one epoch on 300 digits, no validation split (calibration=auto: the test split)."""
    out = tmp_path_factory.mktemp("conformal") / "run"
    overrides = [
        "data=digits",
        "data.num_workers=0",
        "data.train_subset=300",
        "model=map_fixed",
        *tiny_for("map_fixed"),
        "trainer.max_epochs=1",
        "logger=csv",
    ]
    train(compose_config("train", overrides, out), out)
    return out


@pytest.fixture(scope="module")
def evaluated(digits_run, tmp_path_factory):
    """evaluate.py evaluations=[shift,conformal] on two generated corruptions at severities 1 and 5,
    counting the predictions of corrupted sets."""
    from dbsn.evaluation import shift

    root = tmp_path_factory.mktemp("digits-C")
    predicted = []
    original = shift._predict

    def counting(model, datamodule, images, device, batch_size):
        predicted.append(len(images))
        return original(model, datamodule, images, device, batch_size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shift, "_predict", counting)
        results = evaluate_quietly(
            digits_run / "checkpoints" / "last.ckpt",
            tmp_path_factory.mktemp("eval"),
            [
                "evaluations=[shift,conformal]",
                f"evaluations.shift.root={root}",
                *SHIFT,
                "statistics.resamples=200",
                "ablation.sizes=[]",
            ],
        )
    return digits_run / "evaluation", results, predicted


@pytest.mark.slow
def test_every_name_is_written_and_each_corrupted_set_predicted_once(evaluated):
    folder, results, predicted = evaluated
    assert predicted == [450] * 4  # 2 corruptions × 2 severities, for shift and conformal together
    record = json.loads((folder / "conformal" / "metrics.json").read_text())
    assert record["calibration"]["asked"] == "auto" and record["calibration"]["source"] == "test"
    assert record["strata"] == ["0-1", "2-3", "4-6", "7-10"]
    assert record["allow_empty_sets"] is False and "top label" in record["set_rule"]  # the yaml's default
    for level in ("90", "95"):
        for score in SCORES:
            prefix = f"conformal/{level}/{score}"
            for metric in METRICS:
                assert 0 <= results[f"{prefix}/{metric}"] <= (10 if metric == "size" else 1), prefix
                low, high = record["intervals"][f"{prefix}/{metric}"]
                assert low - 1e-9 <= results[f"{prefix}/{metric}"] <= high + 1e-9
            for metric in ("coverage", "size"):
                per_severity = [results[f"{prefix}/shift/{s}/{metric}"] for s in (1, 5)]
                assert results[f"{prefix}/shift/{metric}"] == pytest.approx(sum(per_severity) / 2)
    raps = next(r for r in record["results"] if r["score"] == "raps" and level_name(r["level"]) == "90")
    assert raps["n_tuning"] == 68 and raps["n_calibration"] == 157 and raps["k_reg"] >= 1  # 30 % of 225 tune RAPS
    assert raps["lambda"] in (0.001, 0.01, 0.1, 0.2, 0.5) and isinstance(raps["qhat"], float)
    assert sum(s["count"] for s in raps["strata"]) == 225 and sum(c["count"] for c in raps["classes"]) == 225
    five = [r for r in raps["shift"]["rows"] if r["severity"] == 5]
    assert results["conformal/90/raps/shift/5/coverage"] == pytest.approx(np.mean([r["coverage"] for r in five]))
    with open(folder / "conformal" / "conformal.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["level"], r["score"]) for r in rows] == [(level, s) for level in ("90", "95") for s in SCORES]
    assert float(rows[3]["k_reg"]) == raps["k_reg"] and "shift_coverage" in rows[0]
    assert {r["allow_empty_sets"] for r in rows} == {"False"} and raps["allow_empty_sets"] is False
    assert all(results[f"conformal/{level}/{s}/empty"] == 0 for level in ("90", "95") for s in SCORES)
    assert (folder / "conformal" / "conformal.png").stat().st_size > 1000
    assert json.loads((folder / "conformal" / "summary.json").read_text())["metrics"] == record["metrics"]
    assert "shift/mean/error" in results  # the shift evaluation itself ran on the same predictions


@pytest.mark.slow
def test_calibration_and_evaluation_examples_never_overlap(evaluated):
    folder, _, _ = evaluated
    split = np.load(folder / "conformal" / "split.npz")
    calibration, evaluation = split["calibration"], split["evaluation"]
    assert len(calibration) == len(evaluation) == 225
    assert not set(calibration) & set(evaluation) and sorted({*calibration, *evaluation}) == list(range(450))
    again = calibration_split(450, 0.5, 0)  # statistics.seed = 0: the same split
    assert np.array_equal(again[0].numpy(), calibration) and np.array_equal(again[1].numpy(), evaluation)
    assert not torch.equal(calibration_split(450, 0.5, 1)[0], again[0])


def test_the_shift_settings_are_handed_over_in_either_order_and_turned_off_with_null(tmp_path):
    from dbsn.evaluation.shift import DatasetShift

    def conformal(*overrides):
        evaluator = build_evaluator(compose_config("evaluate", ["ckpt_path=x", *overrides], tmp_path))
        return next(e for e in evaluator.evaluations if e.name == "conformal")

    for chosen in ("[shift,conformal]", "[conformal,shift]"):
        shift = conformal(f"evaluations={chosen}", *SHIFT).shift
        assert isinstance(shift, DatasetShift) and shift.generate and shift.severities == [1, 5]
        assert shift.corruptions == ["gaussian_noise", "contrast"]
    assert conformal("evaluations=[shift,conformal]", "evaluations.conformal.shift=null").shift is None
    assert conformal("evaluations=[conformal]").shift is None


def test_the_empty_set_convention_reaches_the_evaluation_from_the_yaml(tmp_path):
    def conformal(*overrides):
        evaluator = build_evaluator(
            compose_config("evaluate", ["ckpt_path=x", "evaluations=[conformal]", *overrides], tmp_path)
        )
        return next(e for e in evaluator.evaluations if e.name == "conformal")

    assert conformal().allow_empty_sets is False  # the default: the top label where a set would be empty
    assert conformal("evaluations.conformal.allow_empty_sets=true").allow_empty_sets is True


class NearestMean(torch.nn.Module):
    """A stand-in for a trained method: the log-softmax of minus the squared distance to each class's
    mean training image (preprocessed), with what an evaluation reads of a method."""

    def __init__(self, datamodule):
        super().__init__()
        images, labels = datamodule.train_set.images, datamodule.train_set.labels
        x = datamodule.preprocess(images).flatten(1)
        self.register_buffer("means", torch.stack([x[labels == k].mean(0) for k in range(10)]))
        self.task = SimpleNamespace(keeps_test_outputs=True)
        self.num_members = 1

    device = torch.device("cpu")

    def predict_log_probs(self, x):
        return torch.log_softmax(-(torch.cdist(x.flatten(1), self.means) ** 2) / 200, 1)

    def enable_test_noise(self):
        pass


@pytest.fixture(scope="module")
def nearest_mean():
    from dbsn.data.digits import DigitsDataModule

    datamodule = DigitsDataModule(num_workers=0, val_size=300, eval_batch_size=256)
    datamodule.setup("fit")
    datamodule.setup("test")
    model, recorded = NearestMean(datamodule), PredictionRecorder()  # what its test pass would have kept
    recorded.log_probs = model.predict_log_probs(datamodule.preprocess(datamodule.test_set.images))
    recorded.targets = datamodule.test_set.labels
    return Subject(model, datamodule, "nearest mean", torch.device("cpu"), progress=False, test_pass=recorded)


def test_calibration_on_the_validation_split_evaluates_every_test_example(nearest_mean):
    evaluation = ConformalPrediction(levels=[0.9], scores=["thr", "raps"])
    evaluation.check(nearest_mean)
    results = evaluation.run(nearest_mean)
    record = results.files["conformal/metrics.json"]
    assert record["calibration"]["source"] == "validation" and record["calibration"]["asked"] == "auto"
    assert record["calibration"]["n_calibration"] == 300 and record["calibration"]["n_evaluation"] == 450
    assert "conformal/split.npz" not in results.files  # every test example is evaluated
    assert set(results.metrics) == {f"conformal/90/{s}/{m}" for s in ("thr", "raps") for m in METRICS}
    # a model that classifies digits: sets well below 10 labels, coverage near the level
    assert results.metrics["conformal/90/thr/size"] < 3 and results.metrics["conformal/90/thr/coverage"] > 0.85
    again = ConformalPrediction(levels=[0.9], scores=["thr", "raps"]).run(nearest_mean)
    assert again.metrics == results.metrics  # seeded by statistics.seed


def test_default_sets_are_never_empty_and_add_only_the_top_label_to_the_bare_ones(nearest_mean):
    """At level 0.5 many of the nearest-mean model's bare sets are empty; the default sets have
    the same q̂ (k_reg, λ fixed, the same seeds), no empty set, exactly one more label where the bare
    set was empty (mean size up by the bare share of empty sets), and coverage at least as high."""
    settings = {
        "levels": [0.5],
        "scores": ["thr", "aps", "aps_randomized", "raps_randomized"],
        "raps_k_reg": 1,
        "raps_lambda": 0.01,
    }
    default = ConformalPrediction(**settings).run(nearest_mean)
    bare = ConformalPrediction(**settings, allow_empty_sets=True).run(nearest_mean)
    forced_record, bare_record = default.files["conformal/metrics.json"], bare.files["conformal/metrics.json"]
    assert forced_record["allow_empty_sets"] is False and bare_record["allow_empty_sets"] is True
    assert forced_record["set_rule"] != bare_record["set_rule"]
    for forced, plain in zip(forced_record["results"], bare_record["results"]):
        prefix = f"conformal/50/{plain['score']}"
        assert forced["qhat"] == plain["qhat"] and forced["allow_empty_sets"] is False
        assert bare.metrics[f"{prefix}/empty"] > 0.05, prefix  # the case does test something
        assert default.metrics[f"{prefix}/empty"] == 0
        assert default.metrics[f"{prefix}/size"] == pytest.approx(
            bare.metrics[f"{prefix}/size"] + bare.metrics[f"{prefix}/empty"]
        )
        assert default.metrics[f"{prefix}/coverage"] >= bare.metrics[f"{prefix}/coverage"]
    assert default.tables["conformal/table"][0][7] == "allow_empty_sets"
    assert {row[7] for row in default.tables["conformal/table"][1]} == {False}


def _conformal_run(runs, name, dataset, seed, coverage, allow=None):
    run = write_run(runs / name, MODELS["dbsn"], DATA[dataset], seed, 0.05)
    folder = run / "evaluation" / "conformal"
    folder.mkdir(parents=True)
    metrics = {"conformal/90/thr/coverage": coverage, "conformal/90/thr/empty": 0.0 if allow is False else 0.04}
    record = {"metrics": metrics, **({} if allow is None else {"allow_empty_sets": allow})}
    (folder / "metrics.json").write_text(json.dumps(record))
    (folder / "summary.json").write_text(json.dumps({"evaluation": "conformal", "metrics": metrics}))


def test_the_report_table_says_which_convention_ran_and_never_averages_the_two(tmp_path):
    """cifar10: two runs of the default; cifar100: one of each convention and one written before the
    setting (no `allow_empty_sets`: empty sets were kept then)."""
    runs = tmp_path / "runs"
    _conformal_run(runs, "dbsn_1", "cifar10", 1, 0.91, allow=False)
    _conformal_run(runs, "dbsn_2", "cifar10", 2, 0.93, allow=False)
    _conformal_run(runs, "dbsn_3", "cifar100", 1, 0.95, allow=False)
    _conformal_run(runs, "dbsn_4", "cifar100", 2, 0.90, allow=True)
    _conformal_run(runs, "dbsn_5", "cifar100", 3, 0.88)
    build_report([runs], tmp_path / "report")
    text = (tmp_path / "report" / "conformal.md").read_text()
    one = text.split("### cifar10, nominal coverage 90 %", 1)[1].split("###", 1)[0]
    assert "Sets: never empty: the top label alone where {y : s ≤ q̂} is empty (allow_empty_sets=false" in one
    assert (
        "| method | score | coverage | empty sets |" in one and "| dbsn | thr | 0.920 ± 0.014 | 0.000 ± 0.000 |" in one
    )
    both = text.split("### cifar100, nominal coverage 90 %", 1)[1]
    assert "Sets: both conventions ran" in both
    assert "| method | score | empty sets allowed | coverage | empty sets |" in both
    assert "| dbsn | thr | no | 0.950 | 0.000 |" in both  # one run: no spread
    assert "| dbsn | thr | yes | 0.890 ± 0.014 | 0.040 ± 0.000 |" in both  # the older run counts as empty sets kept
    with open(tmp_path / "report" / "conformal.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["dataset"], r["allow_empty_sets"]) for r in rows} == {
        ("cifar10", "false"),
        ("cifar100", "false"),
        ("cifar100", "true"),
    }


@pytest.mark.parametrize(
    "settings, phrase",
    [
        ({"levels": [0.9, 1.0]}, r"evaluations.conformal.levels: coverages 1 − α strictly between 0 and 1"),
        ({"scores": ["thr", "lac"]}, r"evaluations.conformal.scores: unknown \['lac'\]"),
        ({"calibration": "train"}, r"evaluations.conformal.calibration='train': choose one of"),
        ({"allow_empty_sets": "no"}, r"evaluations.conformal.allow_empty_sets='no': true \(keep the empty sets"),
        ({"calibration": "test", "calibration_fraction": 1.0}, r"calibration_fraction=1.0: the share of the test set"),
        (
            {"calibration": "test", "calibration_fraction": 0.02, "levels": [0.95], "scores": ["thr"]},
            r"level 0.95 with thr needs at least 19 calibration examples, the test split \(calibration_fraction=0.02\) has 9",
        ),
        (
            {"calibration": "test", "calibration_fraction": 0.1, "levels": [0.95]},
            r"level 0.95 with raps needs at least 61 calibration examples \(30 % of them tune RAPS\)",
        ),
    ],
)
def test_check_refuses_what_cannot_work_in_one_line(nearest_mean, settings, phrase):
    with pytest.raises(EvaluationError, match=phrase) as refused:
        ConformalPrediction(**settings).check(nearest_mean)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_validation_calibration_without_a_validation_split_is_refused_before_the_test_pass(digits_run, tmp_path):
    written = (digits_run / "metrics.json").stat().st_mtime_ns
    with pytest.raises(
        EvaluationError, match=r"calibration=validation needs a validation split, and this run has none"
    ) as refused:
        evaluate_quietly(
            digits_run / "checkpoints" / "last.ckpt",
            tmp_path,
            [
                "evaluations=[conformal]",
                "evaluations.conformal.calibration=validation",
                f"output_dir={tmp_path / 'out'}",
            ],
        )
    assert "\n" not in str(refused.value) and not (tmp_path / "out" / "metrics.json").exists()
    assert (digits_run / "metrics.json").stat().st_mtime_ns == written


def test_the_figure_draws_each_interval_where_it_lies_and_hatches_a_bar_it_misses():
    """The conformal figure's bars follow the rule of every shown interval: an interval is drawn from
    its low to its high end (an interval above its bar is not folded back over it), within the metric's
    limits (a coverage at most 1), and the bar it misses is hatched, with the figure's note."""
    from dbsn.evaluation.conformal import conformal_figure
    from dbsn.evaluation.plots import FLAGGED_NOTE, INTERVAL_LABEL

    results = [
        {"level": 0.9, "score": "thr", "coverage": 0.90, "size": 1.4},
        {"level": 0.9, "score": "aps", "coverage": 0.93, "size": 2.0},
    ]
    intervals = {
        "conformal/90/thr/coverage": [0.91, 0.95],
        "conformal/90/aps/coverage": [0.91, 1.02],
        "conformal/90/thr/size": [1.3, 1.5],
        "conformal/90/aps/size": [1.8, 2.2],
    }
    figure = conformal_figure(results, intervals, "toy")
    coverage, size = figure.axes
    bars = [
        sorted(c.lines[2][0].get_segments()[0][:, 1].tolist())
        for c in coverage.containers
        if c.get_label() == INTERVAL_LABEL
    ]
    assert np.allclose(bars, [[0.91, 0.95], [0.91, 1.0]])  # np.abs once drew thr's as [0.89, 0.95]
    assert [bar.get_hatch() for bar in coverage.patches] == ["//", None]
    assert [bar.get_hatch() for bar in size.patches] == [None, None]
    assert FLAGGED_NOTE["hatched"] in [t.get_text() for t in figure.texts]
