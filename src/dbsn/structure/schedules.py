"""Schedules of the structure distribution's temperature tau and sharpening factor beta.

Small dataclasses so Hydra can build them from a config (``_target_``); the method calls
them with the optimiser step (tau) or the epoch (beta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["REFERENCE_BATCH", "BetaSchedule", "TauSchedule"]

#: The batch size that the paper's per-step schedules are written for (CIFAR, batch 64): tau's
#: progress is counted in examples seen / REFERENCE_BATCH, so that it does not depend on the
#: batch size or on the number of devices.
REFERENCE_BATCH = 64


def _finite(schedule, *names: str) -> None:
    for name in names:
        value = getattr(schedule, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{type(schedule).__name__}.{name} must be a finite number, got {value!r}")


@dataclass
class TauSchedule:
    """Temperature of Eq. 4: tau(t) = max(initial * exp(-decay * t), minimum).

    The paper's setting (Sec. 4, Appendix B.1) is max(3 exp(-1.5e-5 t), 1) with t the
    optimiser step at batch 64, which reaches 1 at t = ln(3) / 1.5e-5 = 73,240.8 (epoch 94 of
    CIFAR). Here t is training progress in those steps: examples seen (over all devices) /
    `REFERENCE_BATCH` (64). It is the paper's step count at batch 64 on one device, and it does
    not change with the batch size or the number of devices: a run reaches tau = 1 at the same
    epoch at batch 32 or 256, on one GPU or four (counting optimiser steps, data-parallel
    training on 4 devices would end 100 epochs at tau = 2.24).
    """

    initial: float = 3.0
    decay: float = 1.5e-5
    minimum: float = 1.0

    def __post_init__(self) -> None:  # `not x > 0`, not `x <= 0`: NaN fails every comparison
        _finite(self, "initial", "decay", "minimum")
        if not self.minimum > 0:
            raise ValueError(f"TauSchedule.minimum must be > 0, got {self.minimum}")
        if not self.initial >= self.minimum:
            raise ValueError(f"TauSchedule.initial ({self.initial}) must be >= minimum ({self.minimum})")
        if not self.decay >= 0:
            raise ValueError(f"TauSchedule.decay must be >= 0, got {self.decay}")

    def __call__(self, step: float | Tensor) -> float | Tensor:
        """tau at progress `step` (examples seen / REFERENCE_BATCH; may be fractional). A tensor
        step gives a tensor on its device, computed there: a training step reads no host value."""
        if isinstance(step, Tensor):
            return (self.initial * torch.exp(-self.decay * step)).clamp_min(self.minimum)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return max(self.initial * math.exp(-self.decay * step), self.minimum)


@dataclass
class BetaSchedule:
    """Sharpening factor of Eq. 4: beta(e) = max(start - decay_per_epoch * e, end).

    e is the 0-based epoch. The defaults are the research code's
    max(1.01 - 0.01 * epoch, 0.5) with 1-based epochs: beta goes linearly from 1 to 0.5
    over the first 50 epochs (the paper, Appendix A.1, says only "from 1 to 0.5").
    decay_per_epoch = 0 keeps beta = start ("DBSN*" uses beta = 1).
    """

    start: float = 1.0
    end: float = 0.5
    decay_per_epoch: float = 0.01

    def __post_init__(self) -> None:
        _finite(self, "start", "end", "decay_per_epoch")
        if not self.end > 0:
            raise ValueError(f"BetaSchedule.end must be > 0, got {self.end}")
        if not self.end <= self.start:
            raise ValueError(f"BetaSchedule.end ({self.end}) must be <= start ({self.start})")
        if not self.decay_per_epoch >= 0:
            raise ValueError(f"BetaSchedule.decay_per_epoch must be >= 0, got {self.decay_per_epoch}")

    def __call__(self, epoch: int) -> float:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return max(self.start - self.decay_per_epoch * epoch, self.end)
