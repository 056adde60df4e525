"""Conformal prediction sets (dbsn.metrics.conformal): the coverage guarantee by simulation on
exchangeable data, the scores against their definitions one example at a time, RAPS's penalty on a
long flat tail, the quantile's edges, the empty-set conventions (by default the top label where
s ≤ q̂ leaves a set empty, else the bare rule), and the set metrics (plain and bootstrap-weighted).

The simulations draw 500 random calibration / test splits of a fixed pool of examples (seeded).
Conditional on the pool a random split makes the test example's score rank uniform among the
n + 1, so with scores free of ties the expected coverage is exactly k / (n + 1),
k = ⌈(n + 1)(1 − α)⌉. The coverage of one split varies about like Beta(k, n + 1 − k), so the mean of
500 has a Monte Carlo standard error of about sqrt(k (n + 1 − k) / ((n + 1)² (n + 2)) / 500).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dbsn.metrics.conformal import (
    LAMBDA_GRID,
    Calibrated,
    aps_scores,
    calibrate,
    conformal_quantile,
    conformity_scores,
    label_ranks,
    pick_k_reg,
    pick_lambda,
    prediction_sets,
    quantile_rank,
    raps_scores,
    set_metrics,
    size_strata,
    thr_scores,
    top_labels,
    weighted_set_metrics,
)

SPLITS = 500
POOL = 1000
ALPHA = 0.1
# n = 24: (n + 1)(1 − α) = 22.5, q̂ the 23rd smallest score, expected coverage 23 / 25 = 0.92, midway
# between the bounds 1 − α = 0.90 and 1 − α + 1 / (n + 1) = 0.94. One split's coverage has a standard
# deviation of about sqrt(23 · 2 / (25² · 26)) = 0.053, so the mean of 500 one of 0.0024: each bound
# lies 0.02 / 0.0024 ≈ 8 standard errors from the expected coverage.
N_CAL = 24
# n = 19: (n + 1)(1 − α) = 18 exactly, so the expected coverage of continuous scores is 18 / 20 = 1 − α
N_EXACT = 19


def _pool(seed: int, n: int = POOL, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Exchangeable examples with continuous scores: Gaussian logits (scale 2.5), labels drawn
    from a slightly flatter distribution than the model's (the model is overconfident: conformal
    needs no calibration)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(n, classes, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 1.5, 1), 1, generator=g).squeeze(1)
    return torch.softmax(logits, 1), labels


def _splits(n: int, n_cal: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(SPLITS):
        order = torch.randperm(n, generator=g)
        yield order[:n_cal], order[n_cal:]


def _coverage(calibrated: Calibrated, probs, labels, generator=None) -> float:
    sets = calibrated.sets(probs, generator)
    return float(sets.gather(1, labels[:, None]).double().mean())


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    values = np.asarray(values)
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(len(values)))


@pytest.mark.parametrize("score, k_reg, lam", [("thr", None, None), ("aps", None, None), ("raps", 2, 0.05)])
def test_coverage_is_at_least_the_level_and_at_most_one_over_n_plus_one_above(score, k_reg, lam):
    """The bare rule (empty sets kept) has both bounds; the default sets (the top label where the
    bare set is empty) the same q̂ and sets that only add labels: never empty, coverage at least as high."""
    probs, labels = _pool(0)
    coverages, forced = [], []
    for calibrating, testing in _splits(POOL, N_CAL):
        calibrated = calibrate(
            probs[calibrating], labels[calibrating], score, ALPHA, k_reg=k_reg, lam=lam, allow_empty_sets=True
        )
        assert calibrated.n_tuning == 0 and calibrated.n_calibration == N_CAL
        coverages.append(_coverage(calibrated, probs[testing], labels[testing]))
        default = calibrate(probs[calibrating], labels[calibrating], score, ALPHA, k_reg=k_reg, lam=lam)
        assert default.qhat == calibrated.qhat and not default.allow_empty_sets
        sets = default.sets(probs[testing])
        assert sets.any(1).all() and (sets >= calibrated.sets(probs[testing])).all()
        forced.append(_coverage(default, probs[testing], labels[testing]))
    mean, error = _mean_and_error(coverages)
    expected = quantile_rank(N_CAL, ALPHA) / (N_CAL + 1)
    assert expected == pytest.approx(0.92)
    assert error < 0.0035  # as the module docstring's estimate: the bounds are 0.02 / error > 5 errors away
    assert 1 - ALPHA <= mean <= 1 - ALPHA + 1 / (N_CAL + 1)
    assert abs(mean - expected) < 4 * error
    assert all(f >= c for f, c in zip(forced, coverages)) and np.mean(forced) >= 1 - ALPHA


def test_randomised_aps_covers_exactly_one_minus_alpha_where_the_probabilities_tie():
    """Four prototype predictions, so the plain APS scores tie across examples and over-cover;
    the randomised scores are continuous and cover 1 − α in expectation ((n + 1)(1 − α) = 18)."""
    g = torch.Generator().manual_seed(2)
    prototypes = torch.softmax(3 * torch.randn(4, 6, generator=g, dtype=torch.float64), 1)
    probs = prototypes[torch.randint(4, (POOL,), generator=g)]
    labels = torch.multinomial(probs, 1, generator=g).squeeze(1)
    draws = torch.Generator().manual_seed(3)
    randomised, plain = [], []
    for calibrating, testing in _splits(POOL, N_EXACT):
        for score, found in (("aps_randomized", randomised), ("aps", plain)):
            calibrated = calibrate(probs[calibrating], labels[calibrating], score, ALPHA, draws, allow_empty_sets=True)
            found.append(_coverage(calibrated, probs[testing], labels[testing], draws))
    mean, error = _mean_and_error(randomised)
    assert abs(mean - (1 - ALPHA)) < 4 * error, (mean, error)
    tied, _ = _mean_and_error(plain)
    assert tied > mean + 4 * error  # ties in the scores: the plain sets over-cover


def _long_tail(n: int, seed: int, classes: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """One label with p ~ U(0.3, 0.95), the rest of the mass flat (jittered) over 99 labels; the
    label is the top one 92 % of the time, else anywhere in the tail."""
    g = torch.Generator().manual_seed(seed)
    top = 0.3 + 0.65 * torch.rand(n, generator=g, dtype=torch.float64)
    tail = 1 + 1e-3 * torch.rand(n, classes, generator=g, dtype=torch.float64)
    top_label = torch.randint(classes, (n,), generator=g)
    tail[torch.arange(n), top_label] = 0
    probs = tail / tail.sum(1, keepdim=True) * (1 - top)[:, None]
    probs[torch.arange(n), top_label] = top
    in_tail = torch.rand(n, generator=g) > 0.92
    labels = torch.where(in_tail, torch.randint(classes, (n,), generator=g), top_label)
    return probs, labels


def test_raps_keeps_the_long_flat_tail_out_of_the_sets():
    probs, labels = _long_tail(6000, 4)
    calibrating, testing = torch.arange(2000), torch.arange(2000, 6000)
    g = torch.Generator().manual_seed(5)
    aps = calibrate(probs[calibrating], labels[calibrating], "aps", ALPHA)
    fixed = calibrate(probs[calibrating], labels[calibrating], "raps", ALPHA, k_reg=1, lam=0.2)
    tuned = calibrate(probs[calibrating], labels[calibrating], "raps", ALPHA, g)
    assert tuned.n_tuning == 600 and tuned.n_calibration == 1400  # the authors' 30 %, rounded up
    assert tuned.k_reg == 1 and tuned.lam in LAMBDA_GRID  # 92 % of labels on top: the 90 % rank quantile is 1
    # one split: a coverage's standard deviation is about sqrt(α(1 − α)(1 / n_cal + 1 / n_test)) <= 0.0095
    floor = 1 - ALPHA - 3 * math.sqrt(ALPHA * (1 - ALPHA) * (1 / 1400 + 1 / 4000))
    found = {
        name: set_metrics(c.sets(probs[testing]), labels[testing])
        for name, c in (("aps", aps), ("fixed", fixed), ("tuned", tuned))
    }
    assert found["aps"]["size"] > 20  # APS reaches into the tail for the examples with a small top probability
    for name in ("fixed", "tuned"):
        assert found[name]["size"] <= found["aps"]["size"] / 5, {k: v["size"] for k, v in found.items()}
    assert all(f["coverage"] > floor for f in found.values()), {k: v["coverage"] for k, v in found.items()}


def test_scores_match_their_definitions_one_example_at_a_time():
    """Probabilities rounded to twentieths, so labels tie: ties are ranked by class index."""
    g = torch.Generator().manual_seed(6)
    probs = torch.softmax(torch.randn(30, 6, generator=g, dtype=torch.float64), 1)
    probs = (probs * 20).round().clamp_min(1)
    probs = probs / probs.sum(1, keepdim=True)
    u = torch.rand(30, generator=g, dtype=torch.float64)
    k_reg, lam = 2, 0.3
    order, ranks = label_ranks(probs)
    got = {
        "thr": thr_scores(probs),
        "aps": aps_scores(probs),
        "aps_u": aps_scores(probs, u),
        "raps": raps_scores(probs, k_reg, lam),
        "raps_u": raps_scores(probs, k_reg, lam, u),
    }
    for i, row in enumerate(probs.tolist()):
        ranked = sorted(range(6), key=lambda y: (-row[y], y))
        assert order[i].tolist() == ranked
        for y in range(6):
            rank = ranked.index(y) + 1
            before = sum(row[z] for z in ranked[: rank - 1])
            penalty = lam * max(0, rank - k_reg)
            assert int(ranks[i, y]) == rank
            expected = {
                "thr": 1 - row[y],
                "aps": before + row[y],
                "aps_u": before + float(u[i]) * row[y],
                "raps": before + row[y] + penalty,
                "raps_u": before + float(u[i]) * row[y] + penalty,
            }
            for name, value in expected.items():
                assert float(got[name][i, y]) == pytest.approx(value, abs=1e-12), (name, i, y)
    assert torch.equal(conformity_scores(probs, "raps_randomized", u, k_reg, lam), got["raps_u"])
    assert torch.equal(conformity_scores(probs, "aps", u), got["aps"])  # u is ignored by a plain score
    with pytest.raises(ValueError, match="needs u"):
        conformity_scores(probs, "aps_randomized")
    with pytest.raises(ValueError, match="unknown conformity score 'lac'"):
        conformity_scores(probs, "lac")


def _confident(seed: int = 8, n: int = 400, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """A confident model (logits of scale 6) whose label is the top one about 90 % of the time: at
    level 1 − α = 0.8 about 10 % of the bare sets of every score are empty, at 0.5 about 45 %."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(6 * torch.randn(n, classes, generator=g, dtype=torch.float64), 1)
    top = probs.argmax(1)
    labels = torch.where(torch.rand(n, generator=g) < 0.9, top, torch.randint(classes, (n,), generator=g))
    return probs, labels


