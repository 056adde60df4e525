"""Classification metrics for a predictive distribution: error, NLL, Brier score and ECE.

The functions are plain reference implementations on a whole tensor of predictions.
:class:`ClassificationMetrics` accumulates the same four numbers over batches with
torchmetrics states, so they are synchronised across processes under DDP.

Binning convention (ECE and reliability bins): :func:`dbsn.metrics.binning.bin_index`. Bins
have equal width on [0, 1] and are closed on the left, ``[b / M, (b + 1) / M)``, the last one
closed on both sides so that a confidence of exactly 1 falls in it (Guo et al., 2017). The ECE
and the reliability diagram use the same bins, so the ECE is the diagram's count-weighted gap.
torchmetrics' ``MulticlassCalibrationError`` gives a confidence of exactly 1 a bin of its own;
the logged ``ece`` is therefore computed here, not by torchmetrics.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

from dbsn.metrics.binning import bin_edges, bin_index

__all__ = [
    "BinnedCalibrationError",
    "ClassificationMetrics",
    "UncertaintyMetrics",
    "brier_score",
    "error_rate",
    "expected_calibration_error",
    "negative_log_likelihood",
    "reliability_bins",
]


def error_rate(probs: Tensor, target: Tensor) -> Tensor:
    """Fraction of examples whose most probable class (argmax, first on ties) is wrong."""
    return (probs.argmax(dim=1) != target).to(probs.dtype).mean()


def _per_example_nll(log_probs: Tensor, target: Tensor) -> Tensor:
    """``-log p(y_i | x_i)`` for each example, shape (N,)."""
    return -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)


def negative_log_likelihood(log_probs: Tensor, target: Tensor) -> Tensor:
    """Mean negative log-likelihood of the targets, ``-1/N sum_i log p(y_i | x_i)``."""
    return _per_example_nll(log_probs, target).mean()


def _per_example_brier(probs: Tensor, target: Tensor) -> Tensor:
    """``sum_c (p_ic - 1[y_i = c])^2`` for each example, shape (N,)."""
    one_hot = nn.functional.one_hot(target, probs.shape[1]).to(probs.dtype)
    return (probs - one_hot).pow(2).sum(dim=1)


def brier_score(probs: Tensor, target: Tensor) -> Tensor:
    """Multi-class Brier score (Brier, 1950): mean over examples of the squared distance
    between the predicted distribution and the one-hot target, summed over classes.

    It ranges from 0 (certain and right) to 2 (certain and wrong); it is *not* divided by
    the number of classes.
    """
    return _per_example_brier(probs, target).mean()


def _confidence_and_correct(probs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Top-label confidence ``max_c p_c`` and whether the argmax is right (as 0./1.)."""
    confidence, prediction = probs.max(dim=1)
    return confidence, (prediction == target).to(probs.dtype)


def expected_calibration_error(probs: Tensor, target: Tensor, n_bins: int = 15) -> Tensor:
    """Expected calibration error (Guo et al., 2017, eq. 3) of the top-label confidence.

    ``ECE = sum_b |B_b| / N * |acc(B_b) - conf(B_b)|`` over ``n_bins`` equal-width bins
    ``[b / M, (b + 1) / M)``, the last one ``[(M - 1) / M, 1]`` holding a confidence of exactly 1
    (`dbsn.metrics.binning`): the bins of :func:`reliability_bins` and the reliability diagram.
    """
    confidence, correct = _confidence_and_correct(probs, target)
    index = bin_index(confidence, n_bins)
    # |B_b|/N * |acc(B_b) - conf(B_b)| = |sum over B_b of (correct - confidence)| / N
    gap = torch.zeros(n_bins, dtype=confidence.dtype, device=confidence.device)
    gap.index_add_(0, index, correct - confidence)
    return gap.abs().sum() / confidence.numel()


def reliability_bins(probs: Tensor, target: Tensor, n_bins: int = 10) -> dict[str, Tensor]:
    """Per-bin statistics for a reliability diagram.

    Returns a dict of tensors of shape (n_bins,): ``lower`` and ``upper`` bin edges, the
    mean ``confidence`` and the ``accuracy`` of the examples in each bin (``nan`` where a
    bin is empty) and their ``count`` (int64, summing to N). Bins are ``[lower, upper)``;
    the last one also holds confidences of exactly 1: the bins of :func:`expected_calibration_error`.
    """
    confidence, correct = _confidence_and_correct(probs, target)
    edges = bin_edges(n_bins, confidence)
    index = bin_index(confidence, n_bins)
    count = torch.zeros(n_bins, dtype=torch.long, device=confidence.device)
    count.index_add_(0, index, torch.ones_like(index))
    sum_conf = torch.zeros(n_bins, dtype=confidence.dtype, device=confidence.device)
    sum_correct = torch.zeros_like(sum_conf)
    sum_conf.index_add_(0, index, confidence)
    sum_correct.index_add_(0, index, correct)
    # 0 / 0 gives nan for empty bins, which is what we want.
    return {
        "lower": edges[:-1],
        "upper": edges[1:],
        "confidence": sum_conf / count,
        "accuracy": sum_correct / count,
        "count": count,
    }


