"""Tests for dbsn.evaluation.ood: detection metrics against scikit-learn, the report, the CDF
figure, the FPR95 convention and the entropy-CDF points logged as a table.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from dbsn.evaluation.ood import OOD_SCORES, cdf_points, detection_metrics, entropy_cdf_figure, fpr_at_95_tpr, ood_report
from dbsn.metrics.uncertainty import ood_scores

METRICS = {"auroc", "aupr", "aupr_in", "fpr95"}


def sklearn_metrics(scores_in: np.ndarray, scores_out: np.ndarray) -> dict[str, float]:
    """The reference: OOD is label 1, higher score = more OOD."""
    scores = np.concatenate([scores_in, scores_out])
    is_out = np.concatenate([np.zeros(len(scores_in)), np.ones(len(scores_out))])
    fpr, tpr, _ = roc_curve(is_out, scores, drop_intermediate=False)
    return {
        "auroc": roc_auc_score(is_out, scores),
        "aupr": average_precision_score(is_out, scores),
        "aupr_in": average_precision_score(1 - is_out, -scores),
        "fpr95": fpr[np.argmax(tpr >= 0.95)],
    }


@pytest.mark.parametrize("decimals", [None, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_sklearn_on_random_scores(seed, decimals):
    rng = np.random.default_rng(seed)
    # Unequal sizes, overlapping distributions; scores well outside [0, 1] as well.
    scores_in = rng.normal(0.0, 1.0, size=300 + 37 * seed)
    scores_out = rng.normal(0.8, 1.5, size=170 + 11 * seed)
    if decimals is not None:  # many ties, within and across the two sets
        scores_in, scores_out = scores_in.round(decimals), scores_out.round(decimals)
        assert len(np.unique(np.concatenate([scores_in, scores_out]))) < 100
    result = detection_metrics(torch.as_tensor(scores_in, dtype=torch.float32), torch.as_tensor(scores_out))
    expected = sklearn_metrics(scores_in.astype(np.float32).astype(np.float64), scores_out)
    assert set(result) == METRICS
    assert all(isinstance(v, float) for v in result.values())
    for key in METRICS:
        assert result[key] == pytest.approx(expected[key], abs=1e-6), key


def test_the_auroc_of_separated_sets_is_one_not_more():
    """Float32 scores that separate the sets: the AUROC is exactly 1 (a float32 trapezoid passed 1
    by an ulp on about one such set in thirty) and matches scikit-learn's elsewhere to 1e-12."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        scores_in = torch.rand(int(torch.randint(20, 300, (1,), generator=gen)), generator=gen)
        scores_out = 1.5 + torch.rand(int(torch.randint(20, 300, (1,), generator=gen)), generator=gen)
        assert detection_metrics(scores_in, scores_out)["auroc"] == 1.0
        mixed = scores_out - 1.2
        expected = sklearn_metrics(scores_in.double().numpy(), mixed.double().numpy())["auroc"]
        assert abs(detection_metrics(scores_in, mixed)["auroc"] - expected) < 1e-12


def test_fpr95_at_exact_95_percent_tpr():
    # 20 OOD scores 1..20, in-distribution scores 0.5..19.5. TPR = 19/20 = 0.95 exactly at the
    # threshold 2 (OOD 2..20 flagged), where the in-distribution 2.5..19.5 are flagged: 18/20.
    scores_out = torch.arange(1.0, 21.0)
    scores_in = scores_out - 0.5
    assert detection_metrics(scores_in, scores_out)["fpr95"] == pytest.approx(18 / 20)
    assert sklearn_metrics(scores_in.numpy(), scores_out.numpy())["fpr95"] == pytest.approx(18 / 20)


def test_perfectly_separated():
    result = detection_metrics(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.7, 0.8, 0.9, 1.0, 5.0]))
    assert result == {"auroc": 1.0, "aupr": 1.0, "aupr_in": 1.0, "fpr95": 0.0}


