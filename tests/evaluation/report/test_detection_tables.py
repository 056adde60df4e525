"""The report's tables of the detection scores by method (ood_scores.md) and of the post-hoc
calibrators beside each method (calibrators.md), from hand-made run folders with known numbers."""

from __future__ import annotations

import json

import pytest
import yaml

from dbsn.evaluation.report import build_report
from dbsn.evaluation.report.sections.ood import score_order
from tests.support.fakeruns import DATA, MODELS, write_run


def _ood(folder, ood_set, scores):
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(
        json.dumps({"in_distribution": "cifar10", "ood": ood_set, "n_samples": 10, "scores": scores})
    )


def _scores(**auroc):
    return {
        name: {"auroc": value, "aupr": value, "aupr_in": value, "fpr95": 1 - value} for name, value in auroc.items()
    }


def test_scores_by_method_one_column_per_score_groups_first(tmp_path):
    runs = tmp_path / "runs"
    for seed, shift in ((1, 0.0), (2, 0.02)):
        run = write_run(runs / f"dbsn_{seed}", MODELS["dbsn"], DATA["cifar10"], seed, 0.05)
        _ood(
            run / "evaluation" / "ood" / "svhn",
            "svhn",
            _scores(entropy=0.90 + shift, energy=0.80 + shift, energy_members=0.85, knn=0.95, odin=0.70, gram=0.60),
        )
        (run / "evaluation" / "ood" / "groups.json").write_text(
            json.dumps(
                {
                    "groups": {"far": ["svhn"]},
                    "metrics": {
                        "ood/far/entropy/auroc": 0.90 + shift,
                        "ood/far/knn/auroc": 0.95,
                        "ood/far/knn/fpr95": 0.05,
                    },
                }
            )
        )
    run = write_run(runs / "map_1", MODELS["map"], DATA["cifar10"], 1, 0.08)
    _ood(run / "evaluation" / "ood" / "svhn", "svhn", _scores(entropy=0.80, energy=0.82, knn=0.90, vim=0.88))

    build_report([runs], tmp_path / "report")
    text = (tmp_path / "report" / "ood_scores.md").read_text()
    assert text.index("cifar10 vs far (group mean)") < text.index("cifar10 vs svhn")  # groups first
    svhn = text.split("### cifar10 vs svhn: AUROC (%) ↑", 1)[1].split("###", 1)[0]
    # columns in the order the records list them, only the scores some method has, a new one (gram) too
    assert "| method | entropy | energy | energy_members | knn | vim | odin | gram |" in svhn
    assert "| dbsn | 91.0 ± 1.4 | 81.0 ± 1.4 | 85.0 ± 0.0 | 95.0 ± 0.0 | – | 70.0 ± 0.0 | 60.0 ± 0.0 |" in svhn
    assert "| map | 80.0 | 82.0 | – | 90.0 | 88.0 | – | – |" in svhn
    fpr = text.split("### cifar10 vs svhn: FPR95 (%) ↓", 1)[1].split("###", 1)[0]
    assert "| map | 20.0 | 18.0 | – | 10.0 | 12.0 | – | – |" in fpr
    assert "## OOD detection by score and method" in (tmp_path / "report" / "report.md").read_text()


def test_the_score_columns_merge_the_records_orders():
    """A one-member method's record has no `_members` variants, an SNGP's no ViM: each lands where
    the evaluation that has it puts it, whichever record is read first."""
    multi = [
        "entropy",
        "max_logit",
        "max_logit_members",
        "energy",
        "energy_members",
        "knn",
        "vim",
        "odin",
        "odin_members",
    ]
    for listed in ([["entropy", "max_logit", "energy", "knn", "odin"], multi], [multi, ["entropy", "energy", "knn"]]):
        assert score_order(listed) == multi


def _posthoc(run, name, nll, ece, error, calibrator=True):
    """`<run>/posthoc/<name>/` as evaluate.py writes it; `calibrator`: its metrics.json names the
    calibrator (the last part of `name`), as a calibrator's does, and not a posterior's (Laplace)."""
    folder = run / "posthoc" / name
    config = yaml.safe_load((run / "resolved_config.yaml").read_text())
    folder.mkdir(parents=True)
    (folder / "resolved_config.yaml").write_text(yaml.safe_dump({**config, "posthoc": name}))
    facts = {"calibrator": name.split("+")[-1]} if calibrator else {"posterior": name}
    (folder / "metrics.json").write_text(
        json.dumps(
            {
                "metrics": {"test/nll": nll, "test/ece": ece, "test/error": error},
                "seed": config["seed"],
                "posthoc": name,
                **facts,
            }
        )
    )


