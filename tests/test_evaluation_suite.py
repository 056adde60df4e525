"""The uncertainty suite end to end: train on the embedded digits, then each evaluation writes
its numbers and figures through the same code as evaluate.py, and a folder of runs gets the
paper's tables."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hydra.errors import MissingConfigException
from configs import compose_config, evaluate_quietly, tiny_for

from dbsn.runtime.run import train

pytestmark = pytest.mark.slow

def _train(model: str, out, epochs: int = 2):
    overrides = ["data=digits", "data.num_workers=0", f"model={model}", *tiny_for(model), f"trainer.max_epochs={epochs}",
                 "logger=csv"]
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
    total, aleatoric, epistemic = (metrics[f"test/{k}"] for k in ("predictive_entropy", "expected_entropy", "mutual_information"))
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
        out / "checkpoints" / "last.ckpt", tmp_path_factory.mktemp("eval"),
        ["evaluations=[ood,adversarial]", "ood=[photos,noise]", "ood.photos.size=64", "ood.noise.size=32", "n_samples=3",
         "evaluations.adversarial.epsilons=[0.0,0.05,0.1]", "evaluations.adversarial.attack_samples=2", "evaluations.adversarial.eval_samples=2",
         "evaluations.adversarial.max_examples=40", "evaluations.adversarial.batch_size=20"],
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

    rows = _csv(folder / "adversarial" / "results.csv")
    assert [(r["attack"], float(r["epsilon"])) for r in rows] == [
        (a, e) for a in ("fgsm", "bim") for e in (0.0, 0.05, 0.1)]
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
        out / "checkpoints" / "last.ckpt", tmp_path,
        ["bn_recalibration.enabled=true", "bn_recalibration.images=64", "n_samples=4", "evaluations=[adversarial]",
         "evaluations.adversarial.epsilons=[0.0,0.1]", "evaluations.adversarial.attack_samples=2", "evaluations.adversarial.eval_samples=2",
         "evaluations.adversarial.max_examples=20", "output_dir=" + str(tmp_path / "recalibrated")],
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
    result = evaluate_quietly(sweep, tmp_path, ["evaluations=[ood]", "ood=noise", "ood.noise.size=32"])
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
    notebook_dir = Path(__file__).resolve().parents[1] / "notebooks"
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
