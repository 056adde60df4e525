"""The evaluation pipeline end to end on the embedded digits, through the same code as train.py and
evaluate.py (dbsn.evaluation.pipeline and the evaluations it runs).

The uncertainty suite: train, then each evaluation writes its numbers and figures, and a folder
of runs gets the paper's tables. The evaluations the field expects: calibration beyond ECE and
selective prediction in every test pass, dataset shift on generated corruptions, near / far OOD
means, post-hoc Laplace and SWAG, and the report's tables.
"""

from __future__ import annotations

import csv
import json
import math
import shutil

import numpy as np
import pytest
import torch
import yaml
from hydra.errors import MissingConfigException

from dbsn.evaluation.runs import CONFIG_FILE
from dbsn.evaluation.statistics import CE2_INTERVAL
from dbsn.posthoc.base import PosthocError
from dbsn.runtime.checkpoint import AtomicCheckpointIO
from dbsn.runtime.config import ConfigError
from dbsn.runtime.run import train
from tests.support.configs import ROOT, compose_config, evaluate_quietly, tiny_for

pytestmark = pytest.mark.slow


def _train(model: str, out, epochs: int = 2):
    overrides = [
        "data=digits",
        "data.num_workers=0",
        f"model={model}",
        *tiny_for(model),
        f"trainer.max_epochs={epochs}",
        "logger=csv",
    ]
    cfg = compose_config("train", overrides, out)
    return train(cfg, out)


@pytest.fixture(scope="module")
def dbsn_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "0"
    metrics = _train("dbsn", out)
    return out, metrics


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_training_reports_decomposition_ablation_and_structure(dbsn_run):
    out, metrics = dbsn_run
    # uncertainty decomposition, logged with the other metrics
    total, aleatoric, epistemic = (
        metrics[f"test/{k}"] for k in ("predictive_entropy", "expected_entropy", "mutual_information")
    )
    assert epistemic > 0 and total == pytest.approx(aleatoric + epistemic, abs=1e-5)
    # the MC-sample ablation: S = 1..4 from the test pass; its S = 4 row is the ensemble itself
    rows = _csv(out / "ablation" / "results.csv")
    assert [int(r["n_samples"]) for r in rows] == [1, 2, 3, 4]
    for key in ("error", "nll", "brier", "ece"):
        assert float(rows[-1][key]) == pytest.approx(metrics[f"test/{key}"], rel=1e-5, abs=1e-6)
    assert (out / "ablation" / "ablation.png").stat().st_size > 1000
    # the structure posterior, written out
    summary = json.loads((out / "structure" / "final.json").read_text())
    assert len(summary["most_likely"]) == 3  # 3 nodes -> 3 edges
    assert (out / "structure" / "final.txt").read_text().strip()


@pytest.fixture(scope="module")
def evaluated_run(dbsn_run, tmp_path_factory):
    out, _ = dbsn_run
    results = evaluate_quietly(
        out / "checkpoints" / "last.ckpt",
        tmp_path_factory.mktemp("eval"),
        [
            "evaluations=[ood,adversarial]",
            "ood=[photos,noise]",
            "ood.photos.size=64",
            "ood.noise.size=32",
            "n_samples=3",
            "evaluations.ood.fit_images=300",
            "evaluations.adversarial.epsilons=[0.0,0.05,0.1]",
            "evaluations.adversarial.attack_samples=2",
            "evaluations.adversarial.eval_samples=2",
            "evaluations.adversarial.max_examples=40",
            "evaluations.adversarial.batch_size=20",
        ],
    )
    return out, results