def test_forced_sets_are_the_bare_sets_plus_the_top_label_where_those_are_empty():
    """Crafted rows: the top label is the first of the ranking (ties by class index, also where APS
    scores tie because a probability is 0); only the empty bare sets change, by that label alone."""
    probs = torch.tensor(
        [[0.2, 0.5, 0.3], [0.0, 1.0, 0.0], [0.45, 0.45, 0.1], [0.1, 0.3, 0.6], [0.34, 0.33, 0.33]], dtype=torch.float64
    )
    top = top_labels(probs)
    assert top.tolist() == [1, 1, 0, 2, 0]
    scores = aps_scores(probs)  # row 1: labels 0 and 1 both score 1.0; label 1 is the top one
    bare = prediction_sets(scores, 0.55)
    assert bare.sum(1).tolist() == [1, 0, 1, 0, 1]  # p_max > q̂ empties rows 1 and 3
    forced = prediction_sets(scores, 0.55, top)
    assert forced.sum(1).tolist() == [1, 1, 1, 1, 1]
    assert forced[1].tolist() == [False, True, False] and forced[3].tolist() == [False, False, True]
    assert torch.equal(forced[[0, 2, 4]], bare[[0, 2, 4]])
    thr = thr_scores(probs)  # THR: 1 − p_max > q̂ empties rows too; at q̂ = 0.56 row 2's tied pair is in
    assert prediction_sets(thr, 0.56).sum(1).tolist() == [1, 1, 2, 1, 0]
    assert torch.equal(prediction_sets(thr, 0.56, top)[:4], prediction_sets(thr, 0.56)[:4])
    assert prediction_sets(thr, 0.56, top)[4].tolist() == [True, False, False]
    assert prediction_sets(thr, math.inf, top).all()  # q̂ = +inf: every label, as the bare rule


