"""Whether a training run had converged: its training loss over the last tenth of training.

A comparison is only fair between methods that each reached what their budget allows. A run
whose training loss still falls steeply at its end would have gone on improving: its numbers
rank the budget, not the method. `TrainingCurve` (a Lightning callback that every `train.py`
run has) records the mean training loss of every epoch; `convergence` decides from it, and
metrics.json keeps the verdict (`convergence`), which the report marks in every table.

The rule. A straight line is fitted to the epochs of the run's last tenth (at least its last two
epochs); the run has not converged when the line's fall across the last tenth of the run (at
least one epoch) is more than `threshold` (10 %) of the final loss. From about 30 epochs on, the
window lies after the multistep schedule's last milestone (75 %), so the drop at the last decay
does not count; a short run's window is its last two epochs (after the last decay from 8 epochs
on). Fitting a line where there are enough epochs keeps one epoch's noise from deciding. The
fall is taken across the last tenth, not across the window: a window of two epochs in a 9-epoch
run is more than its last tenth, and its fall there would count the drop at the decay.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch

__all__ = ["TrainingCurve", "convergence"]

#: the share of the run whose slope decides, and the relative drop across it that counts as still falling
FRACTION, THRESHOLD = 0.1, 0.1


def convergence(epoch_losses: list[float], fraction: float = FRACTION, threshold: float = THRESHOLD) -> dict:
    """{"converged": bool or None (fewer than three epochs), "last_tenth_drop": the fitted line's
    fall across the run's last tenth (at least one epoch) over the final loss, "window_epochs": the
    epochs fitted, "epoch_losses", "rule"}."""
    losses = [float(v) for v in epoch_losses]
    finite = all(math.isfinite(v) for v in losses)
    out = {
        "epoch_losses": losses,
        "rule": f"a linear fit to the last {fraction:.0%} of epochs (at least 2) falls across "
        f"the last {fraction:.0%} of the run (at least one epoch) by more than "
        f"{threshold:.0%} of the final loss: not converged",
    }
    if len(losses) < 3 or not finite:
        return {**out, "converged": None, "last_tenth_drop": None, "window_epochs": len(losses)}
    window = min(len(losses), max(2, math.ceil(fraction * len(losses)) + 1))
    y = torch.tensor(losses[-window:], dtype=torch.float64)
    x = torch.arange(window, dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    drop = -slope * max(1.0, fraction * len(losses)) / max(abs(losses[-1]), 1e-12)
    return {**out, "converged": drop <= threshold, "last_tenth_drop": drop, "window_epochs": window}


class TrainingCurve(pl.Callback):
    """The mean training loss of every epoch (the loss `training_step` returns, averaged over the
    epoch's batches on the device: one read per epoch), and the run's `convergence`."""

    def __init__(self) -> None:
        self.epoch_losses: list[float] = []
        self._total: torch.Tensor | None = None
        self._batches = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._total, self._batches = None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            self._total = loss if self._total is None else self._total + loss
            self._batches += 1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._total is not None and self._batches:
            self.epoch_losses.append(float(self._total) / self._batches)

    def state_dict(self) -> dict:
        return {"epoch_losses": list(self.epoch_losses)}  # a resumed run keeps its curve

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch_losses = list(state_dict.get("epoch_losses", []))

    def summary(self) -> dict:
        return convergence(self.epoch_losses)