def test_ood_and_adversarial_evaluations_write_numbers_and_figures(evaluated_run):
    out, results = evaluated_run
    folder = out / "evaluation"  # a checkpoint inside a run folder is evaluated into <run>/evaluation
    assert not (out / "wandb_id").exists() and not (folder / "wandb_id").exists()  # no W&B logger, no W&B id
    assert json.loads((folder / "metrics.json").read_text())["n_samples"] == 3
    # two OOD sets in one evaluation: a folder, numbers and a figure each, under the set's name
    ood = json.loads((folder / "ood" / "photos" / "metrics.json").read_text())
    assert ood["ood"] == "photo patches" and ood["n_in"] == 450 and ood["n_out"] == 64
    noise = json.loads((folder / "ood" / "noise" / "metrics.json").read_text())
    assert noise["n_in"] == 450 and noise["n_out"] == 32
    for score in ("entropy", "mutual_information", "max_probability"):
        assert set(ood["scores"][score]) == {"auroc", "aupr", "aupr_in", "fpr95"}
        assert 0 <= ood["scores"][score]["auroc"] <= 1
        for name, record in (("photos", ood), ("noise", noise)):
            assert results[f"ood/{name}/{score}/auroc"] == pytest.approx(record["scores"][score]["auroc"])
    scores = np.load(folder / "ood" / "photos" / "scores.npz")
    assert scores["in_entropy"].shape == (450,) and scores["out_entropy"].shape == (64,)
    assert ood["mean_entropy"]["out"] == pytest.approx(float(scores["out_entropy"].mean()), rel=1e-5)
    # both sets are compared with the same in-distribution scores (the test pass, predicted once)
    np.testing.assert_array_equal(np.load(folder / "ood" / "noise" / "scores.npz")["in_entropy"], scores["in_entropy"])
    for name in ("photos", "noise"):
        assert (folder / "ood" / name / "entropy_cdf.png").stat().st_size > 1000
    # OpenOOD's scores beside the predictive's: every one for DBSN (linear head, S = 3 members, fitted on the
    # training features), each through both sets and its bootstrap interval, saying what it is computed on
    every = [
        "entropy",
        "mutual_information",
        "max_probability",
        "max_logit",
        "max_logit_members",
        "energy",
        "energy_members",
        "mahalanobis",
        "gda",
        "knn",
        "vim",
        "odin",
        "odin_members",
    ]
    assert list(ood["scores"]) == every
    assert ood["computed_on"]["knn"] == "mean over members" and ood["computed_on"]["odin"] == "averaged predictive"
    assert ood["detection"]["members"] == 3 and ood["detection"]["left_out"] == {}
    assert ood["detection"]["scores"]["knn"] == {
        "class": "dbsn.evaluation.detection.KNNScore",
        "members": "per_member",
        "k": 50,
    }
    for score in every:
        assert results[f"ood/noise/{score}/fpr95"] == pytest.approx(noise["scores"][score]["fpr95"])
        assert scores[f"in_{score}"].shape == (450,) and np.isfinite(scores[f"out_{score}"]).all()
        assert len(ood["intervals"][score]["auroc"]) == 2

    rows = _csv(folder / "adversarial" / "results.csv")
    assert [(r["attack"], float(r["epsilon"])) for r in rows] == [
        (a, e) for a in ("fgsm", "bim") for e in (0.0, 0.05, 0.1)
    ]
    assert all(int(r["n_examples"]) == 40 for r in rows)
    # the same numbers come back under stable flat names (as logged to W&B)
    for r in rows:
        key = f"adversarial/{r['attack']}/accuracy@{float(r['epsilon']):g}"
        assert results[key] == pytest.approx(float(r["accuracy"]))
    assert (folder / "adversarial" / "adversarial.png").stat().st_size > 1000
    # ablation over the evaluation's own S = 3
    assert [int(r["n_samples"]) for r in _csv(folder / "ablation" / "results.csv")] == [1, 2, 3]


def test_deterministic_method_has_no_ablation_no_structure_and_zero_mutual_information(tmp_path):
    out = tmp_path / "map_fixed"
    metrics = _train("map_fixed", out, epochs=1)
    assert metrics["test/mutual_information"] == 0.0
    assert metrics["test/predictive_entropy"] == pytest.approx(metrics["test/expected_entropy"])
    assert not (out / "ablation").exists() and not (out / "structure").exists()


