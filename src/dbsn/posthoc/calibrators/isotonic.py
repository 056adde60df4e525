"""Isotonic regression (Zadrozny & Elkan, KDD 2002; Guo et al., ICML 2017), `posthoc=isotonic`.

For every class c, scikit-learn's `IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1)`
fitted to (p_c, 1[y = c]), i.e. the non-decreasing map of p_c closest to the labels in squared
error; floored and renormalised (`OneVsRestCalibrator`). Its thresholds are kept as buffers and
applied on the device by the linear interpolation scikit-learn's `predict` does (scipy's
`interp1d`, inputs clipped to the fitted range). May change the predicted class.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dbsn.posthoc.calibrators.base import FLOOR, OneVsRestCalibrator

__all__ = ["IsotonicCalibration"]


class IsotonicCalibration(OneVsRestCalibrator):
    """One-vs-rest isotonic regression, renormalised: scikit-learn's per-class thresholds, padded
    to one length by repeating each class's last one, as buffers (C, K).

    Args:
        floor: the least probability before renormalising.
    """

    name = "isotonic"

    def __init__(self, floor: float = FLOOR) -> None:
        super().__init__(floor)
        self.register_buffer("x_thresholds", torch.empty(0, 2, dtype=torch.float64))  # (C, K) once fitted
        self.register_buffer("y_thresholds", torch.empty(0, 2, dtype=torch.float64))

    @staticmethod
    def regression(probs: np.ndarray, positive: np.ndarray):
        """scikit-learn's isotonic regression of one class's labels on its probabilities."""
        from sklearn.isotonic import IsotonicRegression

        return IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(probs, positive)

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        probs, labels = log_probs.exp().numpy(), targets.numpy()
        fits = [self.regression(probs[:, c], (labels == c).astype(np.float64)) for c in range(self.num_classes)]
        length = max(len(f.X_thresholds_) for f in fits)
        pad = lambda a: np.pad(np.asarray(a, dtype=np.float64), (0, length - len(a)), mode="edge")  # noqa: E731
        self.x_thresholds = torch.from_numpy(np.stack([pad(f.X_thresholds_) for f in fits]))
        self.y_thresholds = torch.from_numpy(np.stack([pad(f.y_thresholds_) for f in fits]))

    def class_probabilities(self, log_probs: Tensor) -> Tensor:
        """scipy's `interp1d(kind="linear")` on each class's thresholds, the input clipped to them
        first (`out_of_bounds="clip"`): searchsorted (left), index clipped to 1 .. K − 1, then
        slope · (x − x_lo) + y_lo, in that order of operations. A class with one threshold (all its
        validation probabilities equal) maps everything to its one value, as scikit-learn does."""
        xs, ys = self.x_thresholds, self.y_thresholds
        x = log_probs.reshape(-1, self.num_classes).exp().T.contiguous()  # (C, n)
        x = torch.minimum(torch.maximum(x, xs[:, :1]), xs[:, -1:])
        hi = torch.searchsorted(xs, x).clamp(min(1, xs.shape[1] - 1), xs.shape[1] - 1)
        lo = (hi - 1).clamp_min(0)
        x_lo, x_hi, y_lo, y_hi = xs.gather(1, lo), xs.gather(1, hi), ys.gather(1, lo), ys.gather(1, hi)
        slope = (y_hi - y_lo) / (x_hi - x_lo)
        return torch.where(x_hi > x_lo, slope * (x - x_lo) + y_lo, y_lo).T.reshape(log_probs.shape)

    def label(self) -> str:
        return "Isotonic regression"