def test_calibrators_side_by_side_per_method(tmp_path):
    runs = tmp_path / "runs"
    for seed in (1, 2):
        run = write_run(runs / f"dbsn_{seed}", MODELS["dbsn"], DATA["cifar10"], seed, 0.05)  # nll 0.5
        _posthoc(run, "temperature", 0.40, 0.01, 0.05)
        _posthoc(run, "isotonic", 0.42 + 0.02 * seed, 0.02, 0.06)
    run = write_run(runs / "map_1", MODELS["map"], DATA["cifar10"], 1, 0.08)
    _posthoc(run, "dirichlet", 0.60, 0.03, 0.09)
    _posthoc(run, "laplace", 0.70, 0.04, 0.08, calibrator=False)  # a posterior: a row of its own, uncalibrated
    _posthoc(run, "laplace+uniform_mixing", 0.65, 0.02, 0.08)  # any calibrator the runs name, on top of it
    write_run(
        runs / "fbn_1",
        {"_target_": "dbsn.methods.DBSN", "weights": {"_target_": "dbsn.methods.weights.GaussianWeights"}},
        DATA["cifar10"],
        1,
        0.04,
    )  # no calibrator: not a row

    build_report([runs], tmp_path / "report")
    text = (tmp_path / "report" / "calibrators.md").read_text()
    nll = text.split("### cifar10: test NLL ↓", 1)[1].split("###", 1)[0]
    assert "| method | none | dirichlet | isotonic | temperature | uniform_mixing |" in nll
    assert "| dbsn | 0.5000 ± 0.0000 (2) | – | 0.4500 ± 0.0141 (2) | 0.4000 ± 0.0000 (2) | – |" in nll
    assert "| map | 0.8000 (1) | 0.6000 (1) | – | – | – |" in nll
    assert "| map+laplace | 0.7000 (1) | – | – | – | 0.6500 (1) |" in nll
    assert "fbn" not in nll
    error = text.split("### cifar10: test error", 1)[1].split("###", 1)[0]
    assert "| map | 8.00 (1) | 9.00 (1) | – | – | – |" in error
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Post-hoc calibrators" in report


def test_a_temperature_run_that_names_no_calibrator_is_still_one(tmp_path):
    """posthoc=temperature folders written before temperature scaling recorded its calibrator facts."""
    runs = tmp_path / "runs"
    run = write_run(runs / "map_1", MODELS["map"], DATA["cifar10"], 1, 0.08)
    _posthoc(run, "temperature", 0.40, 0.01, 0.08, calibrator=False)
    (run / "posthoc" / "temperature" / "metrics.json").write_text(
        json.dumps(
            {"metrics": {"test/nll": 0.40, "test/ece": 0.01, "test/error": 0.08}, "seed": 1, "posthoc": "temperature"}
        )
    )
    build_report([runs], tmp_path / "report")
    nll = (tmp_path / "report" / "calibrators.md").read_text().split("### cifar10: test NLL ↓", 1)[1].split("###", 1)[0]
    assert "| method | none | temperature |" in nll and "| map | 0.8000 (1) | 0.4000 (1) |" in nll


@pytest.mark.parametrize("section", ["## OOD detection by score and method", "## Post-hoc calibrators"])
def test_sections_absent_without_their_evaluations(tmp_path, section):
    runs = tmp_path / "runs"
    write_run(runs / "dbsn_1", MODELS["dbsn"], DATA["cifar10"], 1, 0.05)
    build_report([runs], tmp_path / "report")
    assert section not in (tmp_path / "report" / "report.md").read_text()


def _conformal(run, metrics):
    folder = run / "evaluation" / "conformal"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"metrics": metrics}))
    (folder / "summary.json").write_text(json.dumps({"evaluation": "conformal", "metrics": metrics}))


def test_conformal_table_per_level_one_row_per_method_and_score(tmp_path):
    runs = tmp_path / "runs"
    for seed, coverage in ((1, 0.90), (2, 0.92)):
        run = write_run(runs / f"dbsn_{seed}", MODELS["dbsn"], DATA["cifar10"], seed, 0.05)
        _conformal(
            run,
            {
                "conformal/90/thr/coverage": coverage,
                "conformal/90/thr/size": 1.5,
                "conformal/90/aps/coverage": 0.95,
                "conformal/90/aps/size": 2.5,
                "conformal/90/aps/ssc": 0.8,
                "conformal/90/aps/shift/coverage": 0.7,
                "conformal/90/aps/shift/2/coverage": 0.75,
                "conformal/95/thr/coverage": 0.96,
            },
        )
    build_report([runs], tmp_path / "report")
    text = (tmp_path / "report" / "conformal.md").read_text()
    at90 = text.split("### cifar10, nominal coverage 90 %", 1)[1].split("###", 1)[0]
    assert "| method | score | coverage | mean size ↓ | size-stratified coverage ↑ | coverage under shift |" in at90
    assert at90.index("| dbsn | thr |") < at90.index("| dbsn | aps |")  # the canonical order of the scores
    assert "| dbsn | thr | 0.910 ± 0.014 | 1.50 ± 0.00 | – | – |" in at90
    assert "| dbsn | aps | 0.950 ± 0.000 | 2.50 ± 0.00 | 0.800 ± 0.000 | 0.700 ± 0.000 |" in at90
    assert "| dbsn | thr | 0.960 ± 0.000 |" in text.split("nominal coverage 95 %", 1)[1]
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Conformal prediction sets" in report
    assert "evaluation_conformal" not in report  # its own section, not the generic one