@pytest.mark.parametrize("score", ["thr", "aps", "aps_randomized", "raps", "raps_randomized"])
def test_by_default_no_set_is_empty_and_each_forced_set_adds_only_the_top_label(score):
    probs, labels = _confident(n=800)
    probs, labels, confident, test_labels = probs[:400], labels[:400], probs[400:], labels[400:]
    alpha = 0.2  # a confident model at level 0.8: about 10 % of the bare sets empty, for every score
    fixed = {"k_reg": 1, "lam": 0.1} if score.startswith("raps") else {}
    default = calibrate(probs, labels, score, alpha, torch.Generator().manual_seed(9), **fixed)
    bare = calibrate(probs, labels, score, alpha, torch.Generator().manual_seed(9), allow_empty_sets=True, **fixed)
    assert default.qhat == bare.qhat and default.record()["allow_empty_sets"] is False
    assert bare.record()["allow_empty_sets"] is True
    forced_sets = default.sets(confident, torch.Generator().manual_seed(10))
    bare_sets = bare.sets(confident, torch.Generator().manual_seed(10))  # the same u for the randomised scores
    empty = ~bare_sets.any(1)
    assert empty.double().mean() > 0.05, score  # the case does test something
    assert forced_sets.any(1).all()  # the default: no set is empty
    top = top_labels(confident)
    added = forced_sets & ~bare_sets
    assert (bare_sets <= forced_sets).all()
    assert torch.equal(added.sum(1), empty.long())  # exactly one label where the bare set was empty, none elsewhere
    assert added[empty].nonzero()[:, 1].tolist() == top[empty].tolist()
    assert set_metrics(forced_sets, test_labels)["empty"] == 0
    assert set_metrics(forced_sets, test_labels)["coverage"] >= set_metrics(bare_sets, test_labels)["coverage"]


