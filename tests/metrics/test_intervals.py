"""Bootstrap intervals (dbsn.metrics.intervals): a weighted metric equals the plain metric at
unit weights and on the data set its counts repeat; the intervals cover the truth as often as
they say; paired differences are antisymmetric and zero against oneself."""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import roc_auc_score

from dbsn.metrics.calibration import (
    adaptive_expected_calibration_error,
    classwise_expected_calibration_error,
    squared_calibration_error,
)
from dbsn.metrics.classification import brier_score, error_rate, expected_calibration_error, negative_log_likelihood
from dbsn.metrics.intervals import (
    bootstrap,
    paired_interval,
    resample_counts,
    weighted_adaptive_ece,
    weighted_auroc,
    weighted_brier,
    weighted_classwise_ece,
    weighted_ece,
    weighted_error,
    weighted_nll,
    weighted_squared_calibration_error,
)


def _predictions(n=300, classes=5, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(n, classes, generator=g, dtype=torch.float64), 1)
    if ties:  # coarse probabilities: many examples share a confidence
        probs = (probs * 8).round() + 1e-3
        probs = probs / probs.sum(1, keepdim=True)
    target = torch.randint(classes, (n,), generator=g)
    return probs, target


PLAIN = {  # weighted metric: the plain one it must equal
    "error": (weighted_error, lambda p, y: error_rate(p, y)),
    "nll": (lambda p, y, w: weighted_nll(p.log(), y, w), lambda p, y: negative_log_likelihood(p.log(), y)),
    "brier": (weighted_brier, brier_score),
    "ece": (weighted_ece, expected_calibration_error),
    "adaptive_ece": (weighted_adaptive_ece, adaptive_expected_calibration_error),
    "classwise_ece": (weighted_classwise_ece, classwise_expected_calibration_error),
}


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
@pytest.mark.parametrize("name", list(PLAIN))
def test_a_weighted_metric_is_the_plain_metric_of_the_repeated_data(name, ties):
    weighted, plain = PLAIN[name]
    probs, target = _predictions(ties=ties)
    n = len(target)
    assert torch.allclose(
        weighted(probs, target, torch.ones(n))[0], torch.as_tensor(plain(probs, target)).double(), atol=1e-10
    )
    counts = resample_counts(n, resamples=4, seed=1)
    values = weighted(probs, target, counts)
    for row, value in zip(counts.long(), values):
        repeated = torch.repeat_interleave(torch.arange(n), row)
        expected = torch.as_tensor(plain(probs[repeated], target[repeated])).double()
        assert torch.allclose(value, expected, atol=1e-10), (name, float(value), float(expected))


def test_weighted_auroc_is_sklearns_on_the_repeated_sets():
    g = torch.Generator().manual_seed(0)
    scores_in = (torch.randn(200, generator=g) * 4).round()  # ties within and across the sets
    scores_out = (torch.randn(150, generator=g) * 4 + 2).round()
    labels = [0] * 200 + [1] * 150
    ones = weighted_auroc(scores_in, scores_out, torch.ones(200), torch.ones(150))
    assert abs(float(ones[0]) - roc_auc_score(labels, torch.cat([scores_in, scores_out]))) < 1e-12
    c_in, c_out = resample_counts(200, 3, seed=2), resample_counts(150, 3, seed=3)
    for a, b, value in zip(c_in.long(), c_out.long(), weighted_auroc(scores_in, scores_out, c_in, c_out)):
        s_in, s_out = scores_in.repeat_interleave(a), scores_out.repeat_interleave(b)
        truth = roc_auc_score([0] * len(s_in) + [1] * len(s_out), torch.cat([s_in, s_out]))
        assert abs(float(value) - truth) < 1e-12


def test_resamples_are_n_draws_seeded():
    counts = resample_counts(50, resamples=20, seed=7)
    assert counts.shape == (20, 50) and bool((counts.sum(1) == 50).all())
    assert torch.equal(counts, resample_counts(50, resamples=20, seed=7))
    assert not torch.equal(counts, resample_counts(50, resamples=20, seed=8))


