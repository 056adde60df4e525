"""What goes to W&B under which definitions (`dbsn.evaluation.tracking`), the entropy-CDF points logged as
a table, the attack curve's rows, and several OOD sets composed from the config group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from configs import compose_config

from dbsn.evaluation.adversarial import adversarial_curve
from dbsn.evaluation.ood import cdf_points
from dbsn.runtime.config import ConfigError
from dbsn.runtime.evaluation import build_evaluator
from dbsn.evaluation.tracking import define_metrics, step_metric_of, summary_key, summary_of


@pytest.mark.parametrize("name, summary", [
    ("val/error", "min"), ("test/nll", "min"), ("test/ece", "min"), ("test/brier", "min"),
    ("ood/svhn/entropy/fpr95", "min"), ("ood/svhn/entropy/auroc", "max"), ("ood/photos/mutual_information/aupr", "max"),
    ("test/miou", "max"), ("val/global_acc", "max"), ("test/iou/sky", "max"),
    ("train/error_step", None), ("ablation/error", None), ("test/mutual_information", None), ("structure/tau", None),
    ("adversarial/fgsm/accuracy", None),
])
def test_summaries_are_the_best_value_where_there_is_one(name, summary):
    assert summary_of(name) == summary
    assert summary_key(name) == (f"{name}.{summary}" if summary else name)


def test_per_epoch_metrics_are_drawn_against_the_epoch():
    assert [step_metric_of(n) for n in ("val/nll", "structure/edge_entropy_mean", "posterior/snr_median",
                                        "train/loss_epoch", "train/loss_step", "test/error")] == [
        "epoch", "epoch", "epoch", "epoch", None, None]


def test_each_metric_is_defined_once_by_its_exact_name():
    calls = []

    class Run:
        def define_metric(self, name, step_metric=None, summary=None):
            calls.append((name, step_metric, summary))

    defined: set[str] = set()
    define_metrics(Run(), ["val/error", "epoch", "trainer/global_step", "train/loss_step", "test/miou"], defined)
    define_metrics(Run(), ["val/error", "ood/a/entropy/auroc"], defined)
    assert calls == [("val/error", "epoch", "min"), ("test/miou", None, "max"), ("ood/a/entropy/auroc", None, "max")]
    calls.clear()  # a logger with a prefix logs `<prefix>-<name>`, the epoch included
    define_metrics(Run(), ["val/nll", "test/ece"], set(), prefix="p")
    assert calls == [("p-val/nll", "p-epoch", "min"), ("p-test/ece", None, "min")]


def test_cdf_points_are_the_empirical_cdf():
    values = torch.tensor([0.3, 0.1, 0.1, 0.7, 0.5, 0.5, 0.5, 0.9, 0.2, 0.4])
    points = cdf_points(values)
    assert [x for x, _ in points] == sorted(values.tolist())  # 10 values <= 101 points: every one
    for x, f in points:
        assert f == pytest.approx(float((values <= x).double().mean()))  # ties counted
    many = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    sub = cdf_points(many)
    assert len(sub) == 101 and sub[-1] == [float(many.max()), 1.0] and sub[0][0] == float(many.min())
    ordered = np.sort(many.numpy())
    for x, f in sub:
        assert f == pytest.approx(np.searchsorted(ordered, x, side="right") / len(ordered))


def test_attack_rows_become_one_point_per_epsilon():
    rows = [{"attack": a, "epsilon": e, "accuracy": acc, "mean_entropy": h}
            for a, e, acc, h in [("fgsm", 0.1, 0.5, 1.0), ("fgsm", 0.0, 0.9, 0.2), ("bim", 0.0, 0.9, 0.2),
                                 ("bim", 0.1, 0.3, 1.2)]]
    assert adversarial_curve(rows) == [
        {"adversarial/epsilon": 0.0, "adversarial/fgsm/accuracy": 0.9, "adversarial/fgsm/mean_entropy": 0.2,
         "adversarial/bim/accuracy": 0.9, "adversarial/bim/mean_entropy": 0.2},
        {"adversarial/epsilon": 0.1, "adversarial/fgsm/accuracy": 0.5, "adversarial/fgsm/mean_entropy": 1.0,
         "adversarial/bim/accuracy": 0.3, "adversarial/bim/mean_entropy": 1.2}]


def _ood_sets(cfg):
    return build_evaluator(cfg).evaluations[0].sets


def test_one_or_several_ood_sets_compose_by_name(tmp_path):
    one = compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=photos"], tmp_path)
    assert list(one.ood) == ["photos"] and list(_ood_sets(one)) == ["photos"]
    several = compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=[svhn,photos,noise]", "ood.noise.size=8"],
                             tmp_path)
    sets = _ood_sets(several)
    assert list(sets) == ["svhn", "photos", "noise"] and sets["noise"].size == 8
    assert type(sets["svhn"]).__name__ == "SVHNDataModule"
    with pytest.raises(ConfigError, match=r"add evaluations=\[ood\]"):  # sets chosen, the evaluation not
        build_evaluator(compose_config("evaluate", ["ckpt_path=x", "ood=photos"], tmp_path))
    with pytest.raises(ConfigError, match=r"ood.noise: size must be >= 1, got 0"):  # a set's own check, named by its key
        build_evaluator(compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=noise", "ood.noise.size=0"],
                                       tmp_path))