def test_lambda_tuning_measures_sets_of_the_chosen_convention(monkeypatch):
    """pick_lambda measures its sizes on the sets it would give (as the authors' `pick_lamda_size`
    passes `allow_zero_sets` on): the top labels by default, the bare rule with allow_empty_sets;
    tuned RAPS records the convention and its sets follow it."""
    from dbsn.metrics import conformal

    probs, labels = _confident(n=300)
    seen = []
    original = conformal.prediction_sets

    def spying(scores, qhat, top=None):
        seen.append(top)
        return original(scores, qhat, top)

    monkeypatch.setattr(conformal, "prediction_sets", spying)
    for allow in (False, True):
        seen.clear()
        assert pick_lambda(probs, labels, 0.5, 1, False, allow_empty_sets=allow) in LAMBDA_GRID
        assert len(seen) == len(LAMBDA_GRID)
        assert all(top is None for top in seen) if allow else all(torch.equal(top, top_labels(probs)) for top in seen)
        tuned = calibrate(probs, labels, "raps", 0.5, torch.Generator().manual_seed(11), allow_empty_sets=allow)
        assert tuned.allow_empty_sets is allow and tuned.n_tuning == 90
        sets = tuned.sets(probs)
        assert sets.any(1).all() if not allow else not sets.any(1).all()