def test_the_error_interval_covers_the_true_error_95_percent_of_the_time():
    """200 test sets of 400 examples, each wrong with probability 0.1: the 95 % interval holds
    0.1 in a fraction of them inside three binomial standard deviations of 0.95."""
    generator = torch.Generator().manual_seed(0)
    n, draws, covered = 400, 200, 0
    target = torch.zeros(n, dtype=torch.long)
    for draw in range(draws):
        wrong = torch.rand(n, generator=generator) < 0.1
        probs = torch.stack([(~wrong).double(), wrong.double()], 1)
        interval = bootstrap(lambda w: weighted_error(probs, target, w), n, resamples=1000, seed=draw)
        covered += interval.low <= 0.1 <= interval.high
    tolerance = 3 * (0.95 * 0.05 / draws) ** 0.5
    assert abs(covered / draws - 0.95) <= tolerance, covered / draws


def test_paired_differences_are_antisymmetric_zero_against_oneself_and_find_a_real_gap():
    probs, target = _predictions(n=400, seed=4)
    better = probs.clone()
    better[torch.arange(100), target[:100]] += 10.0  # the first 100 examples made right and confident
    better = better / better.sum(1, keepdim=True)
    a = lambda w: weighted_nll(better.log(), target, w)  # noqa: E731
    b = lambda w: weighted_nll(probs.log(), target, w)  # noqa: E731
    ab, ba = paired_interval(a, b, 400), paired_interval(b, a, 400)
    assert (
        ab.value == pytest.approx(-ba.value) and ab.low == pytest.approx(-ba.high) and ab.high == pytest.approx(-ba.low)
    )
    same = paired_interval(a, a, 400)
    assert same.value == same.low == same.high == 0.0 and not same.excludes(0.0)
    assert ab.high < 0 and ab.excludes(0.0)  # lower NLL, and the interval says so


def _scores(seed=0, n_in=120, n_out=90):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_in, generator=g) * 3).round(), (torch.randn(n_out, generator=g) * 3 + 2).round()


@pytest.mark.parametrize("name", ["aupr", "aupr_in", "fpr95"])
def test_weighted_detection_metrics_are_the_plain_ones_of_the_repeated_sets(name):
    from dbsn.evaluation.ood import detection_metrics
    from dbsn.metrics.intervals import weighted_average_precision, weighted_fpr95

    def weighted(s_in, s_out, w_in, w_out):
        if name == "aupr_in":
            return weighted_average_precision(-s_out, -s_in, w_out, w_in)
        return (weighted_average_precision if name == "aupr" else weighted_fpr95)(s_in, s_out, w_in, w_out)

    scores_in, scores_out = _scores()
    ones = weighted(scores_in, scores_out, torch.ones(len(scores_in)), torch.ones(len(scores_out)))
    assert abs(float(ones[0]) - detection_metrics(scores_in, scores_out)[name]) < 1e-6  # torchmetrics: float32
    c_in, c_out = resample_counts(len(scores_in), 4, seed=2), resample_counts(len(scores_out), 4, seed=3)
    for a, b, value in zip(c_in.long(), c_out.long(), weighted(scores_in, scores_out, c_in, c_out)):
        truth = detection_metrics(scores_in.repeat_interleave(a), scores_out.repeat_interleave(b))[name]
        assert abs(float(value) - truth) < 1e-6, (name, float(value), truth)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_weighted_selective_metrics_are_the_plain_ones_of_the_repeated_data(ties):
    from dbsn.metrics.intervals import weighted_selective
    from dbsn.metrics.selective import selective_metrics

    g = torch.Generator().manual_seed(4)
    uncertainty = torch.rand(250, generator=g)
    uncertainty = (uncertainty * 6).round() if ties else uncertainty
    errors = (torch.rand(250, generator=g) < 0.2 + 0.5 * uncertainty / uncertainty.max()).double()
    counts = torch.cat([torch.ones(1, 250, dtype=torch.float64), resample_counts(250, 4, seed=5)])
    found = weighted_selective(errors, uncertainty, counts)
    for row, index in zip(counts.long(), range(len(counts))):
        keep = torch.repeat_interleave(torch.arange(250), row)
        plain = selective_metrics(errors[keep], {"u": uncertainty[keep]})
        for key in ("aurc", "eaurc", "augrc", "risk@80"):
            assert abs(float(found[key][index]) - plain[f"selective/u/{key}"]) < 1e-10, (key, index)
        assert abs(float(found["optimal_aurc"][index]) - plain["selective/optimal_aurc"]) < 1e-10


