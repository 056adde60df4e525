"""The OOD evaluation's post-hoc scores of a method (dbsn.evaluation.detection): every score exactly
as the pure functions of dbsn.metrics.ood_scores give it (the numbers of the code before the score
classes), the mean-logit / per-member variants, the pooled treatment of the feature scores, the
scores a method cannot give left out with the reason, a score of the user's own package chosen by
config, and bad settings refused in one line."""

from __future__ import annotations

import re
import textwrap
from contextlib import contextmanager

import pytest
import torch

from dbsn.data.augment import normalize, to_unit_range
from dbsn.data.base import in_memory_loader
from dbsn.data.digits import DigitsDataModule
from dbsn.evaluation.base import EvaluationError
from dbsn.evaluation.detection import (
    DetectionScores,
    EnergyScore,
    KNNScore,
    MahalanobisScore,
    MaxLogitScore,
    ODINScore,
    ViMScore,
)
from dbsn.evaluation.ood import OODDetection, detection_metrics
from dbsn.methods import DBSN, MAP, SNGP, Prediction
from dbsn.metrics.ood_scores import KNN, Mahalanobis, ViM, energy, max_logit, odin
from dbsn.runtime.cli import renamed_option
from dbsn.runtime.config import ConfigError
from dbsn.runtime.evaluation import build_evaluator
from tests.support.configs import compose_config
from tests.support.netutil import tiny_structure_net

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits():
    dm = DigitsDataModule(num_workers=0, train_subset=120, batch_size=40, eval_batch_size=50)
    dm.setup("fit")
    dm.setup("test")
    return dm