def test_the_quantile_is_the_finite_sample_rank_and_infinite_beyond_n():
    scores = torch.tensor([0.5, 0.1, 0.4, 0.3, 0.2, 0.9, 0.8, 0.6, 0.7], dtype=torch.float64)
    assert quantile_rank(9, 0.1) == 9 and conformal_quantile(scores, 0.1) == 0.9  # (9 + 1)(0.9) = 9: the largest
    assert conformal_quantile(scores, 0.5) == 0.5  # ⌈10 · 0.5⌉ = 5th smallest
    assert quantile_rank(9, 0.7) == 3  # 10 · (1 − 0.7) = 3.0000000000000004 in floats: still rank 3
    assert conformal_quantile(scores[:5], 0.1) == math.inf  # ⌈6 · 0.9⌉ = 6 > 5
    assert conformal_quantile(scores[:0], 0.5) == math.inf  # no calibration example
    probs = torch.softmax(torch.randn(4, 5, dtype=torch.float64), 1)
    assert prediction_sets(thr_scores(probs), math.inf).all()  # q̂ = +inf: every label
    calibrated = calibrate(probs, torch.zeros(4, dtype=torch.long), "thr", 0.1)
    assert calibrated.qhat == math.inf and calibrated.record()["qhat"] == "inf"
    own = thr_scores(probs)[:, 0]
    assert prediction_sets(thr_scores(probs), float(own.max()))[:, 0].all()  # a score equal to q̂ is in


def test_k_reg_is_numpys_higher_quantile_of_the_true_ranks_as_the_authors():
    probs, labels = _pool(7, n=301)
    _, ranks = label_ranks(probs)
    own = ranks.gather(1, labels[:, None]).squeeze(1).numpy()
    for alpha in (0.05, 0.1, 0.2):
        assert pick_k_reg(probs, labels, alpha) == int(np.quantile(own - 1, 1 - alpha, method="higher")) + 1


def test_set_metrics_by_hand_and_their_weighted_rows():
    sets = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 0], [0, 1, 0, 0]]).bool()
    labels = torch.tensor([0, 1, 2, 3, 3, 1])
    found = set_metrics(sets, labels)
    # covered: 1, 0, 0, 1, 0, 1; sizes 1, 0, 2, 3, 3, 1
    assert found["coverage"] == pytest.approx(0.5) and found["size"] == pytest.approx(10 / 6)
    assert found["empty"] == pytest.approx(1 / 6)
    assert found["strata"] == [
        {"sizes": "0-1", "count": 3, "coverage": pytest.approx(2 / 3)},
        {"sizes": "2-3", "count": 3, "coverage": pytest.approx(1 / 3)},
    ]
    assert found["ssc"] == pytest.approx(1 / 3)  # the empty set counts in the 0-1 stratum, as the authors'

    assert [(c["class"], c["count"], c["coverage"]) for c in found["classes"]] == [
        (0, 1, 1.0),
        (1, 2, 0.5),
        (2, 1, 0.0),
        (3, 2, 0.5),
    ]
    assert found["class_coverage_min"] == 0.0
    counts = torch.tensor([[1.0] * 6, [0, 2, 1, 1, 0, 3], [2, 0, 0, 1, 1, 0]], dtype=torch.float64)
    rows = weighted_set_metrics(sets, labels, counts)
    for b, row in enumerate(counts):
        repeat = torch.repeat_interleave(torch.arange(6), row.long())
        plain = set_metrics(sets[repeat], labels[repeat])
        for m in ("coverage", "size", "empty", "ssc", "class_coverage_min"):
            assert float(rows[m][b]) == pytest.approx(plain[m]), (b, m)


def test_size_strata_cut_at_the_number_of_classes():
    assert size_strata(10) == [(0, 1), (2, 3), (4, 6), (7, 10)]
    assert size_strata(100) == [(0, 1), (2, 3), (4, 6), (7, 10), (11, 100)]
    assert size_strata(2) == [(0, 1), (2, 2)]
    assert size_strata(1000)[-1] == (101, 1000) and size_strata(1500)[-1] == (1001, 1500)