def test_reversed():
    result = detection_metrics(torch.tensor([0.7, 0.8, 0.9]), torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert result["auroc"] == 0.0
    assert result["fpr95"] == 1.0
    # Every in-distribution example ranks above every OOD one: AP = (1/4 + 2/5 + 3/6 + 4/7) / 4.
    assert result["aupr"] == pytest.approx((1 / 4 + 2 / 5 + 3 / 6 + 4 / 7) / 4, abs=1e-6)


def test_large_scores_are_not_squashed_into_ties():
    # torchmetrics would map these through a sigmoid, which is 1.0 for all of them even in float64.
    result = detection_metrics(torch.tensor([40.0, 41.0]), torch.tensor([50.0, 51.0]))
    assert result == {"auroc": 1.0, "aupr": 1.0, "aupr_in": 1.0, "fpr95": 0.0}


def test_small_case_by_hand():
    scores_in = torch.tensor([0.1, 0.2, 0.5, 0.3])
    scores_out = torch.tensor([0.5, 0.7, 0.4, 0.9])
    # AUROC = P(out > in) + P(out = in) / 2 over the 16 pairs:
    #   out 0.5 beats in 0.1, 0.2, 0.3 and ties with in 0.5 -> 3.5
    #   out 0.7 beats all four -> 4;  out 0.4 beats 0.1, 0.2, 0.3 -> 3;  out 0.9 -> 4
    #   AUROC = 14.5 / 16 = 0.90625.
    # Thresholds from the top: 0.9 (TP 1, FP 0), 0.7 (2, 0), 0.5 (3, 1: the tie goes together),
    #   0.4 (4, 1). TPR first reaches >= 0.95 (4/4) at 0.4, where FP = 1 of 4: FPR95 = 0.25.
    # AUPR-Out = mean precision at each recall step = (1/1 + 2/2 + 3/4 + 4/5) / 4 = 0.8875.
    # AUPR-In: in-distribution positive, lowest score first: 0.1, 0.2, 0.3 (precision 1 each),
    #   0.4 (an OOD, no recall step), 0.5 (TP 4, FP 2: precision 4/6) -> (1 + 1 + 1 + 2/3) / 4.
    result = detection_metrics(scores_in, scores_out)
    assert result["auroc"] == pytest.approx(0.90625, abs=1e-6)
    assert result["fpr95"] == pytest.approx(0.25, abs=1e-6)
    assert result["aupr"] == pytest.approx(0.8875, abs=1e-6)
    assert result["aupr_in"] == pytest.approx(11 / 12, abs=1e-6)
    assert result == pytest.approx(sklearn_metrics(scores_in.numpy(), scores_out.numpy()), abs=1e-6)


def test_numpy_and_non_flat_inputs():
    result = detection_metrics(np.array([[0.1, 0.2]]), np.array([0.7, 0.8]))
    assert result == {"auroc": 1.0, "aupr": 1.0, "aupr_in": 1.0, "fpr95": 0.0}


@pytest.mark.parametrize(
    ("scores_in", "scores_out", "message"),
    [
        (torch.tensor([]), torch.tensor([0.5]), "scores_in is empty"),
        (torch.tensor([0.5]), torch.tensor([]), "scores_out is empty"),
        (torch.tensor([0.1, float("nan"), 0.2]), torch.tensor([0.5]), "scores_in has 1 non-finite"),
        (torch.tensor([0.1]), torch.tensor([float("inf"), 0.5, -float("inf")]), "scores_out has 2 non-finite"),
    ],
)
def test_invalid_inputs_raise(scores_in, scores_out, message):
    with pytest.raises(ValueError, match=message):
        detection_metrics(scores_in, scores_out)


def test_ood_report():
    gen = torch.Generator().manual_seed(0)
    # In-distribution: 4 members agreeing on a confident prediction. OOD: members that
    # disagree, each confident in a random class, so every score is higher on OOD.
    confident = torch.full((30, 5), -10.0)
    confident[:, 0] = 0.0
    members_in = confident.log_softmax(-1).expand(4, 30, 5)
    members_out = (8 * torch.randn(4, 20, 5, generator=gen)).log_softmax(-1)
    report = ood_report(members_in, members_out)
    assert tuple(report) == OOD_SCORES == ("entropy", "mutual_information", "max_probability")
    for name in OOD_SCORES:
        assert set(report[name]) == METRICS
        assert report[name]["auroc"] == 1.0, name
        assert report[name]["fpr95"] == 0.0, name
    # Each entry is detection_metrics of that score.
    members_out_mixed = torch.cat([members_in[:, :10], members_out], dim=1)
    report = ood_report(members_in, members_out_mixed)
    scores_in, scores_out = ood_scores(members_in), ood_scores(members_out_mixed)
    for name in OOD_SCORES:
        assert report[name] == detection_metrics(scores_in[name], scores_out[name])
        assert report[name]["auroc"] < 1.0


def test_entropy_cdf_figure_lines_legend_and_axes():
    curves = {
        "in-distribution": torch.tensor([0.3, 0.1, 0.2, 0.1]),
        "OOD": np.array([1.5, 0.9, 1.2]),
    }
    fig = entropy_cdf_figure(curves, title="toy")
    ax = fig.axes[0]
    lines = ax.get_lines()[: len(curves)]
    for line, values in zip(lines, curves.values()):
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        assert x.tolist() == pytest.approx(sorted(np.asarray(values).tolist()))
        assert y.tolist() == pytest.approx(np.arange(1, len(values) + 1) / len(values))
        assert np.all(np.diff(y) >= 0) and y[-1] == 1.0 and y[0] > 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)
    assert ax.get_xlabel() == "Predictive entropy (nats)"
    assert ax.get_ylabel() == "Fraction of examples with entropy ≤ x"
    assert ax.get_title() == "toy"
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1
    assert ax.get_xlim()[0] == 0