def test_per_structure_batchnorm_statistics_through_evaluate_with_attacks(dbsn_run, tmp_path):
    """evaluate.py bn_recalibration.enabled=true: the test pass fixes its members and their
    statistics, the attacks that follow differentiate through them (other members evaluate),
    and metrics.json records the training-end τ beside the test τ."""
    out, metrics = dbsn_run
    results = evaluate_quietly(
        out / "checkpoints" / "last.ckpt",
        tmp_path,
        [
            "bn_recalibration.enabled=true",
            "bn_recalibration.images=64",
            "n_samples=4",
            "evaluations=[adversarial]",
            "evaluations.adversarial.epsilons=[0.0,0.1]",
            "evaluations.adversarial.attack_samples=2",
            "evaluations.adversarial.eval_samples=2",
            "evaluations.adversarial.max_examples=20",
            "output_dir=" + str(tmp_path / "recalibrated"),
        ],
    )
    assert 0 <= results["test/error"] <= 1
    assert results["adversarial/fgsm/accuracy@0.1"] <= results["adversarial/fgsm/accuracy@0"]
    record = json.loads((tmp_path / "recalibrated" / "metrics.json").read_text())
    assert record["bn_statistics"] == "per structure, 64 images"
    assert record["test_tau"] == 1.0 and record["train_tau_final"] > 1.0  # 2 epochs of the full schedule
    assert json.loads((out / "metrics.json").read_text())["bn_statistics"] == "running"  # training's test


def test_unknown_evaluation_is_refused(dbsn_run, tmp_path):
    out, _ = dbsn_run
    with pytest.raises(MissingConfigException, match=r"evaluations/odd"):  # Hydra lists conf/evaluations/
        evaluate_quietly(out / "checkpoints" / "last.ckpt", tmp_path, ["evaluations=[odd]"])


def test_folder_of_runs_is_evaluated_and_reported_with_failed_runs_listed(dbsn_run, tmp_path):
    out, metrics = dbsn_run
    sweep = tmp_path / "sweep"
    shutil.copytree(out, sweep / "0", ignore=shutil.ignore_patterns("evaluation"))
    (sweep / "1").mkdir()
    shutil.copy(out / "resolved_config.yaml", sweep / "1")  # a run that died before finishing
    result = evaluate_quietly(
        sweep, tmp_path, ["evaluations=[ood]", "ood=noise", "ood.noise.size=32", "evaluations.ood.scores=[]"]
    )
    assert list(result["not_evaluated"]) == [str(sweep / "1")]
    assert (sweep / "0" / "evaluation" / "ood" / "noise" / "metrics.json").exists()
    report = (sweep / "report" / "report.md").read_text()
    assert f"{100 * metrics['test/error']:.2f}" in report  # Table 1 from the run's metrics.json
    assert "failed" in report and str(sweep / "1") in report
    assert list((sweep / "report").glob("ood_entropy_cdf_*.png"))


