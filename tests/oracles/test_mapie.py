"""dbsn's conformal sets against MAPIE's, on the same calibration and test probabilities.

MAPIE's `SplitConformalClassifier` runs with a prefit "classifier" that returns fixed
probabilities, so both sides see the same numbers. What agrees, and is compared exactly (q̂ to
float64 rounding, the sets label for label):

- the split-conformal threshold: the ⌈(n + 1)(1 − α)⌉-th smallest calibration score;
- THR / LAC: scores 1 − p_y, q̂ and the sets {y : 1 − p_y ≤ q̂} (dbsn with
  ``allow_empty_sets=True``: MAPIE's LAC never adds a label; dbsn's default adds the top label
  to a set that would be empty, which is checked as exactly that difference);
- randomised APS: MAPIE always randomises the calibration scores, ``cumsum_y − U·p_y`` with U
  from ``RandomState(random_state).uniform``, and its ``include_last_label="randomized"`` sets
  keep the crossing label where ``V ≤ U`` with the same draws; dbsn's scores are
  ``mass before y + u·p_y``, the same with ``u = 1 − U``, which is how the draws are matched;
- non-randomised APS sets at a given q̂: MAPIE's ``include_last_label=False`` is dbsn's rule
  (never empty: the top label alone where the rule leaves nothing); MAPIE's default ``True``
  adds the label whose mass crosses q̂ (the authors' convention), i.e. {y : mass before y ≤ q̂},
  which dbsn does not use, on purpose (its sets are exactly {y : s ≤ q̂});
- RAPS's penalised score at a given k_reg, λ and u. How k_reg and λ are tuned differs on
  purpose: MAPIE holds out a stratified 20 % and takes k* as the split-conformal order statistic
  of the true labels' ranks; dbsn follows the authors' code (a random 30 %, numpy's 'higher'
  quantile of the ranks). The score is compared, and the sets at given k_reg, λ and q̂:
  non-randomised exactly; randomised where MAPIE's crossing label L has rank ≤ k_reg + 1, since
  MAPIE divides its tie-breaking V by p_L − λ(L − k)⁺ + λ·1[L > k] where dbsn (the level set of
  its score, as the authors' ``gcq``) divides by p_L.

MAPIE includes a label when its score is within 1e-8 above q̂ (its EPSILON); with continuous
random probabilities no test score falls in that band, which the tests assert.

TorchCP is not among the oracles: its dependency torchsort is an sdist compiled against torch at
install time (and it pulls transformers and torch_geometric), too heavy for a test-only extra.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mapie", reason="MAPIE is not installed (pip install -e '.[oracles]')")

from mapie.classification import SplitConformalClassifier  # noqa: E402
from mapie.conformity_scores import RAPSConformityScore  # noqa: E402
from mapie.utils import _compute_classification_quantile  # noqa: E402
from sklearn.base import BaseEstimator, ClassifierMixin  # noqa: E402

from dbsn.metrics import conformal as cf  # noqa: E402

C, N_CAL, N_TEST = 10, 500, 400
ALPHAS = (0.05, 0.1, 0.2)
SEED = 3


class _Fixed(ClassifierMixin, BaseEstimator):
    """A fitted classifier whose `predict_proba` of X = [[i], ...] is row i of `probs`."""

    def __init__(self, probs=None):
        self.probs = probs

    def fit(self, X, y):
        return self

    def predict_proba(self, X):
        return self.probs[np.asarray(X)[:, 0].astype(int)]

    def predict(self, X):
        return self.predict_proba(X).argmax(1)


@pytest.fixture(scope="module")
def data():
    """Probabilities of a spread of confidences (N_CAL + N_TEST, C), labels drawn from them."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(N_CAL + N_TEST, C)) * rng.uniform(0.5, 3, size=(N_CAL + N_TEST, 1))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = np.array([rng.choice(C, p=p) for p in probs])
    estimator = _Fixed(probs)
    estimator.classes_ = np.arange(C)
    return probs, labels, estimator


def _mapie(estimator, labels, alpha, score):
    index = np.arange(N_CAL + N_TEST)[:, None]
    model = SplitConformalClassifier(
        estimator, confidence_level=1 - alpha, conformity_score=score, prefit=True, random_state=SEED
    )
    return model.conformalize(index[:N_CAL], labels[:N_CAL]), index[N_CAL:]


