"""DDU's feature density as an OOD score (dbsn.evaluation.gda.GDAScore, conf/ood_score/gda.yaml): per member the
mean of each member's own fit, pooled one fit on the members' mean feature, bit for bit the pure
dbsn.metrics.ood_scores.GDA on the features the evaluation reads; left out with the reason where a class cannot
be fitted; a density below float32's range held at its largest score; built by the OOD evaluation's default
config."""

from __future__ import annotations

import torch

from dbsn.data.augment import normalize, to_unit_range
from dbsn.data.base import in_memory_loader
from dbsn.data.digits import DigitsDataModule
from dbsn.evaluation.detection import DetectionScores, Members
from dbsn.evaluation.gda import FLOAT32_MAX, GDAScore
from dbsn.methods import DBSN, DDU, Prediction
from dbsn.metrics.ood_scores import GDA
from dbsn.nets import ResNet18
from dbsn.runtime.evaluation import build_evaluator
from tests.support.configs import compose_config
from tests.support.netutil import tiny_structure_net

CPU = torch.device("cpu")


def _digits(train_subset: int = 200):
    dm = DigitsDataModule(num_workers=0, train_subset=train_subset, batch_size=50, eval_batch_size=50)
    dm.setup("fit")
    dm.setup("test")
    return dm


def _training_features(model, digits, n):
    features, labels = [], []
    for x, y in in_memory_loader(digits, digits.train_set, train=False):
        features.append(model.member_outputs(digits.preprocess(x), n)[1].float())
        labels.append(y)
    return torch.cat(features, 1), torch.cat(labels)


def _scores(model, digits, score, x, n):
    detection = DetectionScores({"gda": score}, members=n)
    with torch.no_grad(), detection.holding(model):
        detection.fit(model, digits, CPU, show=False)
        found = detection.of(model, digits, [(x, None)], CPU, "test", show=False)
        train, labels = _training_features(model, digits, n)
        features = model.member_outputs(normalize(to_unit_range(x), *digits.statistics_on(CPU)), n)[1].float()
    return detection, found, train, labels, features


def test_per_member_and_pooled_are_the_pure_fits_on_the_evaluations_features():
    digits = _digits()
    x = next(iter(digits.test_dataloader()))[0][:20]
    torch.manual_seed(0)
    dbsn = DBSN(
        tiny_structure_net(), dataset_size=200, prediction=Prediction(n_samples=3, samples_per_forward=3)
    ).eval()
    detection, found, train, labels, features = _scores(dbsn, digits, GDAScore("per_member"), x, 3)
    each = torch.stack([GDA().fit(train[s], labels, 10).score(features[s]) for s in range(3)]).mean(0)
    assert torch.equal(found["gda"], each.float()) and detection.notes == {}
    assert detection.computed_on(3)["gda"] == "mean over members"
    _, pooled, train, labels, features = _scores(dbsn, digits, GDAScore("pooled"), x, 3)
    assert torch.equal(pooled["gda"], GDA().fit(train.mean(0), labels, 10).score(features.mean(0)).float())
    torch.manual_seed(0)
    ddu = DDU(ResNet18(10, width=8), dataset_size=200).eval()  # one member: both ways are one number
    _, one, train, labels, features = _scores(ddu, digits, GDAScore("per_member"), x, 1)
    assert torch.equal(one["gda"], GDA().fit(train[0], labels, 10).score(features[0]).float())


def test_a_class_that_cannot_be_fitted_leaves_the_score_out_with_the_reason():
    digits = _digits(train_subset=20)  # two images of each class: the first 15 leave a class with one or none
    detection = DetectionScores({"gda": GDAScore("per_member")}, members=1, fit_images=15)
    torch.manual_seed(0)
    model = DDU(ResNet18(10, width=8), dataset_size=20).eval()
    with torch.no_grad(), detection.holding(model):
        detection.fit(model, digits, CPU, show=False)
    assert detection.names(1) == [] and "DDU's training features: classes" in detection.notes["gda"]
    assert detection.record(1)["left_out"] == {"gda": detection.notes["gda"]}


def test_a_density_below_float32s_range_is_held_at_the_largest_score():
    """A feature no training image ever activated (a dead ReLU channel): every class covariance needs the
    smallest jitter there, and a test image that activates it has density 0 in float64 (score inf); the
    evaluation's score is float32's largest instead, so that it ranks last and stays finite."""
    g = torch.Generator().manual_seed(0)
    train = torch.cat([torch.randn(20, 3, generator=g), torch.randn(20, 3, generator=g) + 3])
    train[:, 0] = 0.0
    labels = torch.arange(2).repeat_interleave(20)
    score = GDAScore("per_member")
    score._fitted = [GDA().fit(train, labels, 2)]
    features = torch.tensor([[[3.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.2, -0.3]]])  # (1 member, 3 images, D)
    assert score._fitted[0].jitter == torch.finfo(torch.float64).tiny
    exact = score._fitted[0].score(features[0])
    assert exact[0] == torch.inf and FLOAT32_MAX < exact[1] < torch.inf  # beyond float64, beyond float32
    members = Members(1, torch.zeros(3, 3, 4, 4), None, features, lambda x, k, first: None, 1)
    found = score.score(members)
    assert found[:2].tolist() == [FLOAT32_MAX, FLOAT32_MAX] and torch.isfinite(found.float()).all()
    assert found[2] == exact[2]


def test_the_ood_evaluation_builds_it_by_default_after_mahalanobis(tmp_path):
    cfg = compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=noise"], tmp_path)
    detection = build_evaluator(cfg).evaluations[0].detection
    assert list(detection.scores) == ["max_logit", "energy", "mahalanobis", "gda", "knn", "vim", "odin"]
    assert type(detection.scores["gda"]) is GDAScore and detection.scores["gda"].params() == {"members": "per_member"}
    cfg = compose_config(
        "evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=noise", "ood_score.gda.members=pooled"], tmp_path
    )
    assert build_evaluator(cfg).evaluations[0].detection.scores["gda"].members == "pooled"