@pytest.fixture(scope="module")
def images(digits):
    """24 digits (in-distribution) and 24 images of uniform noise (OOD), uint8."""
    noise = torch.randint(0, 256, (24, 3, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    return next(iter(digits.test_dataloader()))[0][:24], noise


def _dbsn():
    torch.manual_seed(0)
    return DBSN(
        tiny_structure_net(), dataset_size=120, prediction=Prediction(n_samples=3, samples_per_forward=2)
    ).eval()


def _map():
    torch.manual_seed(0)
    return MAP(tiny_structure_net(), learn_structure=False, dataset_size=120).eval()


def _every_score(**members):
    """OpenOOD's six as conf/ood_score/ builds them (KNN's k and ODIN's step made to fit 120 images)."""
    return {
        "max_logit": MaxLogitScore("mean_logits"),
        "energy": EnergyScore("mean_logits", 1.0),
        "mahalanobis": MahalanobisScore(members.get("features", "per_member")),
        "knn": KNNScore(members.get("features", "per_member"), 5),
        "vim": ViMScore(members.get("features", "per_member"), None),
        "odin": ODINScore("predictive", 1000.0, 0.01),
    }


@contextmanager
def _fitted(model, digits, scores, members=3):
    """`DetectionScores(scores)` fitted, inside its `holding` (DBSN's members fixed until the end)."""
    detection = DetectionScores(scores, members=members)
    with torch.no_grad(), detection.holding(model):
        detection.fit(model, digits, CPU, show=False)
        yield detection


def _of(detection, model, digits, images):
    """{"in": {name: scores}, "out": {...}} of the digits and the noise."""
    return {
        label: detection.of(model, digits, [(x, None)], CPU, label, show=False)
        for label, x in zip(("in", "out"), images)
    }


def _outputs(model, digits, x, n):
    """Logits and features (n, b, ...) of the members on uint8 images x, as the evaluation normalises them."""
    return model.member_outputs(normalize(to_unit_range(x), *digits.statistics_on(CPU)), n)


def _training(model, digits, n):
    features, labels = [], []
    for x, y in in_memory_loader(digits, digits.train_set, train=False):
        features.append(model.member_outputs(digits.preprocess(x), n)[1].float())
        labels.append(y)
    return torch.cat(features, 1), torch.cat(labels)


def _by_the_pure_functions(model, digits, x, n) -> dict[str, torch.Tensor]:
    """Every score of images x as the code before the score classes computed it from the pure functions."""
    logits, features = (t.float() for t in _outputs(model, digits, x, n))
    train, labels = _training(model, digits, n)
    heads = model.member_heads(n)
    fitted = {
        "mahalanobis": [Mahalanobis().fit(train[s], labels, 10) for s in range(n)],
        "knn": [KNN(k=5).fit(train[s]) for s in range(n)],
        "vim": [ViM().fit(train[s], w.float(), b.float()) for s, (w, b) in enumerate(heads)],
    }
    mean, std = (t.clone() for t in digits.statistics_on(CPU))

    def member_logits(x_unit, count, first):
        return model.stochastic_forward(normalize(x_unit, mean, std), count, first)

    x_unit = to_unit_range(x)
    found = {}
    for name, fn in (("max_logit", max_logit), ("energy", energy)):
        found[name] = fn(logits.mean(0))
        if n > 1:
            found[f"{name}_members"] = torch.stack([fn(z) for z in logits]).mean(0)
    for name, per_member in fitted.items():
        found[name] = torch.stack([f.score(features[s]) for s, f in enumerate(per_member)]).mean(0).float()
    for on, name in (("predictive", "odin"), ("members", "odin_members")):
        if n > 1 or on == "predictive":
            found[name] = odin(
                member_logits, x_unit, n, temperature=1000.0, epsilon=0.01, on=on, chunk=model.samples_per_forward
            )
    return found


@pytest.mark.parametrize("make, n", [(_dbsn, 3), (_map, 1)], ids=["dbsn-3-members", "one-network"])
def test_every_score_and_its_auroc_are_the_pure_functions(digits, images, make, n):
    """The numbers before the score classes: each score of the evaluation is the pure function's,
    bit for bit, and so is its AUROC of digits against noise."""
    model = make()
    with _fitted(model, digits, _every_score()) as detection:
        found = _of(detection, model, digits, images)
        expected = {label: _by_the_pure_functions(model, digits, x, n) for label, x in zip(("in", "out"), images)}
    names = [
        "max_logit",
        "max_logit_members",
        "energy",
        "energy_members",
        "mahalanobis",
        "knn",
        "vim",
        "odin",
        "odin_members",
    ]
    assert (
        detection.names(n)
        == list(found["in"])
        == list(expected["in"])
        == [m for m in names if n > 1 or not m.endswith("_members")]
    )
    for name in detection.names(n):
        for label in ("in", "out"):
            assert torch.equal(found[label][name], expected[label][name].float()), (name, label)
        auroc = detection_metrics(found["in"][name], found["out"][name])["auroc"]
        assert auroc == detection_metrics(expected["in"][name], expected["out"][name])["auroc"], name
    assert detection.computed_on(n)["knn"] == "mean over members"
    assert detection.computed_on(n)["max_logit"] == "members' mean logits"


def test_pooled_fits_once_on_the_members_mean_feature_and_head(digits, images):
    model = _dbsn()
    with _fitted(model, digits, _every_score(features="pooled")) as detection:
        found = _of(detection, model, digits, images)
        logits, features = (t.float() for t in _outputs(model, digits, images[1], 3))
        train, labels = _training(model, digits, 3)
        heads = model.member_heads(3)
    # DBSN's structures share one classifier: the mean feature is the feature of the mean logits
    (w, b), *_ = heads
    torch.testing.assert_close(features.mean(0) @ w.T + b, logits.mean(0), rtol=1e-5, atol=1e-5)
    # the pooled fit reads the members' mean head: the mean of S equal heads is the head only up to
    # rounding (ViM's score moves by an ulp on some CPUs), so it is that mean here too
    w, b = (torch.stack(p).mean(0) for p in zip(*heads))
    pooled, query = train.mean(0), features.mean(0)
    expected = {
        "mahalanobis": Mahalanobis().fit(pooled, labels, 10).score(query),
        "knn": KNN(k=5).fit(pooled).score(query),
        "vim": ViM().fit(pooled, w, b).score(query),
    }
    for name, value in expected.items():
        assert torch.equal(found["out"][name], value.float()), name
        assert detection.computed_on(3)[name].startswith("members' mean feature")
    # one network: pooled and per member are the same number
    one = _map()
    with _fitted(one, digits, _every_score(features="pooled")) as pooled:
        alone = _of(pooled, one, digits, images)
    with _fitted(one, digits, _every_score()) as per_member:
        each = _of(per_member, one, digits, images)
    for name in ("mahalanobis", "knn", "vim"):
        assert torch.equal(alone["out"][name], each["out"][name]), name


def test_the_variant_comes_with_several_members_only_and_not_twice():
    detection = DetectionScores(
        {
            "energy": EnergyScore("per_member", 2.0),
            "odin": ODINScore("predictive", 10.0, 0.0),
            "knn": KNNScore("pooled", 3),
        }
    )
    assert detection.names(1) == ["energy", "odin", "knn"]
    assert detection.names(4) == ["energy", "odin", "odin_members", "knn"]  # energy is already per member
    variant = detection.outputs(4)["odin_members"]
    assert (variant.members, variant.temperature, variant.epsilon) == ("per_member", 10.0, 0.0)
    assert detection.record(4)["scores"]["knn"] == {
        "class": "dbsn.evaluation.detection.KNNScore",
        "members": "pooled",
        "k": 3,
    }


def test_a_point_estimate_has_no_member_variants_and_sngp_no_vim(digits):
    point = _map()
    detection = DetectionScores(_every_score())
    assert detection.names(point.num_members) == ["max_logit", "energy", "mahalanobis", "knn", "vim", "odin"]
    sngp = SNGP(tiny_structure_net(), learn_structure=False, dataset_size=120).eval()
    scores = DetectionScores(
        {"max_logit": MaxLogitScore("mean_logits"), "vim": ViMScore("per_member", None)}, fit_images=50
    )
    with torch.no_grad(), scores.holding(sngp):
        scores.fit(sngp, digits, CPU, show=False)
    assert "Gaussian process" in scores.notes["vim"] and scores.names(1) == ["max_logit"]
    assert scores.record(1)["left_out"] == {"vim": scores.notes["vim"]}


# ---------------------------------------------------------------------------- chosen by config
def _evaluation(tmp_path, *overrides):
    cfg = compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=noise", *overrides], tmp_path)
    return build_evaluator(cfg).evaluations[0].detection


def test_the_configs_build_openood_s_six_and_scores_chooses_among_them(tmp_path):
    detection = _evaluation(tmp_path)
    assert {name: score.params() for name, score in detection.scores.items()} == {
        "max_logit": {"members": "mean_logits"},
        "energy": {"members": "mean_logits", "temperature": 1.0},
        "mahalanobis": {"members": "per_member"},
        "gda": {"members": "per_member"},
        "knn": {"members": "per_member", "k": 50},
        "vim": {"members": "per_member", "dim": None},
        "odin": {"members": "predictive", "temperature": 1000.0, "epsilon": 0.0014, "batch_size": 16},
    }
    chosen = _evaluation(tmp_path, "evaluations.ood.scores=[energy,knn]", "ood_score.knn.k=20")
    assert chosen.names(3) == ["energy", "energy_members", "knn"] and chosen.scores["knn"].k == 20
    assert _evaluation(tmp_path, "ood_score=[vim]", "ood_score.vim.members=pooled").scores["vim"].members == "pooled"
    assert _evaluation(tmp_path, "evaluations.ood.scores=[]").names(3) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("evaluations.ood.knn_k=20", "ood_score.knn.k=20"),
        ("evaluations.ood.vim_dim=8", "ood_score.vim.dim=8"),
        ("evaluations.ood.energy_temperature=2", "ood_score.energy.temperature=2"),
        ("evaluations.ood.odin.epsilon=0", "ood_score.odin.epsilon=0"),
    ],
)
def test_the_old_keys_are_answered_with_the_new_one(tmp_path, old, new):
    assert renamed_option([old]).endswith(f"use {new}")
    key, value = new.split("=")
    settings = _evaluation(tmp_path, new).scores[key.split(".")[1]].params()
    assert settings[key.split(".")[2]] == pytest.approx(float(value))