def test_notebook_shows_every_figure_of_a_run(evaluated_run, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    out, _ = evaluated_run
    notebook_dir = ROOT / "notebooks"
    notebook = nbformat.read(notebook_dir / "inspect_run.ipynb", as_version=4)
    monkeypatch.setenv("DBSN_RUN", str(out))
    NotebookClient(notebook, timeout=300, resources={"metadata": {"path": str(notebook_dir)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "test/mutual_information" in text and str(out) in text and "not in this run" not in text
    tables = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "| entropy |" in tables and "| fgsm | 0.05 |" in tables
    # reliability, ablation, structure heatmap, sharpening curves, two OOD entropy CDFs, adversarial curves
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 7


# ----- the field's benchmark evaluations ---------------------------------------------------------


@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    """MAP-fixed α on digits with a validation split (Laplace's prior precision) and SWAG's
    collector from the second of three epochs (two snapshots)."""
    out = tmp_path_factory.mktemp("sweep") / "0"
    overrides = [
        "data=digits",
        "data.num_workers=0",
        "data.val_size=200",
        "model=map_fixed",
        *tiny_for("map_fixed"),
        "trainer.max_epochs=3",
        "logger=csv",
        "callbacks=swag",
        "callbacks.swag.start=1",
    ]
    return out, train(compose_config("train", overrides, out), out)


def test_every_test_pass_reports_three_eces_and_selective_prediction(map_run):
    out, metrics = map_run
    for key in (
        "test/ece",
        "test/adaptive_ece",
        "test/classwise_ece",
        "selective/optimal_aurc",
        *(
            f"selective/{s}/{m}"
            for s in ("max_probability", "predictive_entropy", "mutual_information")
            for m in ("aurc", "eaurc", "augrc", "risk@80")
        ),
    ):
        assert key in metrics and math.isfinite(metrics[key]), key
    for score in ("max_probability", "predictive_entropy"):
        assert metrics[f"selective/{score}/aurc"] >= metrics["selective/optimal_aurc"] - 1e-12
        assert metrics[f"selective/{score}/eaurc"] == pytest.approx(
            metrics[f"selective/{score}/aurc"] - metrics["selective/optimal_aurc"], abs=1e-12
        )
    assert (
        json.loads((out / "metrics.json").read_text())["metrics"]["test/adaptive_ece"] == metrics["test/adaptive_ece"]
    )
    assert (out / "risk_coverage.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def evaluated(map_run, tmp_path_factory):
    out, _ = map_run
    shift_root = tmp_path_factory.mktemp("digits-C")
    results = evaluate_quietly(
        out / "checkpoints" / "last.ckpt",
        tmp_path_factory.mktemp("eval"),
        [
            "evaluations=[ood,shift]",
            "ood=[photos,noise]",
            "ood.photos.size=64",
            "ood.noise.size=32",
            "evaluations.ood.scores=[max_logit,mahalanobis]",
            "evaluations.ood.fit_images=128",
            "evaluations.ood.groups={near:[photos],far:[noise]}",
            f"evaluations.shift.root={shift_root}",
            "evaluations.shift.generate=true",
            "evaluations.shift.corruptions=[gaussian_noise,contrast]",
            "evaluations.shift.severities=[1,5]",
        ],
    )
    return out, results, shift_root


def test_dataset_shift_on_generated_corruptions_writes_its_table_and_figure(evaluated):
    out, results, shift_root = evaluated
    folder = out / "evaluation" / "shift"
    record = json.loads((folder / "metrics.json").read_text())
    assert (
        record["generated"] and record["source"].startswith("generated") and (shift_root / "GENERATED.json").is_file()
    )
    assert [(r["corruption"], r["severity"]) for r in record["rows"]] == [
        ("gaussian_noise", 1),
        ("gaussian_noise", 5),
        ("contrast", 1),
        ("contrast", 5),
    ]
    for metric in ("error", "nll", "brier", "ece"):
        per_corruption = [results[f"shift/{c}/5/{metric}"] for c in ("gaussian_noise", "contrast")]
        assert results[f"shift/mean/5/{metric}"] == pytest.approx(sum(per_corruption) / 2)
        everything = [results[f"shift/{c}/{s}/{metric}"] for c in ("gaussian_noise", "contrast") for s in (1, 5)]
        assert results[f"shift/mean/{metric}"] == pytest.approx(sum(everything) / 4)
    assert results["shift/generated"] == 1.0
    assert (folder / "shift.csv").read_text().count("\n") == 5 and (folder / "shift_boxplots.png").stat().st_size > 1000


def test_near_and_far_ood_are_the_means_of_their_sets(evaluated):
    out, results, _ = evaluated
    for score in ("entropy", "mutual_information", "max_probability", "max_logit", "mahalanobis"):
        for metric in ("auroc", "aupr", "fpr95"):
            assert results[f"ood/near/{score}/{metric}"] == results[f"ood/photos/{score}/{metric}"]
            assert results[f"ood/far/{score}/{metric}"] == results[f"ood/noise/{score}/{metric}"]
    groups = json.loads((out / "evaluation" / "ood" / "groups.json").read_text())
    assert groups["groups"] == {"near": ["photos"], "far": ["noise"]}


@pytest.mark.parametrize("posthoc", ["laplace", "swag"])
def test_a_post_hoc_posterior_is_evaluated_as_its_own_method(map_run, tmp_path, posthoc):
    out, trained = map_run
    results = evaluate_quietly(out / "checkpoints" / "last.ckpt", tmp_path, [f"posthoc={posthoc}", "n_samples=4"])
    folder = out / "posthoc" / posthoc
    config = yaml.safe_load((folder / CONFIG_FILE).read_text())
    assert config["posthoc"] == posthoc and config["seed"] == trained_seed(out)
    record = json.loads((folder / "metrics.json").read_text())
    assert record["posthoc"] == posthoc and record["n_samples"] == 4
    assert record["metrics"] == json.loads((folder / "evaluation" / "metrics.json").read_text())["metrics"]
    for key in ("test/error", "test/nll", "test/ece", "test/adaptive_ece", "selective/max_probability/aurc"):
        assert math.isfinite(results[key])
    assert results["test/mutual_information"] > 0  # the members differ
    assert abs(results["test/error"] - trained["test/error"]) < 0.2  # the same network, another predictive


def trained_seed(out) -> int:
    return yaml.safe_load((out / CONFIG_FILE).read_text())["seed"]


def test_a_post_hoc_posterior_the_run_cannot_have_is_refused(tmp_path, map_run):
    out, _ = map_run
    with pytest.raises(MissingConfigException, match="posthoc/bayes"):  # Hydra lists the options of conf/posthoc/
        evaluate_quietly(out / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=bayes"])
    swagless = tmp_path / "run"
    train(
        compose_config(
            "train",
            [
                "data=digits",
                "data.num_workers=0",
                "model=map_fixed",
                *tiny_for("map_fixed"),
                "trainer.max_epochs=1",
                "test=false",
            ],
            swagless,
        ),
        swagless,
    )
    with pytest.raises(ConfigError, match="callbacks=swag"):
        evaluate_quietly(swagless / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=swag"])
    with pytest.raises(PosthocError, match="marglik"):  # no validation split for the grid search
        evaluate_quietly(
            swagless / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=laplace", "posthoc.prior_precision=gridsearch"]
        )
    with pytest.raises(PosthocError, match="must be positive"):
        evaluate_quietly(
            swagless / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=laplace", "posthoc.prior_precision=0"]
        )
    # one snapshot: no covariance to sample from, said before anything is predicted
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if "SWAG" in k)
    state["moments"]["count"].fill_(1)
    AtomicCheckpointIO().save_checkpoint(checkpoint, tmp_path / "one_snapshot.ckpt")  # with the edit's own digest
    with pytest.raises(PosthocError, match="at least 2 collected snapshots.*has 1: .*callbacks.swag.collect=step"):
        evaluate_quietly(tmp_path / "one_snapshot.ckpt", tmp_path, ["posthoc=swag"])


def test_the_report_has_a_table_for_each_new_evaluation_and_rows_for_laplace_and_swag(evaluated, tmp_path):
    from dbsn.evaluation.report import build_report

    out, _, _ = evaluated
    for posthoc in ("laplace", "swag"):
        if not (out / "posthoc" / posthoc / "metrics.json").is_file():
            evaluate_quietly(
                out / "checkpoints" / "last.ckpt", tmp_path / posthoc, [f"posthoc={posthoc}", "n_samples=4"]
            )
    report = build_report([out.parent], tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    for section in (
        "## Calibration beyond equal-width ECE",
        "## Selective prediction",
        "## Near and far OOD",
        "## Dataset shift",
    ):
        assert section in text, section
    assert "NOT the published CIFAR-10-C / -100-C files" in text
    methods = {r.method for r in report.with_status("ok")}
    assert methods == {"map_fixed", "map_fixed+laplace", "map_fixed+swag"}
    selective = (tmp_path / "report" / "selective.md").read_text()
    assert all(f"| {m} | digits |" in selective for m in methods)
    assert (tmp_path / "report" / "shift_boxplots_digits.png").stat().st_size > 1000


def test_every_number_has_its_interval_and_a_rerun_of_the_evaluation_gives_the_same_metrics(
    dbsn_run, map_run, tmp_path
):
    out, trained = map_run  # has a validation split: the calibration temperature is fitted there
    record = json.loads((out / "metrics.json").read_text())
    assert record["calibration"]["fitted_on"] == "validation"
    assert record["statistics"] == {
        "seed": 0,
        "resamples": 1000,
        "level": 0.95,
        "interval": "percentile bootstrap over the test examples",
        "ce2_interval": CE2_INTERVAL,
    }
    for key in (
        "test/error",
        "test/nll",
        "test/brier",
        "test/ece",
        "test/adaptive_ece",
        "test/classwise_ece",
        "test/calibrated/nll",
        "test/calibrated/brier",
        "test/calibrated/ece",
        "selective/predictive_entropy/aurc",
        "selective/max_probability/risk@80",
    ):
        low, high = record["intervals"][key]
        assert low <= record["metrics"][key] + 1e-6 and record["metrics"][key] <= high + 1e-6 and low < high, key
    for key in ("test/ce2", "test/calibrated/ce2"):  # a CE² >= 0; its estimate may be below
        low, high = record["intervals"][key]
        assert 0 <= low <= high, key
    assert record["metrics"]["test/calibrated/nll"] <= record["metrics"]["test/nll"] + 0.05
    cost = record["cost"]
    assert cost["params"] > 0 and cost["train_flops_per_image"] > cost["predict_flops_per_image"] > 0
    assert cost["epoch_seconds"] > 0 and cost["n_samples"] == 1
    with np.load(out / "predictions.npz") as arrays:
        assert arrays["log_probs"].shape[0] == arrays["targets"].shape[0] == arrays["calibrated_log_probs"].shape[0]
    dbsn_out, _ = dbsn_run  # no validation split: test-time cross-validation; the structure draws are seeded
    written = dbsn_out / "evaluation" / "metrics.json"
    first = evaluate_quietly(dbsn_out / "checkpoints" / "last.ckpt", tmp_path / "a", ["n_samples=3"])
    intervals = json.loads(written.read_text())["intervals"]
    again = evaluate_quietly(dbsn_out / "checkpoints" / "last.ckpt", tmp_path / "b", ["n_samples=3"])
    evaluated = json.loads(written.read_text())
    assert first == again and evaluated["intervals"] == intervals
    assert evaluated["calibration"]["fitted_on"].startswith("test, 2-fold")
    assert evaluated["cost"]["n_samples"] == 3 and evaluated["cost"]["train_flops_per_image"] > 0
    other = evaluate_quietly(
        dbsn_out / "checkpoints" / "last.ckpt", tmp_path / "c", ["n_samples=3", "statistics.seed=1"]
    )
    assert other["test/nll"] != first["test/nll"]  # other structures drawn


def test_two_trainings_at_the_same_seed_give_the_same_metrics(dbsn_run, tmp_path):
    """Train and evaluate are reproducible on one machine: the same seed, the same numbers and
    intervals (thread count and machine as in this process)."""
    out, first = dbsn_run
    again = _train("dbsn", tmp_path / "again")
    assert first == again
    records = [json.loads((folder / "metrics.json").read_text()) for folder in (out, tmp_path / "again")]
    assert records[0]["intervals"] == records[1]["intervals"] and records[0]["calibration"] == records[1]["calibration"]
