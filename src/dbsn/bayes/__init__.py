"""Bayes by Backprop: Gaussian weight posteriors for the BBB and FBN baselines."""

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
    "bayesianize",
    "gaussian_kl",
    "kl_divergence",
    "set_sampling",
]
