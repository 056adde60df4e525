"""The near / far OOD groups (dbsn.evaluation.ood_groups): means over the evaluated sets, the
OpenOOD v1.5 groups and the configs that select their six sets.
"""

import warnings

import pytest
from hydra.utils import instantiate

from dbsn.evaluation.ood_groups import OOD_GROUPS, group_coverage, group_means, openood_groups, per_set_metrics
from tests.support.configs import compose_config


@pytest.mark.parametrize("in_distribution", ["cifar10", "cifar100"])
def test_openood_group_configs_select_the_six_sets(tmp_path, in_distribution):
    cfg = compose_config(
        "evaluate", ["ckpt_path=x", f"ood=[openood_{in_distribution},noise]", "ood.places365.size=7"], tmp_path
    )
    groups = OOD_GROUPS[in_distribution]
    assert list(cfg.ood) == [*groups["near"], *groups["far"], "noise"]
    sets = {name: instantiate(node) for name, node in cfg.ood.items()}
    assert sets["places365"].size == 7
    assert type(sets["cifar10" if in_distribution == "cifar100" else "cifar100"]).__name__.startswith("CIFAR")


def scores(auroc: float, fpr95: float) -> dict:
    return {
        "entropy": {"auroc": auroc, "fpr95": fpr95},
        "max_probability": {"auroc": auroc - 0.1, "fpr95": fpr95 + 0.1},
    }


def test_group_means_over_evaluated_sets_and_missing_ones_named():
    per_set = {
        "cifar100": scores(0.8, 0.6),
        "mnist": scores(0.9, 0.3),
        "svhn": scores(0.7, 0.5),
        "places365": scores(0.95, 0.1),
        "noise": scores(1.0, 0.0),
    }
    with pytest.warns(UserWarning) as record:
        means = group_means(per_set, openood_groups("CIFAR-10"))
    messages = [str(w.message) for w in record]
    assert any("'near'" in m and "tinyimagenet" in m and "over cifar100" in m for m in messages)
    assert any("'far'" in m and "textures" in m and "mnist, svhn, places365" in m for m in messages)
    assert means["ood/near/entropy/auroc"] == pytest.approx(0.8)
    assert means["ood/far/entropy/auroc"] == pytest.approx((0.9 + 0.7 + 0.95) / 3)
    assert means["ood/far/entropy/fpr95"] == pytest.approx((0.3 + 0.5 + 0.1) / 3)
    assert means["ood/far/max_probability/fpr95"] == pytest.approx((0.4 + 0.6 + 0.2) / 3)
    assert len(means) == 8  # noise is in no group
    assert group_coverage(per_set, OOD_GROUPS["cifar10"])["near"] == {
        "evaluated": ["cifar100"],
        "missing": ["tinyimagenet"],
    }


def test_group_means_from_flat_results_names():
    results = {
        "test/error": 0.1,
        "ood/cifar10/entropy/auroc": 0.6,
        "ood/tinyimagenet/entropy/auroc": 0.7,
        "ood/cifar10/entropy/aupr": 0.5,
        "ood/tinyimagenet/entropy/aupr": 0.9,
    }
    per_set = per_set_metrics(results)
    assert per_set == {
        "cifar10": {"entropy/auroc": 0.6, "entropy/aupr": 0.5},
        "tinyimagenet": {"entropy/auroc": 0.7, "entropy/aupr": 0.9},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        means = group_means(per_set, {"near": OOD_GROUPS["cifar100"]["near"]})
    assert not caught  # every set of the group was evaluated
    assert means == pytest.approx({"ood/near/entropy/auroc": 0.65, "ood/near/entropy/aupr": 0.7})
    with pytest.warns(UserWarning, match="no set: the group is left out"):
        assert group_means(per_set, {"far": OOD_GROUPS["cifar100"]["far"]}) == {}


def test_group_means_refuses_sets_with_different_metrics():
    with pytest.raises(ValueError, match="differing: \\['entropy/fpr95'\\]"):
        group_means(
            {"mnist": {"entropy/auroc": 0.9, "entropy/fpr95": 0.2}, "svhn": {"entropy/auroc": 0.8}},
            {"far": ("mnist", "svhn")},
        )


def test_openood_groups():
    assert OOD_GROUPS["cifar10"] == {
        "near": ("cifar100", "tinyimagenet"),
        "far": ("mnist", "svhn", "textures", "places365"),
    }
    assert openood_groups("CIFAR-100")["near"] == ("cifar10", "tinyimagenet")
    with pytest.raises(KeyError, match="known"):
        openood_groups("svhn")
