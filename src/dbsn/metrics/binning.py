"""The one binning of every equal-width calibration metric and of the reliability diagram.

Convention (Guo et al., 2017, sec. 2; the reliability diagram of their fig. 1): ``M`` bins of
equal width on [0, 1], bin ``b`` (0-based) holding the confidences in ``[b / M, (b + 1) / M)``
(closed on the left, open on the right), and the last bin closed on both sides,
``[(M - 1) / M, 1]``, so a confidence of exactly 1 falls in it. The edges are
``torch.linspace(0, 1, M + 1)`` in the confidence's own dtype, so a confidence exactly on an edge
goes to the bin above it whatever the dtype.

The ECE, the classwise ECE, the unbiased CE² (and their resampled and inference versions), the
ECE logged during training and the reliability diagram all call :func:`bin_index`, so they put
every prediction in the same bin and the ECE is the diagram's weighted gap.

torchmetrics' ``calibration_error`` differs for a confidence of exactly 1: it gives it a bin of
its own (``bucketize(..., right=True)`` with no clamp), so its ECE differs from the one here when a
prediction has confidence 1.0 and is otherwise equal.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bin_edges", "bin_index"]


def bin_edges(n_bins: int, like: Tensor) -> Tensor:
    """The ``n_bins + 1`` equal-width edges on [0, 1], in ``like``'s dtype and device."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins}")
    return torch.linspace(0, 1, n_bins + 1, dtype=like.dtype, device=like.device)


def bin_index(confidence: Tensor, n_bins: int) -> Tensor:
    """The bin (``0 .. n_bins - 1``, int64) of each confidence in [0, 1] (module docstring):
    ``[b / M, (b + 1) / M)``, the last bin ``[(M - 1) / M, 1]`` holding a confidence of exactly 1."""
    index = torch.bucketize(confidence, bin_edges(n_bins, confidence), right=True) - 1
    return index.clamp(min=0, max=n_bins - 1)