def _sets(model, test, **params):
    _, sets = model.predict_set(test, conformity_score_params=params or None)
    return sets[:, :, 0], float(model._mapie_classifier.conformity_score_function_.quantiles_[0])


def _clear_of_epsilon(scores: torch.Tensor, qhat: float) -> None:
    """No score within MAPIE's 1e-8 inclusion band above q̂ (else the two rules may differ there)."""
    assert not ((scores > qhat) & (scores <= qhat + 1e-8)).any()


def test_conformal_quantile_equals_mapie():
    """The ⌈(n + 1)(1 − α)⌉-th smallest score, with ties and at levels where (n + 1)(1 − α) is an
    integer, for every n where that rank is at most n."""
    g = torch.Generator().manual_seed(1)
    for n in (19, 20, 99, 100, 257, 1000):
        scores = torch.rand(n, generator=g, dtype=torch.float64)
        scores[: n // 4] = scores[n // 4 : 2 * (n // 4)]  # ties
        for alpha in (0.01, 0.05, 0.1, 0.2, 0.5):
            if cf.quantile_rank(n, alpha) > n:
                continue
            theirs = _compute_classification_quantile(scores.numpy(), np.array([alpha]))[0]
            assert cf.conformal_quantile(scores, alpha) == theirs, (n, alpha)


@pytest.mark.parametrize("alpha", ALPHAS + (0.5,))
def test_lac_threshold_and_sets_equal_mapie(data, alpha):
    probs, labels, estimator = data
    model, test = _mapie(estimator, labels, alpha, "lac")
    theirs, qhat = _sets(model, test)
    p_cal, p_test = torch.from_numpy(probs[:N_CAL]), torch.from_numpy(probs[N_CAL:])
    ours = cf.calibrate(p_cal, torch.from_numpy(labels[:N_CAL]), "thr", alpha, allow_empty_sets=True)
    assert ours.qhat == qhat
    _clear_of_epsilon(cf.thr_scores(p_test), qhat)
    bare = ours.sets(p_test).numpy()
    np.testing.assert_array_equal(bare, theirs)
    # dbsn's default: MAPIE's set, plus the top label where MAPIE's is empty
    default = cf.calibrate(p_cal, torch.from_numpy(labels[:N_CAL]), "thr", alpha).sets(p_test).numpy()
    expected = theirs.copy()
    empty = ~theirs.any(1)
    assert empty.any() or alpha < 0.5  # at 1 − α = 50 % some LAC sets are empty: the convention is tested
    expected[empty, probs[N_CAL:][empty].argmax(1)] = True
    np.testing.assert_array_equal(default, expected)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_randomized_aps_equals_mapie_with_the_same_draws(data, alpha):
    """MAPIE's U and dbsn's u = 1 − U: the same calibration scores (to float64 rounding), q̂ and
    sets (MAPIE's ``include_last_label="randomized"``, which draws the same U again)."""
    probs, labels, estimator = data
    model, test = _mapie(estimator, labels, alpha, "aps")
    theirs, qhat = _sets(model, test, include_last_label="randomized")
    u_cal = torch.from_numpy(1 - np.random.RandomState(SEED).uniform(size=N_CAL))
    u_test = torch.from_numpy(1 - np.random.RandomState(SEED).uniform(size=N_TEST))
    p_cal, p_test = torch.from_numpy(probs[:N_CAL]), torch.from_numpy(probs[N_CAL:])
    y_cal = torch.from_numpy(labels[:N_CAL])
    own = cf.conformity_scores(p_cal, "aps_randomized", u_cal).gather(1, y_cal[:, None]).squeeze(1)
    np.testing.assert_allclose(own.numpy(), model.conformity_scores.ravel(), rtol=0, atol=1e-15)
    assert cf.conformal_quantile(own, alpha) == pytest.approx(qhat, abs=1e-15)
    scores = cf.conformity_scores(p_test, "aps_randomized", u_test)
    _clear_of_epsilon(scores, qhat)
    np.testing.assert_array_equal(cf.prediction_sets(scores, qhat).numpy(), theirs)


@pytest.mark.parametrize("alpha", ALPHAS + (0.5,))
def test_aps_sets_at_a_given_threshold_equal_mapie(data, alpha):
    """Non-randomised APS at MAPIE's q̂: ``include_last_label=False`` is dbsn's default set;
    ``True`` is {y : mass before y ≤ q̂}, the authors' convention (one label more), not dbsn's."""
    probs, labels, estimator = data
    model, test = _mapie(estimator, labels, alpha, "aps")
    without_last, qhat = _sets(model, test, include_last_label=False)
    with_last, _ = _sets(model, test, include_last_label=True)
    p_test = torch.from_numpy(probs[N_CAL:])
    scores = cf.conformity_scores(p_test, "aps")
    _clear_of_epsilon(scores, qhat)
    np.testing.assert_array_equal(cf.prediction_sets(scores, qhat, cf.top_labels(p_test)).numpy(), without_last)
    np.testing.assert_array_equal(cf.prediction_sets(scores - p_test, qhat).numpy(), with_last)


def test_raps_score_equals_mapie_at_given_k_reg_and_lambda(data):
    """λ·max(0, rank_y − k_reg) on top of randomised APS, rank 1-based: MAPIE's
    ``_regularize_conformity_score`` of its own APS scores and true-label ranks (``cutoff``)."""
    probs, labels, estimator = data
    model, _ = _mapie(estimator, labels, 0.1, "aps")
    aps = model._mapie_classifier.conformity_score_function_
    u = torch.from_numpy(1 - np.random.RandomState(SEED).uniform(size=N_CAL))
    p_cal, y_cal = torch.from_numpy(probs[:N_CAL]), torch.from_numpy(labels[:N_CAL])
    for k_reg, lam in ((1, 0.01), (2, 0.1), (4, 0.5)):
        theirs = RAPSConformityScore._regularize_conformity_score(
            np.array([k_reg]), lam, model.conformity_scores.reshape(-1, 1), aps.cutoff
        )[:, 0, 0]
        ours = cf.conformity_scores(p_cal, "raps_randomized", u, k_reg, lam).gather(1, y_cal[:, None]).squeeze(1)
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=1e-15)
        _, ranks = cf.label_ranks(p_cal)
        np.testing.assert_array_equal(ranks.gather(1, y_cal[:, None]).squeeze(1).numpy(), aps.cutoff)


