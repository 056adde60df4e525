"""What goes to W&B under which definitions (dbsn.evaluation.tracking): summaries, step metrics and
metric definitions.
"""

from __future__ import annotations

import pytest

from dbsn.evaluation.tracking import define_metrics, step_metric_of, summary_key, summary_of


@pytest.mark.parametrize(
    "name, summary",
    [
        ("val/error", "min"),
        ("test/nll", "min"),
        ("test/ece", "min"),
        ("test/brier", "min"),
        ("ood/svhn/entropy/fpr95", "min"),
        ("ood/svhn/entropy/auroc", "max"),
        ("ood/photos/mutual_information/aupr", "max"),
        ("test/miou", "max"),
        ("val/global_acc", "max"),
        ("test/iou/sky", "max"),
        ("train/error_step", None),
        ("ablation/error", None),
        ("test/mutual_information", None),
        ("structure/tau", None),
        ("adversarial/fgsm/accuracy", None),
    ],
)
def test_summaries_are_the_best_value_where_there_is_one(name, summary):
    assert summary_of(name) == summary
    assert summary_key(name) == (f"{name}.{summary}" if summary else name)


def test_per_epoch_metrics_are_drawn_against_the_epoch():
    assert [
        step_metric_of(n)
        for n in (
            "val/nll",
            "structure/edge_entropy_mean",
            "posterior/snr_median",
            "train/loss_epoch",
            "train/loss_step",
            "test/error",
        )
    ] == ["epoch", "epoch", "epoch", "epoch", None, None]


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
