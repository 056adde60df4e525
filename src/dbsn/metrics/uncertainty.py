"""Predictive entropy and its decomposition into aleatoric and epistemic parts.

Everything here works on log-probabilities in natural log, so entropies are in nats. The
members of a Bayes ensemble (S Monte Carlo samples of the weights, or of the structure and
the weights) are given as a tensor of shape (S, N, C): S members, N examples, C classes.
The predictive distribution is the average of the members' probabilities,
``p(y | x) = 1/S sum_s p_s(y | x)``, and

    H[p]  =  1/S sum_s H[p_s]  +  ( H[p] - 1/S sum_s H[p_s] )
    total =  aleatoric (expected entropy)  +  epistemic (mutual information, BALD)

(Depeweg et al., 2018; Houlsby et al., 2011 for BALD). The mutual information between the
label and the sampled model is ≥ 0 because entropy is concave (Jensen's inequality); it is
0 exactly when all members agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "decomposition_of",
    "detection_scores",
    "ensemble_log_probs",
    "entropy",
    "ood_scores",
    "uncertainty_decomposition",
]


def entropy(log_probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy ``H[p] = -sum_c p_c log p_c`` (nats) along ``dim``, with ``0 log 0 = 0``.

    A class of probability exactly 0 (``log_prob = -inf``) contributes 0, so the result is
    finite, and so is its gradient: ``-inf`` is replaced by the most negative finite float
    before the product with ``p = 0``, instead of computing ``0 * -inf = nan``. NaNs in the
    input still come out as NaN.
    """
    finite_log_probs = log_probs.clamp(min=torch.finfo(log_probs.dtype).min)
    return (log_probs.exp() * -finite_log_probs).sum(dim=dim)


def _check_members(member_log_probs: Tensor) -> None:
    if member_log_probs.ndim != 3 or member_log_probs.shape[0] == 0:
        raise ValueError(
            "expected member log-probabilities of shape (S, N, C) with S >= 1, "
            f"got shape {tuple(member_log_probs.shape)}"
        )


def ensemble_log_probs(member_log_probs: Tensor) -> Tensor:
    """Log of the averaged member probabilities: (S, N, C) → (N, C).

    ``log(1/S sum_s p_s) = logsumexp_s(log p_s) - log S``, computed without leaving log
    space, so members with tiny probabilities do not underflow.
    """
    _check_members(member_log_probs)
    return torch.logsumexp(member_log_probs, dim=0) - math.log(member_log_probs.shape[0])


def uncertainty_decomposition(member_log_probs: Tensor) -> dict[str, Tensor]:
    """Per-example uncertainty of an ensemble with members (S, N, C); each entry is (N,).

    * ``predictive_entropy``: ``H[1/S sum_s p_s]``, the total uncertainty;
    * ``expected_entropy``: ``1/S sum_s H[p_s]``, the aleatoric part;
    * ``mutual_information``: ``predictive_entropy - expected_entropy``, the epistemic part
      (BALD). It is ≥ 0 by Jensen's inequality; it is clamped at 0 so that float round-off
      cannot make it slightly negative, so the sum of the last two equals the first up to
      that round-off. With S = 1 it is exactly 0;
    * ``max_probability``: ``max_c`` of the averaged prediction, the confidence.
    """
    return decomposition_of(ensemble_log_probs(member_log_probs), entropy(member_log_probs).mean(dim=0))


def decomposition_of(log_probs: Tensor, expected_entropy: Tensor) -> dict[str, Tensor]:
    """`uncertainty_decomposition` from its two ingredients, the ensemble's log-probabilities
    (N, C) and the members' mean entropy (N,): what a prediction that streams over its members
    keeps instead of the members themselves."""
    total = entropy(log_probs)
    aleatoric = expected_entropy
    return {
        "predictive_entropy": total,
        "expected_entropy": aleatoric,
        "mutual_information": (total - aleatoric).clamp(min=0),
        "max_probability": log_probs.amax(dim=-1).exp(),
    }


def detection_scores(decomposition: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-example out-of-distribution scores (N,) from an `uncertainty_decomposition`.

    For every score, HIGHER means MORE likely out-of-distribution:

    * ``entropy``: the predictive entropy (the score of the DBSN paper);
    * ``mutual_information``: the epistemic part of it (BALD);
    * ``max_probability``: stored as ``1 - max_c p_c`` (one minus the confidence of the
      averaged prediction), not as the confidence itself, so that it points the same way.
    """
    return {
        "entropy": decomposition["predictive_entropy"],
        "mutual_information": decomposition["mutual_information"],
        "max_probability": 1 - decomposition["max_probability"],
    }


def ood_scores(member_log_probs: Tensor) -> dict[str, Tensor]:
    """`detection_scores` of the decomposition of members (S, N, C)."""
    return detection_scores(uncertainty_decomposition(member_log_probs))
