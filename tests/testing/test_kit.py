"""dbsn.testing passes dbsn's own extensions and the examples of docs/extending.md, and fails a broken one."""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest

from dbsn.evaluation.detection import EnergyScore, KNNScore, MahalanobisScore, MaxLogitScore, ODINScore, ViMScore
from dbsn.methods import DBSN, MAP, DeepEnsemble, Prediction
from dbsn.posthoc.calibrators import (
    Calibrator,
    DirichletCalibration,
    HistogramBinning,
    IsotonicCalibration,
    TemperatureScaling,
)
from dbsn.testing import check_calibrator, check_evaluation, check_method, check_ood_score, make_subject, tiny_net
from tests.docs.test_extending import page_files


@pytest.fixture(scope="module")
def myext(tmp_path_factory):
    """The package of docs/extending.md, importable."""
    where = tmp_path_factory.mktemp("page")
    for path, text in page_files().items():
        if path.endswith(".py"):
            (where / path).parent.mkdir(parents=True, exist_ok=True)
            (where / path).write_text(text)
    (where / "myext" / "__init__.py").touch()
    sys.path.insert(0, str(where))
    yield lambda module: importlib.import_module(f"myext.{module}")
    sys.path.remove(str(where))
    for name in [m for m in sys.modules if m == "myext" or m.startswith("myext.")]:
        del sys.modules[name]


def test_the_page_s_extensions_pass_the_kit(myext):
    assert check_method(
        myext("random_structures").RandomStructures, train_samples=2, prediction=Prediction(n_samples=3)
    )["features"]
    check_ood_score(myext("class_cosine").ClassCosine())
    check_calibrator(myext("label_prior").LabelPrior())
    results = check_evaluation(myext("misclassification").Misclassification())
    assert 0 <= results.metrics["misclassification/predictive_entropy/auroc"] <= 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: MAP(tiny_net(), learn_structure=False, dataset_size=10),
        lambda: DBSN(tiny_net(), dataset_size=10, prediction=Prediction(n_samples=3)),
        lambda: DeepEnsemble([MAP(tiny_net(), learn_structure=False, dataset_size=10) for _ in range(2)]),
    ],
    ids=["map_fixed", "dbsn", "deep_ensemble"],
)
def test_dbsn_s_methods_pass(make):
    assert check_method(make())["members"]


@pytest.mark.parametrize(
    "score",
    [
        MaxLogitScore("mean_logits"),
        EnergyScore("per_member", 1.0),
        MahalanobisScore("pooled"),
        KNNScore("per_member", 5),
        ViMScore("per_member", 4),
        ODINScore("predictive", 1000.0, 0.0014),
    ],
    ids=lambda s: type(s).__name__,
)
def test_dbsn_s_ood_scores_pass_in_every_treatment(score):
    assert set(check_ood_score(score)) == set(score.treatments)


@pytest.mark.parametrize(
    "calibrator",
    [TemperatureScaling(), HistogramBinning(), IsotonicCalibration(), DirichletCalibration()],
    ids=lambda c: c.name,
)
def test_dbsn_s_calibrators_pass(calibrator):
    check_calibrator(calibrator)


class Unnormalised(Calibrator):
    name = "unnormalised"

    def fit_map(self, log_probs, targets):
        pass

    def transform(self, log_probs):
        return log_probs + 1.0


class BatchDependent(MaxLogitScore):
    def of_logits(self, logits):
        return logits.amax(-1) - logits.amax(-1).mean()


def test_the_kit_fails_a_broken_extension():
    with pytest.raises(AssertionError, match="sum to 1"):
        check_calibrator(Unnormalised())
    with pytest.raises(AssertionError, match="batched"):
        check_ood_score(BatchDependent("mean_logits"))

    class Unheld(DBSN):  # draws its structures afresh at every call, and does not hold them
        def fixed_members(self, n):
            return contextlib.nullcontext()

    with pytest.raises(AssertionError, match="fixed_members"):
        check_method(Unheld, prediction=Prediction(n_samples=3))


def test_the_subject_holds_a_test_pass_as_evaluate_records_one():
    subject = make_subject(n=50)
    assert subject.test_pass.log_probs.shape == (50, 10) and set(subject.test_pass.scores) >= {"mutual_information"}
