"""The evaluations the field expects, end to end on digits through the same code as train.py and
evaluate.py: calibration beyond ECE and selective prediction in every test pass, dataset shift on
generated corruptions, near / far OOD means, post-hoc Laplace and SWAG, and the report's tables."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from configs import compose_config, evaluate_quietly, tiny_for

from hydra.errors import MissingConfigException

from dbsn.posthoc.base import PosthocError
from dbsn.runtime.config import ConfigError
from dbsn.evaluation.runs import CONFIG_FILE
from dbsn.runtime.run import train

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    """MAP-fixed α on digits with a validation split (Laplace's prior precision) and SWAG's
    collector from the second of three epochs (two snapshots)."""
    out = tmp_path_factory.mktemp("sweep") / "0"
    overrides = ["data=digits", "data.num_workers=0", "data.val_size=200", "model=map_fixed", *tiny_for("map_fixed"),
                 "trainer.max_epochs=3", "logger=csv", "callbacks=swag", "callbacks.swag.start=1"]
    return out, train(compose_config("train", overrides, out), out)


def test_every_test_pass_reports_three_eces_and_selective_prediction(map_run):
    out, metrics = map_run
    for key in ("test/ece", "test/adaptive_ece", "test/classwise_ece", "selective/optimal_aurc",
                *(f"selective/{s}/{m}" for s in ("max_probability", "predictive_entropy", "mutual_information")
                  for m in ("aurc", "eaurc", "augrc", "risk@80"))):
        assert key in metrics and math.isfinite(metrics[key]), key
    for score in ("max_probability", "predictive_entropy"):
        assert metrics[f"selective/{score}/aurc"] >= metrics["selective/optimal_aurc"] - 1e-12
        assert metrics[f"selective/{score}/eaurc"] == pytest.approx(
            metrics[f"selective/{score}/aurc"] - metrics["selective/optimal_aurc"], abs=1e-12)
    assert json.loads((out / "metrics.json").read_text())["metrics"]["test/adaptive_ece"] == metrics["test/adaptive_ece"]
    assert (out / "risk_coverage.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def evaluated(map_run, tmp_path_factory):
    out, _ = map_run
    shift_root = tmp_path_factory.mktemp("digits-C")
    results = evaluate_quietly(out / "checkpoints" / "last.ckpt", tmp_path_factory.mktemp("eval"), [
        "evaluations=[ood,shift]", "ood=[photos,noise]", "ood.photos.size=64", "ood.noise.size=32",
        "evaluations.ood.groups={near:[photos],far:[noise]}", f"evaluations.shift.root={shift_root}", "evaluations.shift.generate=true",
        "evaluations.shift.corruptions=[gaussian_noise,contrast]", "evaluations.shift.severities=[1,5]"])
    return out, results, shift_root


def test_dataset_shift_on_generated_corruptions_writes_its_table_and_figure(evaluated):
    out, results, shift_root = evaluated
    folder = out / "evaluation" / "shift"
    record = json.loads((folder / "metrics.json").read_text())
    assert record["generated"] and record["source"].startswith("generated") and (shift_root / "GENERATED.json").is_file()
    assert [(r["corruption"], r["severity"]) for r in record["rows"]] == [
        ("gaussian_noise", 1), ("gaussian_noise", 5), ("contrast", 1), ("contrast", 5)]
    for metric in ("error", "nll", "brier", "ece"):
        per_corruption = [results[f"shift/{c}/5/{metric}"] for c in ("gaussian_noise", "contrast")]
        assert results[f"shift/mean/5/{metric}"] == pytest.approx(sum(per_corruption) / 2)
        everything = [results[f"shift/{c}/{s}/{metric}"] for c in ("gaussian_noise", "contrast") for s in (1, 5)]
        assert results[f"shift/mean/{metric}"] == pytest.approx(sum(everything) / 4)
    assert results["shift/generated"] == 1.0
    assert (folder / "shift.csv").read_text().count("\n") == 5 and (folder / "shift_boxplots.png").stat().st_size > 1000


def test_near_and_far_ood_are_the_means_of_their_sets(evaluated):
    out, results, _ = evaluated
    for score in ("entropy", "mutual_information", "max_probability"):
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
    train(compose_config("train", ["data=digits", "data.num_workers=0", "model=map_fixed", *tiny_for("map_fixed"),
                                   "trainer.max_epochs=1", "test=false"], swagless), swagless)
    with pytest.raises(ConfigError, match="callbacks=swag"):
        evaluate_quietly(swagless / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=swag"])
    with pytest.raises(PosthocError, match="marglik"):  # no validation split for the grid search
        evaluate_quietly(swagless / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=laplace", "posthoc.prior_precision=gridsearch"])
    with pytest.raises(PosthocError, match="must be positive"):
        evaluate_quietly(swagless / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=laplace", "posthoc.prior_precision=0"])
    # one snapshot: no covariance to sample from, said before anything is predicted
    checkpoint = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if "SWAG" in k)
    state["moments"]["count"].fill_(1)
    torch.save(checkpoint, tmp_path / "one_snapshot.ckpt")
    with pytest.raises(PosthocError, match="at least 2 collected snapshots.*has 1: .*callbacks.swag.collect=step"):
        evaluate_quietly(tmp_path / "one_snapshot.ckpt", tmp_path, ["posthoc=swag"])


def test_the_report_has_a_table_for_each_new_evaluation_and_rows_for_laplace_and_swag(evaluated, tmp_path):
    from dbsn.evaluation.report import build_report

    out, _, _ = evaluated
    for posthoc in ("laplace", "swag"):
        if not (out / "posthoc" / posthoc / "metrics.json").is_file():
            evaluate_quietly(out / "checkpoints" / "last.ckpt", tmp_path / posthoc, [f"posthoc={posthoc}", "n_samples=4"])
    report = build_report([out.parent], tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    for section in ("## Calibration beyond equal-width ECE", "## Selective prediction", "## Near and far OOD",
                    "## Dataset shift"):
        assert section in text, section
    assert "NOT the published CIFAR-10-C / -100-C files" in text
    methods = {r.method for r in report.with_status("ok")}
    assert methods == {"map_fixed", "map_fixed+laplace", "map_fixed+swag"}
    selective = (tmp_path / "report" / "selective.md").read_text()
    assert all(f"| {m} | digits |" in selective for m in methods)
    assert (tmp_path / "report" / "shift_boxplots_digits.png").stat().st_size > 1000