MY_SCORE = '''
from dbsn.evaluation.detection import OODScore


class Margin(OODScore):
    """The gap between the two largest mean logits, negated: a small gap is OOD."""

    treatments = {"mean_logits": "members' mean logits", "per_member": "mean over members"}
    variant = "per_member"

    def score(self, members):
        logits = members.logits.mean(0, keepdim=True) if self.members == "mean_logits" else members.logits
        top = logits.topk(2, dim=-1).values
        return (top[..., 1] - top[..., 0]).mean(0)
'''


def test_a_score_of_the_user_s_own_package_is_chosen_by_config(tmp_path, monkeypatch, digits, images):
    package = tmp_path / "user"
    (package / "conf" / "ood_score").mkdir(parents=True)
    (package / "my_scores.py").write_text(MY_SCORE)
    (package / "conf" / "ood_score" / "margin.yaml").write_text(
        textwrap.dedent("""\
        margin:
          _target_: my_scores.Margin
          members: mean_logits
        """)
    )
    monkeypatch.syspath_prepend(str(package))
    detection = _evaluation(tmp_path, f"hydra.searchpath=[file://{package / 'conf'}]", "ood_score=[energy,margin]")
    assert list(detection.scores) == ["energy", "margin"] and type(detection.scores["margin"]).__name__ == "Margin"
    model = _dbsn()
    with _fitted(model, digits, detection.scores) as fitted:
        found = _of(fitted, model, digits, images)
        logits, _ = _outputs(model, digits, images[1], 3)
    assert list(found["out"]) == ["energy", "energy_members", "margin", "margin_members"]
    top = logits.float().mean(0).topk(2).values
    assert torch.equal(found["out"]["margin"], top[:, 1] - top[:, 0])


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"available": {"energy": EnergyScore("mean_logits", 1.0)}, "scores": ["energy", "gram"]},
            "evaluations.ood.scores names ['gram'], which ood_score=[...] does not choose",
        ),
        ({"members": 0}, "members must be >= 1"),
        (
            {"available": {"gram": "not a score"}},
            "ood_score.gram builds a str, not a dbsn.evaluation.detection.OODScore",
        ),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(EvaluationError, match=re.escape(message)) as caught:
        OODDetection(sets={}, **settings)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("ood_score.knn.k=0", "ood_score.knn: k must be >= 1, got 0"),
        ("ood_score.knn.members=mean", "ood_score.knn: members='mean': KNNScore takes per_member or pooled"),
        ("+ood_score.odin.noise=0.1", "ood_score.odin: unknown key 'noise'"),
        ("ood_score.energy.temperature=0", "ood_score.energy: temperature must be positive"),
    ],
)
def test_a_bad_score_setting_is_refused_naming_its_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as caught:
        _evaluation(tmp_path, override)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("batch_size", [1, 5])
def test_odin_does_not_depend_on_its_batch_size(digits, images, batch_size):
    """Each image's input step is its own: ODIN's gradients in batches of any size give the same scores."""
    model = _dbsn()
    odin_of = {}
    for size in (batch_size, 24):
        torch.manual_seed(0)  # the same structures held in both
        with _fitted(model, digits, {"odin": ODINScore("predictive", 1000.0, 0.01, batch_size=size)}) as detection:
            odin_of[size] = _of(detection, model, digits, images)
    for label in ("in", "out"):
        for name in ("odin", "odin_members"):
            torch.testing.assert_close(odin_of[batch_size][label][name], odin_of[24][label][name], rtol=1e-6, atol=1e-7)