class BinnedCalibrationError(Metric):
    """The top-label ECE of :func:`expected_calibration_error` accumulated over batches.

    States: the sum of ``correct - confidence`` in each bin and the number of examples, both
    summed across processes; ``compute()`` is ``sum_b |gap_b| / N``.
    """

    full_state_update = False

    def __init__(self, n_bins: int = 15, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_bins = n_bins
        self.add_state("gap", default=torch.zeros(n_bins, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add a batch of probabilities (N, C) and targets (N,)."""
        confidence, correct = _confidence_and_correct(probs, target)
        self.gap.index_add_(0, bin_index(confidence, self.n_bins), (correct - confidence).double())
        self.total += confidence.numel()

    def compute(self) -> Tensor:
        return (self.gap.abs().sum() / self.total).float()


class ClassificationMetrics(nn.Module):
    """Stable-named metrics of a predictive distribution, accumulated over batches.

    ``update(log_probs, target)`` takes the log-probabilities of the predictive
    distribution (for a Bayes ensemble, the log of the averaged probabilities) and the
    integer targets; ``compute()`` returns ``{"error", "nll", "brier", "ece"}`` and
    ``reset()`` starts over. Each entry is a torchmetrics metric, so the states are
    synchronised across processes on ``compute()`` and move with the module's device:

    * ``error`` is ``1 - MulticlassAccuracy(average="micro")``;
    * ``nll`` and ``brier`` are ``MeanMetric`` of the per-example values;
    * ``ece`` is :class:`BinnedCalibrationError` with ``ece_bins`` bins (the bins of
      :func:`expected_calibration_error`).

    They agree with the functions of this module on the concatenated batches.
    """

    def __init__(self, num_classes: int, ece_bins: int = 15) -> None:
        super().__init__()
        self.accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        # nan_strategy="disable": a NaN prediction should show up in the result, not be dropped.
        self.nll = MeanMetric(nan_strategy="disable")
        self.brier = MeanMetric(nan_strategy="disable")
        self.ece = BinnedCalibrationError(n_bins=ece_bins)

    def update(self, log_probs: Tensor, target: Tensor) -> None:
        """Add a batch of predictive log-probabilities (N, C) and targets (N,)."""
        probs = log_probs.exp()
        self.accuracy.update(probs, target)
        self.nll.update(_per_example_nll(log_probs, target))
        self.brier.update(_per_example_brier(probs, target))
        self.ece.update(probs, target)

    def compute(self) -> dict[str, Tensor]:
        """The four metrics over everything seen since the last reset."""
        return {
            "error": 1 - self.accuracy.compute(),
            "nll": self.nll.compute(),
            "brier": self.brier.compute(),
            "ece": self.ece.compute(),
        }

    def reset(self) -> None:
        """Clear the accumulated states."""
        for metric in (self.accuracy, self.nll, self.brier, self.ece):
            metric.reset()


class UncertaintyMetrics(nn.Module):
    """Means over the test set of the uncertainty decomposition of a Bayes ensemble.

    ``update(scores)`` takes the per-example dict of
    :func:`dbsn.metrics.uncertainty.uncertainty_decomposition`; ``compute()`` returns the
    means of ``predictive_entropy`` (total), ``expected_entropy`` (aleatoric) and
    ``mutual_information`` (epistemic), in nats, synchronised across processes.
    """

    NAMES = ("predictive_entropy", "expected_entropy", "mutual_information")

    def __init__(self) -> None:
        super().__init__()
        self.means = nn.ModuleDict({name: MeanMetric(nan_strategy="disable") for name in self.NAMES})

    def update(self, scores: dict[str, Tensor]) -> None:
        for name, metric in self.means.items():
            metric.update(scores[name])

    def compute(self) -> dict[str, Tensor]:
        return {name: metric.compute() for name, metric in self.means.items()}

    def reset(self) -> None:
        for metric in self.means.values():
            metric.reset()