@pytest.mark.parametrize(("k_reg", "lam", "qhat"), [(1, 0.01, 0.9), (2, 0.1, 0.95), (1, 0.05, 0.8)])
def test_raps_sets_at_given_parameters_equal_mapie(data, k_reg, lam, qhat):
    """RAPS sets at a given k_reg, λ and q̂ (MAPIE's `RAPSConformityScore` with those set).
    Non-randomised: MAPIE's ``include_last_label=False`` is dbsn's default set, exactly.
    Randomised (u = 1 − U as for APS): MAPIE keeps the label L whose penalised mass crosses q̂
    where (mass to L + λ(L − k)⁺ − q̂) / d ≤ U with d = p_L − λ(L − k)⁺ + λ·1[L > k]; dbsn's set,
    the level set of its calibration score as in the authors' code (`gcq`), divides by p_L. The
    two d agree where L ≤ k_reg + 1, and the sets are compared on those rows; elsewhere they differ
    on purpose (dbsn keeps the authors' rule)."""
    probs, _, _ = data
    p_test = torch.from_numpy(probs[N_CAL:])
    score = RAPSConformityScore()
    score.random_state, score.classes = SEED, np.arange(C)
    score.k_star, score.lambda_star, score.quantiles_ = np.array([k_reg]), lam, np.array([qhat])

    def mapie_sets(include_last_label):
        return score.get_prediction_sets(
            probs[N_CAL:, :, None], np.zeros((1, 1)), np.array([0.1]), "prefit", include_last_label=include_last_label
        )[:, :, 0]

    fixed = cf.conformity_scores(p_test, "raps", None, k_reg, lam)
    _clear_of_epsilon(fixed, qhat)
    np.testing.assert_array_equal(cf.prediction_sets(fixed, qhat, cf.top_labels(p_test)).numpy(), mapie_sets(False))
    u = torch.from_numpy(1 - np.random.RandomState(SEED).uniform(size=N_TEST))
    ours = cf.prediction_sets(cf.conformity_scores(p_test, "raps_randomized", u, k_reg, lam), qhat).numpy()
    last = (fixed < qhat).sum(1).numpy() + 1  # MAPIE's L: the first rank whose penalised mass reaches q̂
    agree = last <= k_reg + 1
    assert agree.sum() > 50
    np.testing.assert_array_equal(ours[agree], mapie_sets("randomized")[agree])
