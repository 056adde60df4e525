"""Calibration beyond the equal-width ECE: equal-mass (adaptive) ECE and classwise ECE.

The equal-width, top-label ECE (`dbsn.metrics.classification.expected_calibration_error`, logged
as ``ece``) follows the confidence axis, so a confident network's examples share one or two bins,
and it sees the top label only. Two complements:

* `adaptive_expected_calibration_error`: the same ECE over bins of equal numbers of examples
  ("AdaECE", Mukhoti et al. 2020; "ECE_EM", Roelofs et al. 2022). The example of rank r of N goes
  to bin ⌊r M / N⌋ (sizes differ by at most one; with N < M some bins are empty). A tie group
  that straddles a bin edge first takes the group's mean correctness, so the value never depends
  on the order examples are stored in.
* `classwise_expected_calibration_error`: the calibration of every class probability
  (classwise-ECE, Kull et al. 2019).

Both are implemented here (sort + ``index_add``) because the libraries' versions depend on storage
order or give a probability of exactly 1 a bin of its own (docs/evaluation.md, "Calibration and
selective prediction"). The classwise ECE and CE² use the logged ``ece``'s bins
(`dbsn.metrics.binning`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dbsn.metrics.binning import bin_index
from dbsn.metrics.classification import (
    _confidence_and_correct,
    expected_calibration_error,
)

__all__ = [
    "squared_calibration_error",
    "adaptive_expected_calibration_error",
    "calibration_metrics",
    "classwise_expected_calibration_error",
]


def _check_probs(probs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(N, C) probabilities in [0, 1] and (N,) integer targets; ValueError otherwise."""
    probs, target = torch.as_tensor(probs).detach(), torch.as_tensor(target).detach()
    if probs.ndim != 2 or target.shape != probs.shape[:1] or probs.shape[0] == 0:
        raise ValueError(
            f"need probs (N, C) and target (N,) with N > 0, got {tuple(probs.shape)} and {tuple(target.shape)}"
        )
    # torchmetrics would silently apply a sigmoid to everything if one value left [0, 1].
    if not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValueError("probs must be probabilities in [0, 1] (not logits or log-probabilities)")
    return probs, target


def adaptive_expected_calibration_error(probs: Tensor, target: Tensor, n_bins: int = 15) -> Tensor:
    """Top-label ECE over ``n_bins`` equal-mass bins (module docstring: bins and ties).

    ``sum_b |B_b| / N · |acc(B_b) - conf(B_b)|`` where each bin holds ``N / n_bins``
    examples up to one, taken in order of confidence. ``probs`` (N, C), ``target`` (N,).
    """
    probs, target = _check_probs(probs, target)
    confidence, correct = _confidence_and_correct(probs, target)
    n = confidence.numel()
    # torch.unique sorts: groups come in increasing confidence, so repeating each group's
    # value count times lists the examples in rank order, ties side by side.
    values, group, count = torch.unique(confidence, return_inverse=True, return_counts=True)
    group_correct = torch.zeros_like(values).index_add_(0, group, correct) / count
    ranked_gap = torch.repeat_interleave(group_correct - values, count)
    bin_index = torch.arange(n, device=confidence.device) * n_bins // n
    # |B_b|/N * |acc(B_b) - conf(B_b)| = |sum over B_b of (correct - confidence)| / N
    gap = torch.zeros(n_bins, dtype=confidence.dtype, device=confidence.device)
    gap.index_add_(0, bin_index, ranked_gap)
    return gap.abs().sum() / n


