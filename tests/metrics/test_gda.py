"""DDU's Gaussian discriminant analysis (dbsn.metrics.ood_scores.GDA): the fit is numpy's per-class mean and
covariance (ddof 1, as the authors' centered_cov_torch) with the class shares as priors; the density is the
closed form (scipy's multivariate normal, sklearn's GaussianMixture given the same components, the authors'
torch MultivariateNormal); the jitter is the first of the authors' list that makes every covariance positive
definite, 0 when none is needed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from scipy.stats import multivariate_normal
from sklearn.mixture import GaussianMixture

from dbsn.metrics.ood_scores import GDA, GDA_CHUNK_ELEMENTS, GDA_JITTERS


def _classes(seed: int = 0, d: int = 4, counts=(30, 12, 20)):
    """Features (N, d) of len(counts) classes of different sizes (so that the priors matter), each with its
    own mean and covariance, and queries near and far from them."""
    rng = np.random.default_rng(seed)
    features, labels = [], []
    for c, n in enumerate(counts):
        mixing = rng.normal(size=(d, d)) * rng.uniform(0.3, 2.0)
        features.append(rng.normal(size=(n, d)) @ mixing + 4 * rng.normal(size=d))
        labels.append(np.full(n, c))
    queries = np.concatenate([features[0][:3] + 0.1, rng.normal(size=(5, d)) * 6])
    return np.concatenate(features), np.concatenate(labels), queries


def _numpy_fit(features, labels, c):
    means = np.stack([features[labels == k].mean(0) for k in range(c)])
    covariances = np.stack([np.cov(features[labels == k], rowvar=False) for k in range(c)])  # ddof = 1
    priors = np.bincount(labels, minlength=c) / len(labels)
    return means, covariances, priors


def test_the_fit_is_numpys_class_means_and_covariances_with_ddof_one():
    features, labels, _ = _classes()
    fitted = GDA().fit(torch.from_numpy(features), torch.from_numpy(labels), 3)
    means, covariances, priors = _numpy_fit(features, labels, 3)
    np.testing.assert_allclose(fitted.class_means.numpy(), means, rtol=1e-12, atol=1e-12)
    factors = fitted.scale_tril.numpy()
    np.testing.assert_allclose(factors @ factors.transpose(0, 2, 1), covariances, rtol=1e-11, atol=1e-12)
    assert np.allclose(np.triu(factors, k=1), 0)  # lower Cholesky factors
    np.testing.assert_allclose(fitted.log_priors.exp().numpy(), priors, rtol=1e-14)
    assert fitted.jitter.item() == 0.0  # every covariance positive definite: no jitter
    # ddof = 1 is not ddof = 0: the fit would be off by N_c / (N_c - 1)
    biased = np.cov(features[labels == 1], rowvar=False, ddof=0)
    assert not np.allclose(factors[1] @ factors[1].T, biased, rtol=1e-3)


@pytest.mark.parametrize("chunk", [None, 1, 4])
def test_the_density_is_scipys_closed_form(chunk):
    """log q(z) = logsumexp_c [log π_c + log N(z; μ_c, Σ_c)] by scipy's multivariate normal, the class
    log-likelihoods one by one, in blocks of any size; the score is its negative."""
    features, labels, queries = _classes(1)
    means, covariances, priors = _numpy_fit(features, labels, 3)
    by_class = np.stack([multivariate_normal(means[k], covariances[k]).logpdf(queries) for k in range(3)], axis=1)
    expected = logsumexp(by_class + np.log(priors), axis=1)
    fitted = GDA(chunk=chunk).fit(torch.from_numpy(features), torch.from_numpy(labels), 3)
    z = torch.from_numpy(queries)
    np.testing.assert_allclose(fitted.class_log_likelihoods(z).numpy(), by_class, rtol=1e-10)
    np.testing.assert_allclose(fitted.log_density(z).numpy(), expected, rtol=1e-10)
    assert torch.equal(fitted.score(z), -fitted.log_density(z)) and torch.equal(fitted(z), fitted.score(z))
    assert fitted.score(z)[:3].max() < fitted.score(z)[3:].min()  # near the first class: less OOD than far away


def test_the_density_is_sklearns_gaussian_mixture_with_the_same_components():
    """sklearn's GaussianMixture given the fit's weights, means and covariances (its precision factors
    as its fit would set them) scores every query with the same log-likelihood."""
    features, labels, queries = _classes(2, d=5, counts=(25, 40, 15, 30))
    means, covariances, priors = _numpy_fit(features, labels, 4)
    mixture = GaussianMixture(n_components=4, covariance_type="full")
    mixture.weights_, mixture.means_, mixture.covariances_ = priors, means, covariances
    mixture.precisions_cholesky_ = np.stack([np.linalg.inv(np.linalg.cholesky(s)).T for s in covariances])
    fitted = GDA().fit(torch.from_numpy(features), torch.from_numpy(labels), 4)
    np.testing.assert_allclose(
        fitted.log_density(torch.from_numpy(queries)).numpy(), mixture.score_samples(queries), rtol=1e-10
    )


def _authors_fit(features: torch.Tensor, labels: torch.Tensor, c: int):
    """The authors' gmm_fit as their utils/gmm_utils.py runs it (torch.mean, their centered covariance,
    MultivariateNormal for each jitter in turn until one constructs), the identity in float64."""
    means = torch.stack([features[labels == k].mean(0) for k in range(c)])
    covariances = torch.stack(
        [(lambda x: 1 / (len(x) - 1) * x.T @ x)(features[labels == k] - means[k]) for k in range(c)]
    )
    for jitter in GDA_JITTERS:
        try:
            eye = torch.eye(covariances.shape[1], dtype=torch.float64)
            return torch.distributions.MultivariateNormal(means, covariance_matrix=covariances + jitter * eye), jitter
        except (RuntimeError, ValueError):
            continue
    raise AssertionError("no jitter")


@pytest.mark.parametrize("case", ["full rank", "fewer images than features", "a feature constant in a class"])
def test_the_jitter_is_the_first_of_the_authors_list_that_works_and_only_when_needed(case):
    rng = np.random.default_rng(3)
    d = 6
    counts = (4, 30) if case == "fewer images than features" else (20, 30)
    features = np.concatenate([rng.normal(size=(n, d)) * 2 + 5 * c for c, n in enumerate(counts)])
    labels = np.repeat(np.arange(2), counts)
    if case == "a feature constant in a class":
        features[labels == 0, 2] = 1.5  # class 0 never varies along feature 2: its covariance is singular
    z, y = torch.from_numpy(features), torch.from_numpy(labels)
    fitted = GDA().fit(z, y, 2)
    reference, jitter = _authors_fit(z, y, 2)
    assert fitted.jitter.item() == jitter
    if case == "full rank":
        assert jitter == 0.0
    if case == "a feature constant in a class":  # needed: without it class 0's covariance has no Cholesky factor
        assert jitter == torch.finfo(torch.float64).tiny  # the zero variance is the only obstacle
        covariance = torch.from_numpy(np.cov(features[labels == 0], rowvar=False))
        assert torch.linalg.cholesky_ex(covariance).info == 3  # its leading minor of order 3 (feature 2) is 0
    # with fewer images than features the covariance is singular but for its rounding, which decides: the
    # same as the authors' either way (their arithmetic to the last bit)
    queries = z[::3] + 0.01 * torch.from_numpy(rng.normal(size=(len(z[::3]), d)))
    if case == "a feature constant in a class":
        queries[:, 2] = 1.5  # off the constant, class 0's density is 0 in float64
    expected = reference.log_prob(queries[:, None, :])  # (N, C): their gmm_evaluate
    torch.testing.assert_close(fitted.class_log_likelihoods(queries), expected, rtol=1e-10, atol=1e-8)
    torch.testing.assert_close(
        fitted.log_density(queries), torch.logsumexp(expected + fitted.log_priors, 1), rtol=1e-10, atol=1e-8
    )


def test_a_feature_off_a_constant_direction_has_density_zero():
    """Where a class never varied along a feature, a query off that value is infinitely far for it: with
    the smallest jitter its log-likelihood is below float64's range (-inf), the other class's stays finite."""
    rng = np.random.default_rng(4)
    features = np.concatenate([rng.normal(size=(20, 3)), rng.normal(size=(20, 3)) + 3])
    features[:20, 0] = 0.0
    labels = np.repeat(np.arange(2), 20)
    fitted = GDA().fit(torch.from_numpy(features), torch.from_numpy(labels), 2)
    query = torch.tensor([[5.0, 0.0, 0.0]], dtype=torch.float64)
    by_class = fitted.class_log_likelihoods(query)
    assert by_class[0, 0] == -math.inf and torch.isfinite(by_class[0, 1])
    assert torch.isfinite(fitted.score(query)).all()


def test_float32_features_fit_and_score_in_float64():
    features, labels, queries = _classes(5)
    fitted = GDA().fit(torch.from_numpy(features).float(), torch.from_numpy(labels), 3)
    assert fitted.scale_tril.dtype == fitted.class_means.dtype == torch.float64
    scores = fitted.score(torch.from_numpy(queries).float())
    assert scores.dtype == torch.float64
    exact = GDA().fit(torch.from_numpy(features), torch.from_numpy(labels), 3).score(torch.from_numpy(queries))
    torch.testing.assert_close(scores, exact, rtol=1e-5, atol=1e-5)


def test_refusals_and_the_memory_budget():
    features, labels, _ = _classes(6)
    z, y = torch.from_numpy(features), torch.from_numpy(labels)
    with pytest.raises(RuntimeError, match="not fitted"):
        GDA().score(z)
    with pytest.raises(ValueError, match=r"classes \[3\] have no training features"):
        GDA().fit(z, y, 4)
    lonely = torch.cat([y[:-1], torch.tensor([3])])
    with pytest.raises(ValueError, match=r"classes \[3\] have one training feature: a class covariance needs two"):
        GDA().fit(z, lonely, 4)
    with pytest.raises(ValueError, match="no jitter up to 0.1 makes every class covariance positive definite"):
        GDA().fit(torch.where(y[:, None] == 0, torch.nan, z), y, 3)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        GDA(chunk=0)
    fitted = GDA().fit(z, y, 3)
    with pytest.raises(ValueError, match="the fit had D = 4"):
        fitted.score(z[:, :3])
    cifar = GDA()
    cifar.class_means = torch.zeros(100, 640, dtype=torch.float64)  # CIFAR-100 on WideResNet-28-10's features
    assert cifar.query_chunk == GDA_CHUNK_ELEMENTS // (100 * 640) == 262
