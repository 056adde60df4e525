"""Histogram binning (Zadrozny & Elkan, ICML 2001; multi-class as in Guo et al., ICML 2017, §4.1),
`posthoc=histogram_binning`.

One-vs-rest for every class c: p_c falls in one of M equal-width bins [m/M, (m+1)/M) (p_c = 1 in
the last), and q_c is the fraction of the validation examples in that bin whose label is c. A bin
no validation example fell in keeps its centre (m + ½)/M: with no evidence the map stays near the
identity there (Guo et al.'s code, `HistogramBinning` in dirichletcal/experiments_dnn
scripts/calibration/cal_methods.py, gives such a bin 0, which a test example landing there would
pay for with the floor). Then the q_c are floored and renormalised to sum to one
(`OneVsRestCalibrator`). May change the predicted class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dbsn.posthoc.calibrators.base import FLOOR, OneVsRestCalibrator

__all__ = ["HistogramBinning"]


class HistogramBinning(OneVsRestCalibrator):
    """One-vs-rest histogram binning with `bins` equal-width bins per class, renormalised.

    Args:
        bins: M, equal-width bins per class (Guo et al. 2017: 15).
        floor: the least probability before renormalising.
    """

    name = "histogram_binning"

    def __init__(self, bins: int = 15, floor: float = FLOOR) -> None:
        super().__init__(floor)
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        self.bins = int(bins)
        edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
        self.register_buffer("inner_edges", edges[1:-1].clone())  # bin m: [m/M, (m+1)/M), p = 1 in the last
        self.register_buffer("centres", (edges[:-1] + edges[1:]) / 2)
        self.register_buffer("values", torch.empty(0, bins, dtype=torch.float64))  # (C, M) once fitted

    def label(self) -> str:
        return f"Histogram binning ({self.bins} bins)"

    def bin_index(self, probs: Tensor) -> Tensor:
        """Each probability's bin, 0 .. M − 1, in the shape of `probs`."""
        return torch.bucketize(probs, self.inner_edges.to(probs.dtype), right=True)

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        index = self.bin_index(log_probs.exp()).T  # (C, N)
        positive = F.one_hot(targets, self.num_classes).T.to(torch.float64)
        counts = torch.zeros(self.num_classes, self.bins, dtype=torch.float64).scatter_add_(
            1, index, torch.ones_like(positive)
        )
        positives = torch.zeros_like(counts).scatter_add_(1, index, positive)
        self.values = torch.where(counts > 0, positives / counts.clamp_min(1), self.centres.expand_as(counts))

    def class_probabilities(self, log_probs: Tensor) -> Tensor:
        flat = log_probs.reshape(-1, self.num_classes)
        return self.values.T.gather(0, self.bin_index(flat.exp())).view_as(log_probs)  # values[c, bin of p_c]

    def settings(self) -> dict:
        return {"calibrator_bins": self.bins, **super().settings()}
