"""Bayesian layers: Bayes by Backprop's Gaussian weight posteriors (the BBB and FBN baselines) and
SNGP's random-feature Gaussian-process output layer (`gp`)."""

from dbsn.bayes.gp import RandomFeatureGaussianProcess, mean_field_logits, orthogonal_random_features
from dbsn.bayes.layers import (
    BayesConv2d,
    BayesLayer,
    BayesLinear,
    bayesianize,
    gaussian_kl,
    kl_divergence,
    set_sampling,
)

__all__ = [
    "BayesConv2d",
    "BayesLayer",
    "BayesLinear",
    "RandomFeatureGaussianProcess",
    "bayesianize",
    "gaussian_kl",
    "kl_divergence",
    "mean_field_logits",
    "orthogonal_random_features",
    "set_sampling",
]
