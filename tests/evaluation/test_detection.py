"""The OOD evaluation's post-hoc scores of a method (dbsn.evaluation.detection): each member fitted on
its own training features and the members' scores averaged, the mean-logit and per-member variants,
the scores a method cannot give left out with the reason, and bad settings refused in one line."""

from __future__ import annotations

import pytest
import torch

from dbsn.data.base import in_memory_loader
from dbsn.data.digits import DigitsDataModule
from dbsn.evaluation.base import EvaluationError
from dbsn.evaluation.detection import DetectionScores
from dbsn.evaluation.ood import OODDetection
from dbsn.methods import DBSN, MAP, SNGP, Prediction
from dbsn.metrics.ood_scores import KNN, Mahalanobis, energy
from tests.support.netutil import tiny_structure_net

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits():
    dm = DigitsDataModule(num_workers=0, train_subset=120, batch_size=40, eval_batch_size=50)
    dm.setup("fit")
    dm.setup("test")
    return dm


def _train_features(model, dm, n):
    logits, features, labels = [], [], []
    for images, targets in in_memory_loader(dm, dm.train_set, train=False):
        z, f = model.member_outputs(dm.preprocess(images), n)
        logits.append(z)
        features.append(f)
        labels.append(targets)
    return torch.cat(logits, 1), torch.cat(features, 1), torch.cat(labels)


def test_each_member_fits_on_its_own_features_and_the_scores_are_averaged(digits):
    torch.manual_seed(0)
    model = DBSN(tiny_structure_net(), dataset_size=120, prediction=Prediction(n_samples=3)).eval()
    scores = DetectionScores(scores=["energy", "mahalanobis", "knn"], members=2, knn_k=5)
    images = next(iter(digits.test_dataloader()))[0][:20]
    with torch.no_grad(), scores.holding(model):
        scores.fit(model, digits, CPU, show=False)
        found = scores.of(model, digits, [(images, None)], CPU, "test", show=False)
        _, train_features, labels = _train_features(model, digits, 2)  # the same held structures
        logits, features = model.member_outputs(digits.preprocess(images), 2)
    assert set(found) == {"energy", "energy_members", "mahalanobis", "knn"} == set(scores.names(2))
    torch.testing.assert_close(found["energy"], energy(logits.mean(0)))  # on the members' mean logits
    torch.testing.assert_close(found["energy_members"], (energy(logits[0]) + energy(logits[1])) / 2)
    for name, make in (("mahalanobis", lambda f: Mahalanobis().fit(f, labels, 10)), ("knn", lambda f: KNN(k=5).fit(f))):
        expected = sum(make(train_features[s]).score(features[s]).float() for s in range(2)) / 2
        torch.testing.assert_close(found[name], expected)
        one_member = make(train_features[0]).score(features[0]).float()
        assert not torch.allclose(found[name], one_member)  # both members count


def test_a_point_estimate_has_no_member_variants_and_sngp_no_vim(digits):
    torch.manual_seed(0)
    point = MAP(tiny_structure_net(), learn_structure=False, dataset_size=120).eval()
    assert DetectionScores().names(point.num_members) == ["max_logit", "energy", "mahalanobis", "knn", "vim", "odin"]
    sngp = SNGP(tiny_structure_net(), learn_structure=False, dataset_size=120).eval()
    scores = DetectionScores(scores=["max_logit", "vim"], fit_images=50)
    with torch.no_grad(), scores.holding(sngp):
        scores.fit(sngp, digits, CPU, show=False)
    assert "Gaussian process" in scores.notes["vim"] and scores.names(1) == ["max_logit"]
    assert scores.record(1)["left_out"] == {"vim": scores.notes["vim"]}


@pytest.mark.parametrize("settings, message", [
    ({"scores": ["energy", "gram"]}, "unknown detection score"),
    ({"members": 0}, "members must be >= 1"),
    ({"knn_k": 0}, "knn_k must be >= 1"),
    ({"odin": {"temperature": 1000, "noise": 0.1}}, "odin.noise is not a setting"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(EvaluationError, match=message) as caught:
        OODDetection(sets={}, **settings)
    assert "\n" not in str(caught.value)