def test_entropy_cdf_figure_marks_maximum_entropy():
    curves = {"a": np.array([0.5, 1.0]), "b": np.array([2.0, 2.2])}
    fig = entropy_cdf_figure(curves, num_classes=10)
    ax = fig.axes[0]
    assert ax.get_xlim()[1] >= math.log(10)
    assert ax.get_title()  # a default title
    vertical = [
        line
        for line in ax.get_lines()[len(curves) :]
        if np.allclose(np.asarray(line.get_xdata(), dtype=float), math.log(10))
    ]
    assert len(vertical) == 1 and vertical[0].get_linestyle() == ":"
    assert any("log 10" in text.get_text() for text in ax.texts)
    # The marker is labelled on the plot, not in the legend.
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]


def test_entropy_cdf_figure_rejects_empty_curve():
    with pytest.raises(ValueError, match="'b'"):
        entropy_cdf_figure({"a": np.array([0.1]), "b": np.array([])})


# ----- FPR95: which class is positive ---------------------------------------------------------
def test_fpr95_treats_ood_as_positive_and_the_other_convention_differs():
    # Higher = more OOD. Fewer than 20 examples a class: 95% TPR means every positive is caught.
    scores_in = torch.tensor([0.1, 0.2, 0.3, 0.6])
    scores_out = torch.tensor([0.5, 0.55, 0.7, 0.9])
    # OOD positive: catching all OOD needs threshold 0.5; in-distribution >= 0.5: {0.6} -> 1/4.
    assert detection_metrics(scores_in, scores_out)["fpr95"] == pytest.approx(0.25)
    assert fpr_at_95_tpr(scores_in, scores_out) == pytest.approx(0.25)
    # In-distribution positive: accepting all of it needs threshold 0.6; OOD <= 0.6: {0.5, 0.55} -> 2/4.
    assert fpr_at_95_tpr(scores_in, scores_out, positive="in") == pytest.approx(0.5)
    # The same numbers from scikit-learn with either class labelled 1.
    s = np.concatenate([scores_in.numpy(), scores_out.numpy()])
    is_out = np.array([0] * 4 + [1] * 4)
    fpr, tpr, _ = roc_curve(is_out, s, drop_intermediate=False)
    assert fpr[np.argmax(tpr >= 0.95)] == pytest.approx(0.25)
    fpr, tpr, _ = roc_curve(1 - is_out, -s, drop_intermediate=False)
    assert fpr[np.argmax(tpr >= 0.95)] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="'ood' or 'in'"):
        fpr_at_95_tpr(scores_in, scores_out, positive="id")


@pytest.mark.parametrize("seed", [0, 1])
def test_fpr95_in_positive_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores_in = rng.normal(0, 1, 200).round(1)
    scores_out = rng.normal(1, 2, 150).round(1)
    s, is_in = np.concatenate([scores_in, scores_out]), np.array([1] * 200 + [0] * 150)
    fpr, tpr, _ = roc_curve(is_in, -s, drop_intermediate=False)
    assert fpr_at_95_tpr(scores_in, scores_out, positive="in") == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-6)
    fpr, tpr, _ = roc_curve(1 - is_in, s, drop_intermediate=False)  # the default: OOD positive, higher = more OOD
    assert fpr_at_95_tpr(scores_in, scores_out) == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-6)
    assert detection_metrics(scores_in, scores_out)["fpr95"] == fpr_at_95_tpr(scores_in, scores_out)


# ----- the entropy CDF as W&B points ------------------------------------------------------------


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


def test_detection_statistics_row_zero_is_detection_metrics_and_chunking_changes_nothing():
    from dbsn.evaluation.ood import detection_statistics
    from dbsn.evaluation.statistics import Statistics, intervals_of

    g = torch.Generator().manual_seed(0)
    scores_in, scores_out = torch.randn(300, generator=g), torch.randn(200, generator=g) + 1
    statistics = Statistics(seed=3, resamples=200)
    w_in, w_out = statistics.weights(300), statistics.weights(200, stream=1)
    rows = detection_statistics(scores_in, scores_out, w_in, w_out, chunk=7)
    plain = detection_metrics(scores_in, scores_out)
    assert set(rows) == set(plain)
    for key, value in plain.items():
        assert abs(float(rows[key][0]) - value) < 1e-6, key
        assert torch.allclose(rows[key], detection_statistics(scores_in, scores_out, w_in, w_out, chunk=500)[key])
    low, high = intervals_of({"auroc": rows["auroc"]}, 0.95)["auroc"]
    assert low < plain["auroc"] < high and high - low < 0.2
    assert not torch.equal(w_out[1:], statistics.weights(200, stream=2)[1:])  # independent sets, independent resamples
