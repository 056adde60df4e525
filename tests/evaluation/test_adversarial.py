"""The adversarial-robustness evaluation (dbsn.evaluation.adversarial): its settings checked before
anything runs, and the attack rows as one W&B point per ε. (The attacks: test_attacks.py.)
"""

from __future__ import annotations

import pytest
import torch

from dbsn.evaluation.adversarial import AdversarialRobustness, adversarial_curve


def test_the_adversarial_evaluation_refuses_bad_settings_before_anything_runs():
    from types import SimpleNamespace

    from dbsn.evaluation.base import EvaluationError, Subject

    subject = Subject(SimpleNamespace(task=SimpleNamespace(keeps_test_outputs=True)), None, "", torch.device("cpu"))
    AdversarialRobustness().check(subject)  # the paper's settings
    for settings, message in (
        ({"attacks": ["pgd"]}, r"unknown \['pgd'\]"),
        ({"epsilons": [0.0, 2.0]}, r"\[0, 1\]"),
        ({"bim_steps": 0}, "bim_steps must be >= 1"),
        ({"max_examples": 0}, "max_examples"),
    ):
        with pytest.raises(EvaluationError, match=message):
            AdversarialRobustness(**settings).check(subject)
    segmentation = Subject(
        SimpleNamespace(task=SimpleNamespace(keeps_test_outputs=False)), None, "", torch.device("cpu")
    )
    with pytest.raises(EvaluationError, match="classifiers"):
        AdversarialRobustness().check(segmentation)


def test_attack_rows_become_one_point_per_epsilon():
    rows = [
        {"attack": a, "epsilon": e, "accuracy": acc, "mean_entropy": h}
        for a, e, acc, h in [
            ("fgsm", 0.1, 0.5, 1.0),
            ("fgsm", 0.0, 0.9, 0.2),
            ("bim", 0.0, 0.9, 0.2),
            ("bim", 0.1, 0.3, 1.2),
        ]
    ]
    assert adversarial_curve(rows) == [
        {
            "adversarial/epsilon": 0.0,
            "adversarial/fgsm/accuracy": 0.9,
            "adversarial/fgsm/mean_entropy": 0.2,
            "adversarial/bim/accuracy": 0.9,
            "adversarial/bim/mean_entropy": 0.2,
        },
        {
            "adversarial/epsilon": 0.1,
            "adversarial/fgsm/accuracy": 0.5,
            "adversarial/fgsm/mean_entropy": 1.0,
            "adversarial/bim/accuracy": 0.3,
            "adversarial/bim/mean_entropy": 1.2,
        },
    ]
