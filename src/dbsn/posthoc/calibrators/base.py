"""The door for a calibrator: a map from a classifier's predictive log-probabilities to calibrated
ones, fitted on the validation split of a finished run (`Calibrator`), and what the per-class maps
share (`OneVsRestCalibrator`, `floored_log`).

A calibrator says four things (a subclass of `Calibrator`, in a file of its own):

- `name`: a class attribute, the post-hoc posterior's name (`posthoc=<name>`, the folder
  `<run>/posthoc/<name>/`, the method `<run's method>+<name>` in reports);
- `__init__(settings)`: its settings, checked (a ValueError naming the key);
- `fit_map(log_probs, targets)`: set its state from float64 CPU log-probabilities (N, C) and
  labels (N,); keep tensors as buffers, so that they move with the method to its device;
- `transform(log_probs)`: calibrated log-probabilities of float64 log-probabilities (..., C), on
  the device of its buffers.

Optionally `preserves_argmax` (True when it can never change the predicted class), `check(C)`
(refuse settings that do not fit C classes, before the validation pass), `settings()` (recorded
with the facts) and `label()` (what the line printed after the fit calls it).

`Calibrator.fit` does the rest: checks the inputs, fits in float64 on the CPU (detached: nothing
reaches the model) and records `facts` (the validation NLL before and after and, for a map that
may move the argmax, the share of predicted classes it changed), which metrics.json holds beside
the test metrics. `forward` applies it in float64 and returns the input's dtype. Any calibrator
becomes a post-hoc posterior through `dbsn.posthoc.calibrators.posthoc.PosthocCalibration`, named by
its config (`conf/posthoc/<name>.yaml`); `docs/extending.md` shows one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FLOOR", "Calibrator", "OneVsRestCalibrator", "floored_log"]

#: What a zero probability of a per-class map is raised to before renormalising.
FLOOR = 1e-6


def floored_log(q: Tensor, floor: float) -> Tensor:
    """log of the per-class values q (..., C), each raised to at least `floor`, renormalised."""
    q = q.clamp_min(floor)
    return q.log() - q.sum(-1, keepdim=True).log()


class Calibrator(nn.Module):
    """A map from log-probabilities (..., C) to calibrated log-probabilities (see the module
    docstring); `fit` it on validation predictions first.

    Attributes:
        name: the calibrator's name (a class attribute).
        preserves_argmax: whether the map can never change the predicted class.
        num_classes: C, once fitted (None before).
        facts: how the last `fit` went (the run facts): the validation NLL before and after and,
            for a map that may move the argmax, the share of predicted classes it changed.
    """

    name: str = ""
    preserves_argmax: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.num_classes: int | None = None
        self.facts: dict = {}

    def forward(self, log_probs: Tensor) -> Tensor:
        """Calibrated log-probabilities, computed in float64, returned in `log_probs`'s dtype."""
        if self.num_classes is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(log_probs, targets) first")
        return self.transform(log_probs.to(torch.float64)).to(log_probs.dtype)

    def transform(self, log_probs: Tensor) -> Tensor:
        raise NotImplementedError

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        """Set the state from float64 CPU log-probabilities (N, C) and labels (N,)."""
        raise NotImplementedError

    def check(self, num_classes: int) -> None:
        """Raise ValueError for a setting that does not fit `num_classes` classes (the default: none)."""

    def settings(self) -> dict:
        """The map's settings, recorded with the facts."""
        return {}

    def label(self) -> str:
        """What the one line of `summary` calls the fitted map."""
        return self.name

    def fit(self, log_probs: Tensor, targets: Tensor) -> Calibrator:
        """Fit on validation log-probabilities (N, C) and labels (N,), in float64 on the CPU
        (detached: nothing reaches the model); record `facts`. Returns the calibrator."""
        z, y = self._check_inputs(log_probs, targets)
        self.check(z.shape[1])
        self.to("cpu")
        self.num_classes = z.shape[1]
        self.fit_map(z, y)
        with torch.no_grad():
            after = self.transform(z)
        self.facts = {
            "calibrator": self.name,
            **self.settings(),
            "calibrator_examples": int(len(y)),
            "calibrator_nll_before": F.nll_loss(z, y).item(),
            "calibrator_nll_after": F.nll_loss(after, y).item(),
        }
        if not self.preserves_argmax:
            self.facts["calibrator_argmax_changed"] = (after.argmax(-1) != z.argmax(-1)).double().mean().item()
        return self

    def summary(self) -> str:
        """One line on the last fit."""
        facts = self.facts
        line = (
            f"{self.label()} fitted on {facts['calibrator_examples']} validation examples: NLL "
            f"{facts['calibrator_nll_before']:.4f} -> {facts['calibrator_nll_after']:.4f}"
        )
        if "calibrator_argmax_changed" in facts:
            line += f"; predicted class changed for {100 * facts['calibrator_argmax_changed']:.2f} % of them"
        return line

    @staticmethod
    def _check_inputs(log_probs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if log_probs.ndim != 2 or log_probs.shape[0] == 0 or log_probs.shape[1] < 2:
            raise ValueError(f"log_probs must be (N, C) with N > 0 and C >= 2, got {tuple(log_probs.shape)}")
        if targets.shape != log_probs.shape[:1] or targets.dtype.is_floating_point:
            raise ValueError(
                f"targets must be ({log_probs.shape[0]},) integer labels, got {tuple(targets.shape)} {targets.dtype}"
            )
        z = log_probs.detach().to("cpu", torch.float64)
        y = targets.detach().to("cpu", torch.long)
        if torch.isnan(z).any() or (z == math.inf).any():
            raise ValueError("log_probs hold NaN or +inf: a calibrator needs log-probabilities")
        if y.min() < 0 or y.max() >= z.shape[1]:
            raise ValueError(f"targets must lie in 0..{z.shape[1] - 1}, got {y.min()}..{y.max()}")
        return z, y


class OneVsRestCalibrator(Calibrator):
    """A map of each class's probability on its own, q_c = g_c(p_c), floored at `floor` and
    renormalised (histogram binning, isotonic regression): a class whose bin or range held no
    positive validation example would get q_c = 0, and one such test example an infinite NLL;
    the floor (1e-6) caps its cost at −log 1e-6 ≈ 13.8 nats."""

    def __init__(self, floor: float = FLOOR) -> None:
        super().__init__()
        if not 0 < floor < 0.5:
            raise ValueError(f"floor must lie in (0, 1/C), got {floor}")
        self.floor = float(floor)

    def check(self, num_classes: int) -> None:
        if not self.floor < 1 / num_classes:
            raise ValueError(
                f"floor must lie in (0, 1/C) = (0, {1 / num_classes:g}) for {num_classes} classes, got {self.floor}"
            )

    def class_probabilities(self, log_probs: Tensor) -> Tensor:
        """g_c(p_c) for every class, (..., C), before the floor and the renormalisation."""
        raise NotImplementedError

    def transform(self, log_probs: Tensor) -> Tensor:
        return floored_log(self.class_probabilities(log_probs), self.floor)

    def settings(self) -> dict:
        return {"calibrator_floor": self.floor}
