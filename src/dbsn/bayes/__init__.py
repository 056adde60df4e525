"""Bayesian layers: Bayes by Backprop's Gaussian weight posteriors (the BBB and FBN baselines),
SNGP's random-feature Gaussian-process output layer (`gp`) and the rank-1 BNN's factor
distributions (`rank1`)."""

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
from dbsn.bayes.rank1 import FactorDistribution

__all__ = [
    "BayesConv2d",
    "BayesLayer",
    "BayesLinear",
    "FactorDistribution",
    "RandomFeatureGaussianProcess",
    "bayesianize",
    "gaussian_kl",
    "kl_divergence",
    "mean_field_logits",
    "orthogonal_random_features",
    "set_sampling",
]