def squared_calibration_error(probs: Tensor, target: Tensor, n_bins: int = 15) -> Tensor:
    """The unbiased estimate of the squared top-label calibration error over equal-width bins.

    The quantity is ``CE² = Σ_b P(b) · (E[correct − confidence | b])²`` (the squared, L2 version
    of the ECE's binned gap). With ``d_i = correct_i − confidence_i``, bin b's ``n_b`` examples,
    ``S_b = Σ d_i`` and ``Q_b = Σ d_i²``, ``(S_b² − Q_b) / (n_b (n_b − 1))`` is the mean of
    ``d_i d_j`` over the pairs ``i ≠ j``: a U-statistic, unbiased for the bin's squared mean gap
    (Kumar, Liang & Ma 2019, "Verified uncertainty calibration", NeurIPS: the debiased estimator).
    Weighted by ``n_b / N``: ``Σ_b (S_b² − Q_b) / (n_b − 1) / N`` (bins of one example count
    nothing). It is 0 in expectation for a calibrated model, and can be negative.

    The plug-in ``Σ_b S_b² / (n_b N)`` (and the ECE, its L1 kin) is biased upward by ``Σ_b
    Var(d | b) / N``, more for a model whose confidences spread over more bins: two calibrated
    models then look differently calibrated, and a bootstrap interval around the plug-in misses
    the truth. Same bins as `expected_calibration_error`. ``probs`` (N, C), ``target`` (N,).
    """
    probs, target = _check_probs(probs, target)
    confidence, correct = _confidence_and_correct(probs, target)
    d = correct.double() - confidence.double()
    index = bin_index(confidence, n_bins).cpu()
    d = d.cpu()
    size = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, torch.ones_like(d))
    sums = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, d)
    squares = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, d**2)
    per_bin = torch.where(size > 1, (sums**2 - squares) / (size - 1).clamp_min(1), torch.zeros_like(size))
    return per_bin.sum() / d.numel()


def classwise_expected_calibration_error(probs: Tensor, target: Tensor, n_bins: int = 15) -> Tensor:
    """Classwise ECE (Kull et al., 2019): the mean over classes ``k`` of the ECE of ``p_k``.

    ``1/C sum_k sum_b |B_kb| / N · |freq_k(B_kb) - mean p_k(B_kb)|``, where ``B_kb`` are the
    examples whose ``p_k`` falls in equal-width bin ``b`` (`dbsn.metrics.binning`) and ``freq_k``
    the share of them whose label is ``k``. Every class counts, whether or not it is ever
    predicted. ``probs`` (N, C), ``target`` (N,).
    """
    probs, target = _check_probs(probs, target)
    columns = probs.T.contiguous()  # one contiguous row per class, as bucketize prefers
    per_class = []
    for k in range(probs.shape[1]):
        gap = torch.zeros(n_bins, dtype=torch.float64, device=probs.device)
        gap.index_add_(0, bin_index(columns[k], n_bins), (target == k).double() - columns[k].double())
        per_class.append(gap.abs().sum() / len(target))
    return torch.stack(per_class).mean().to(probs.dtype)


def calibration_metrics(probs: Tensor, target: Tensor, n_bins: int = 15) -> dict[str, float]:
    """The calibration errors under stable names (the caller adds ``test/`` etc.): ``ce2``, the
    unbiased squared calibration error (`squared_calibration_error`: the one to compare and put
    intervals on), and the three familiar plug-in ECEs, biased upward:

    ``ece``: equal-width top-label ECE, :func:`~dbsn.metrics.classification.expected_calibration_error`
    (the logged ``ece``, up to float rounding); ``adaptive_ece``:
    :func:`adaptive_expected_calibration_error`; ``classwise_ece``:
    :func:`classwise_expected_calibration_error`; all with ``n_bins`` bins.
    """
    probs, target = _check_probs(probs, target)
    return {
        "ce2": squared_calibration_error(probs, target, n_bins=n_bins).item(),
        "ece": expected_calibration_error(probs, target, n_bins=n_bins).item(),
        "adaptive_ece": adaptive_expected_calibration_error(probs, target, n_bins=n_bins).item(),
        "classwise_ece": classwise_expected_calibration_error(probs, target, n_bins=n_bins).item(),
    }
