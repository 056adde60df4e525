"""The public module names every door of docs/extending.md, the loss hook defines a method's loss,
and the statistics for a user's own predictions are the functions evaluate.py and the report call."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dbsn.api as api
from dbsn.evaluation.report.comparisons import paired_differences
from dbsn.evaluation.report.seeds import combine_seeds
from dbsn.evaluation.statistics import Statistics, calibrate, ce2_intervals, classification_statistics, intervals_of
from dbsn.metrics.ce2_inference import paired_test, score_interval
from tests.support.configs import ROOT
from tests.support.netutil import tiny_structure_net


def test_every_class_docs_extending_imports_from_dbsn_is_in_the_public_module():
    text = (ROOT / "docs" / "extending.md").read_text()
    names = set()
    for line in re.findall(r"^from dbsn\.(?!testing )\S+ import (.+)$", text, re.M):
        names |= {n.strip() for n in line.split(",")}
    assert names and names <= set(api.__all__), names - set(api.__all__)
    for door, hooks in api.HOOKS.items():
        assert all(hasattr(getattr(api, door), hook) for hook in hooks), door


class Smoothed(api.MAP):
    """A method whose loss is label-smoothed cross-entropy: the one hook overridden."""

    def data_loss(self, logits, targets):
        return F.cross_entropy(logits, targets, label_smoothing=0.1)


def test_the_loss_hook_is_the_data_term_of_the_training_loss():
    torch.manual_seed(0)
    method = Smoothed(tiny_structure_net(), learn_structure=False, dataset_size=10)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(10, (4,))
    out = method.training_loss(x, y)
    torch.testing.assert_close(out["nll"], F.cross_entropy(out["logits"], out["targets"], label_smoothing=0.1))
    torch.testing.assert_close(out["loss"], out["nll"])  # a point estimate: no KL
    plain = api.MAP(tiny_structure_net(), learn_structure=False, dataset_size=10)
    plain.load_state_dict(method.state_dict())
    assert not torch.allclose(plain.training_loss(x, y)["nll"], out["nll"])


def predictions(n=300, classes=4, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=g, dtype=torch.float64) * scale
    y = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(1)
    return logits, y


def test_metric_intervals_are_evaluate_s_statistics_and_logits_equal_log_probs():
    logits, y = predictions()
    statistics = Statistics(seed=3, resamples=200)
    found = api.metric_intervals(logits.numpy(), y.numpy(), statistics)
    log_probs = logits.log_softmax(-1)
    calibrated = calibrate(log_probs, y, None, 3)[0]
    rows = classification_statistics(log_probs, y, {}, statistics.weights(len(y)), calibrated)
    intervals = {**intervals_of(rows, 0.95), **ce2_intervals(log_probs, y, calibrated, 0.95)}
    assert set(found) == set(rows) and "test/calibrated/nll" in found
    for key, (value, low, high) in found.items():
        assert value == pytest.approx(float(rows[key][0])) and [low, high] == pytest.approx(intervals[key])
    confidence = log_probs.exp().amax(-1)
    selective = api.metric_intervals(logits, y, statistics, calibrated=False, scores={"max_probability": confidence})
    rows = classification_statistics(log_probs, y, {"max_probability": confidence}, statistics.weights(len(y)))
    assert "test/calibrated/nll" not in selective and "selective/max_probability/aurc" in selective
    key = "selective/max_probability/aurc"
    assert selective[key].value == pytest.approx(float(rows[key][0]))
    again = api.metric_intervals(log_probs, y, statistics)
    assert all(again[k] == pytest.approx(found[k], rel=1e-12) for k in found)


def test_compare_is_the_report_s_paired_differences_over_seeds():
    seeds = [predictions(seed=s) for s in range(3)]
    y = seeds[0][1]
    a = [logits for logits, _ in seeds]
    b = [logits * 0.5 for logits in a]
    statistics = Statistics(resamples=200)
    found = api.compare(a, b, y, statistics)

    def side(rows):
        return {
            i: {
                "log_probs": r.log_softmax(-1),
                "targets": y,
                "calibrated_log_probs": calibrate(r.log_softmax(-1), y, None, 0)[0],
            }
            for i, r in enumerate(rows)
        }

    expected = paired_differences(side(a), side(b), statistics)
    assert set(found) == {"error", "NLL", "Brier", "CE²", "calibrated NLL", "calibrated CE²"} == set(expected)
    for name in found:
        assert found[name]["combined"] == pytest.approx(expected[name]["combined"])
        assert found[name]["p"] == pytest.approx(expected[name]["p"]) and len(found[name]["seeds"]) == 3
    one = api.compare(a[0], b[0], y, statistics, calibrated=False)
    assert "calibrated NLL" not in one and math.isinf(one["NLL"]["df"])


def test_ce2_and_the_seed_level_are_the_underlying_functions():
    logits, y = predictions()
    other = logits * 1.7
    probs, other_probs = logits.log_softmax(-1).exp(), other.log_softmax(-1).exp()  # exp of log-probs, as the wrapper
    assert api.ce2_interval(logits, y) == pytest.approx(score_interval(probs, y, 0.95), rel=1e-12)
    expected = paired_test(probs, other_probs, y, 0.9)
    assert api.ce2_paired_test(logits, other, y, 0.9) == pytest.approx(expected, rel=1e-12)
    values, cov = [0.1, 0.3, 0.2], np.eye(3) * 1e-3
    assert api.seed_level(values, cov) == combine_seeds(
        torch.tensor(values, dtype=torch.float64), torch.eye(3, dtype=torch.float64) * 1e-3, 0.95
    )
    assert api.seed_level(values).df > 0