# ---------------------------------------------------------------------- calibration error that can be compared
def _known_model(
    n: int, generator: torch.Generator, gap: float = 0.0, low: float = 0.3, high: float = 1.0, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """A classifier whose top-label confidence c is uniform on [low, high] and right with probability
    c − gap: its squared calibration error is gap² exactly, in every bin. Returns (probs, target)."""
    c = low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)
    right = torch.rand(n, generator=generator, dtype=torch.float64) < (c - gap)
    probs = ((1 - c) / (classes - 1))[:, None].expand(n, classes).clone()
    probs[:, 0] = c  # class 0 is the prediction
    target = torch.where(right, 0, torch.randint(1, classes, (n,), generator=generator))
    return probs, target


def test_the_resampled_squared_calibration_error_averages_over_pairs_of_distinct_examples():
    """At unit weights the plain estimate; with counts, bin by bin the mean of d_i d_j over the pairs
    of copies of two different examples (brute force over copies), weighted by the bin's copies."""
    probs, target = _predictions(n=60)
    n = len(target)
    assert torch.allclose(
        weighted_squared_calibration_error(probs, target, torch.ones(n))[0],
        squared_calibration_error(probs, target),
        atol=1e-12,
    )
    counts = resample_counts(n, resamples=3, seed=2)
    confidence, prediction = probs.max(1)
    d = (prediction == target).double() - confidence
    bins = (torch.bucketize(confidence, torch.linspace(0, 1, 16, dtype=torch.float64), right=True) - 1).clamp(max=14)
    for row, value in zip(counts.long(), weighted_squared_calibration_error(probs, target, counts)):
        copies = torch.repeat_interleave(torch.arange(n), row)  # the original example of each copy
        total = 0.0
        for b in bins[copies].unique():
            inside = copies[bins[copies] == b]
            same = inside[:, None] == inside[None, :]
            products = (d[inside][:, None] * d[inside][None, :])[~same]
            if len(products):
                total += len(inside) * float(products.mean())
        assert abs(float(value) - total / len(copies)) < 1e-10


def _interval(metric, n: int, seed: int, resamples: int = 400):
    return bootstrap(metric, n, resamples=resamples, seed=seed)


def test_the_plug_in_eces_interval_misses_a_calibrated_models_zero():
    """A calibrated model (the confidence is the chance of being right), 200 test sets of 2,000: the
    plug-in ECE's percentile interval holds its true value, 0, in few of them (its bias, which grows
    with the confidences' spread, is why CE² is compared instead; CE²'s own interval and paired test
    are `metrics.ce2_inference`'s, simulated in tests/metrics/test_ce2_inference.py)."""
    generator = torch.Generator().manual_seed(0)
    runs, n, covered = 200, 2000, 0
    for run in range(runs):
        probs, target = _known_model(n, generator)
        ece = _interval(lambda w: weighted_ece(probs, target, w), n, run)
        covered += ece.low <= 0.0 <= ece.high
    assert covered / runs < 0.2, covered


def test_two_calibrated_models_of_different_confidence_differ_in_the_plug_in_ece():
    """Both calibrated, one confident (c in [0.8, 1]), one not (c in [0.2, 1]), on the same 2,000 test
    examples, 100 times: the paired interval of the plug-in ECE's difference, which the confidence
    spread biases, excludes 0 in most runs (the paired CE² test: tests/metrics/test_ce2_inference.py)."""
    generator = torch.Generator().manual_seed(1)
    n, runs, ece_false = 2000, 100, 0
    for run in range(runs):
        a_probs, target = _known_model(n, generator, low=0.8)
        b_probs, b_target = _known_model(n, generator, low=0.2)
        # the same test examples: model b's correctness re-expressed against model a's labels
        b_right = b_target == 0
        b_pred = torch.where(b_right, target, (target + 1) % 10)
        b_full = torch.full_like(b_probs, 0.0)
        b_full.scatter_(1, b_pred[:, None], b_probs[:, :1])
        rest = ((1 - b_probs[:, 0]) / 9)[:, None]
        b_full = torch.where(b_full == 0, rest.expand_as(b_full), b_full)
        ece = paired_interval(
            lambda w: weighted_ece(a_probs, target, w),
            lambda w: weighted_ece(b_full, target, w),
            n,
            resamples=400,
            seed=run,
        )
        ece_false += ece.excludes(0.0)
    assert ece_false / runs >= 0.5, ece_false
