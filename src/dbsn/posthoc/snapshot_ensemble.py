"""Snapshot ensembles (Huang, Li, Pleiss, Liu, Hopcroft & Weinberger, "Snapshot Ensembles: Train 1, get M
for free", ICLR 2017): one run whose learning rate restarts M times, and the model at the end of every
cycle kept as a member.

`SnapshotCollector` (a Lightning callback) cuts the run of B epochs into M cycles of ⌊B / M⌋ epochs
(the last the rest, as the authors' code, so every cycle ends where a checkpoint is written) and sets
the weights' lr before each step along Eq. 2, α(t) = α₀ / 2 · (cos(π · t / L) + 1): step for step
cSG-MCMC's cyclical step size without its noise (`dbsn.sampling.CyclicalSchedule`,
`exploration=1`, tested). At each cycle's end it keeps the method's whole state on the CPU; the
snapshots live in every checkpoint, and a run resumed mid-cycle ends as the uninterrupted one.
Refused: a method whose weights move by a step size of its own (cSG-MCMC) and a warm-up.

`SnapshotEnsemble` (`posthoc=snapshot_ensemble`) rebuilds one method per snapshot and predicts with
the mean of their predictives, as a deep ensemble (`SnapshotEnsembleMethod`); the run's own test
pass stays its final model's. Settings and sources: docs/methods.md ("Snapshot ensembles").
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from dbsn.methods.base import Method
from dbsn.methods.ensemble import DeepEnsemble
from dbsn.posthoc.base import PosthocError, PosthocPosterior

__all__ = ["SnapshotCollector", "SnapshotEnsemble", "SnapshotEnsembleMethod", "SnapshotSchedule", "load_snapshot_state"]

#: The collector's key in a checkpoint's "callbacks".
STATE_KEY = "SnapshotCollector"


class SnapshotSchedule:
    """M cosine cycles over a run of B epochs, each ending at an epoch's end (see the module
    docstring). Knows nothing of networks or optimisers: epochs and steps in, lr factors out.

    Args:
        cycles: M, the number of cycles and of snapshots.
    """

    def __init__(self, cycles: int) -> None:
        if isinstance(cycles, bool) or not isinstance(cycles, int) or cycles < 1:
            raise ValueError(f"cycles (M, the number of snapshots) must be an integer >= 1, got {cycles!r}")
        self.cycles = cycles

    def epochs_per_cycle(self, max_epochs: int) -> int:
        """⌊B / M⌋, refused below one epoch."""
        if max_epochs is None or max_epochs < self.cycles:
            raise ValueError(
                f"a snapshot ensemble of {self.cycles} cycles needs at least {self.cycles} epochs, one per "
                f"cycle; the run has trainer.max_epochs={max_epochs}"
            )
        return max_epochs // self.cycles

    def cycle_ends(self, max_epochs: int) -> list[int]:
        """The last epoch of every cycle (counted from 0): where the snapshots are taken."""
        length = self.epochs_per_cycle(max_epochs)
        return [(c + 1) * length - 1 for c in range(self.cycles - 1)] + [max_epochs - 1]

    def lr_factor(self, epoch: int, batch: int, batches: int, max_epochs: int) -> float:
        """α / α₀ at step `batch` of `batches` in `epoch`: (cos(π t / L) + 1) / 2 (Eq. 2)."""
        length = self.epochs_per_cycle(max_epochs)
        cycle = min(epoch // length, self.cycles - 1)
        start = cycle * length
        epochs = length if cycle < self.cycles - 1 else max_epochs - start
        done = (epoch - start) * batches + batch
        return 0.5 * (math.cos(math.pi * done / (epochs * batches)) + 1.0)


def weight_optimizers(trainer) -> list:
    """The optimisers of the method's weights: those before the structure's, one per schedule
    (`Method.configure_optimizers`)."""
    return list(trainer.optimizers[: len(trainer.lr_scheduler_configs)])


class SnapshotCollector(Callback):
    """The cyclic lr and the snapshots of a snapshot ensemble (see the module docstring).

    Args:
        cycles: M (the authors' 5 at B = 200 epochs in their README).
        lr: α₀, the lr at every cycle's start (the authors' 0.2); each weight group gets α₀ times
            its own multiple of the method's lr.
    """

    def __init__(self, cycles: int = 5, lr: float = 0.2) -> None:
        if not lr > 0:
            raise ValueError(f"lr (alpha_0, the lr at each cycle's start) must be > 0, got {lr}")
        self.schedule = SnapshotSchedule(cycles)
        self.lr = float(lr)
        self.snapshots: list[dict[str, Tensor]] = []
        self.epochs: list[int] = []  # the epoch of every snapshot

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def on_fit_start(self, trainer, pl_module) -> None:
        self.schedule.epochs_per_cycle(trainer.max_epochs)  # refuses a run shorter than the cycles
        if not weight_optimizers(trainer):
            raise ValueError(
                f"callbacks=snapshot_ensemble sets the lr of the weights' optimiser, and "
                f"{type(pl_module).__name__}'s weights move by a step size of its own (its sampler's "
                "cyclical schedule): train it without the callback"
            )
        warmup = getattr(getattr(pl_module, "optim", None), "warmup_epochs", 0)
        if warmup:
            raise ValueError(
                f"callbacks=snapshot_ensemble sets the lr of every step, and model.optim.warmup_epochs="
                f"{warmup} would scale it again: set model.optim.warmup_epochs=0"
            )

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.set_lr(trainer, 0)  # the epoch's first step's, before an lr monitor reads it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.set_lr(trainer, batch_idx)

    def set_lr(self, trainer, batch: int) -> None:
        """Every weight group's lr for step `batch` of the current epoch: α₀ times the schedule's
        factor times the group's multiple of the method's lr."""
        factor = self.schedule.lr_factor(trainer.current_epoch, batch, trainer.num_training_batches, trainer.max_epochs)
        for opt in weight_optimizers(trainer):
            opt = getattr(opt, "optimizer", opt)
            for group in opt.param_groups:
                # the group's multiple of the method's lr, fixed when the optimiser was built
                lr = self.lr * factor * float(group["initial_lr"]) / float(opt.defaults["lr"])
                if isinstance(group["lr"], Tensor):  # captured learning rates (a CUDA graph reads the tensor)
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch in self.schedule.cycle_ends(trainer.max_epochs):
            self.collect(pl_module, trainer.current_epoch)

    @torch.no_grad()
    def collect(self, method: Method, epoch: int) -> None:
        """Keep the method's current state (on the CPU) as the snapshot of `epoch`."""
        self.snapshots.append({k: v.detach().cpu().clone() for k, v in method.state_dict().items()})
        self.epochs.append(int(epoch))

    def state_dict(self) -> dict[str, Any]:
        return {
            "cycles": self.schedule.cycles,
            "lr": self.lr,
            "epochs": list(self.epochs),
            "snapshots": [dict(s) for s in self.snapshots],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["cycles"] != self.schedule.cycles or state_dict["lr"] != self.lr:
            raise ValueError(
                f"the checkpoint's snapshot ensemble has {state_dict['cycles']} cycles at lr "
                f"{state_dict['lr']}; this run asks for {self.schedule.cycles} at {self.lr}: resume with "
                f"callbacks.snapshot_ensemble.cycles={state_dict['cycles']} "
                f"callbacks.snapshot_ensemble.lr={state_dict['lr']}"
            )
        self.epochs = list(state_dict["epochs"])
        self.snapshots = [dict(s) for s in state_dict["snapshots"]]


def load_snapshot_state(checkpoint: dict) -> dict[str, Any]:
    """The `SnapshotCollector` state saved in a Lightning checkpoint, already loaded (and checked:
    `dbsn.runtime.checkpoint.load_checkpoint`)."""
    state = checkpoint.get("callbacks", {}).get(STATE_KEY)
    if state is None:
        raise ValueError("the checkpoint holds no snapshots: train with callbacks=snapshot_ensemble")
    return state


class SnapshotEnsembleMethod(DeepEnsemble):
    """The snapshots of one run as a deep ensemble: p(y | x) = 1/M Σ_m p_m(y | x), snapshot m's own
    predictive (its weights, BatchNorm statistics and, for a stochastic method, its own S members).
    Member j of the detection scores is draw j // M of snapshot j mod M (`DeepEnsemble`).

    Args:
        snapshots: one method per snapshot, each with that snapshot's state; none is trained.
        epochs: the epoch of each snapshot.
    """

    def __init__(self, snapshots: list[Method], epochs: list[int]) -> None:
        super().__init__(snapshots)
        if len(epochs) != len(snapshots):
            raise ValueError(f"{len(snapshots)} snapshots but {len(epochs)} epochs")
        self.epochs = [int(e) for e in epochs]

    @staticmethod
    def check_member(member: Method) -> None:
        """Any method: the snapshots are never trained (a deep ensemble's members are)."""

    def training_structures(self, n: int):
        raise NotImplementedError("a snapshot ensemble is built post hoc from a finished run, not trained")

    def prepare_prediction(self, datamodule) -> None:
        """Each snapshot prepares its own prediction (DBSN: its members' BatchNorm statistics)."""
        for member in self.members:
            member.prepare_prediction(datamodule)

    def run_facts(self) -> dict:
        return {
            **super().run_facts(),
            "posterior": "snapshot ensemble",
            "snapshots": len(self.members),
            "snapshot_epochs": list(self.epochs),
        }


class SnapshotEnsemble(PosthocPosterior):
    """The snapshot ensemble of a run trained with `callbacks=snapshot_ensemble`, as a post-hoc
    posterior (`posthoc=snapshot_ensemble`).

    Args:
        name: see `PosthocPosterior`.
        n_samples: S of each snapshot, for a stochastic method (None: the run's own).
        last: the last m snapshots (the paper's m ≤ M; None: all).
    """

    name = "snapshot_ensemble"

    def __init__(self, name: str | None = None, n_samples: int | None = None, last: int | None = None) -> None:
        super().__init__(name, n_samples)
        if last is not None and int(last) < 1:
            raise PosthocError(f"posthoc.last (the last m snapshots) must be >= 1 (or null: all), got {last}")
        self.last = None if last is None else int(last)

    def why_not(self, method: Method, checkpoint: dict) -> str | None:
        if not method.task.keeps_test_outputs:
            return f"posthoc={self.name} is defined for classifiers; this is a segmentation model"
        try:
            load_snapshot_state(checkpoint)
        except ValueError as err:
            return (
                f"posthoc={self.name} needs the snapshots its run collected ({err}): e.g. python train.py "
                "model=map_fixed callbacks=snapshot_ensemble"
            )
        return None

    def check(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> None:
        kept = len(load_snapshot_state(checkpoint)["snapshots"])
        if kept == 0:
            raise PosthocError(
                f"posthoc={self.name}: the run collected no snapshot yet (its first cycle had not "
                "ended): evaluate the checkpoint of a later epoch, or train on"
            )
        if self.last is not None and self.last > kept:
            raise PosthocError(
                f"posthoc.last={self.last}, but the run collected {kept} snapshots: set "
                f"posthoc.last <= {kept} (or null: all)"
            )

    def fit(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> SnapshotEnsembleMethod:
        state = load_snapshot_state(checkpoint)
        chosen = slice(-self.last if self.last else None, None)
        members, epochs = [], []
        for snapshot, epoch in zip(state["snapshots"][chosen], state["epochs"][chosen]):
            member = copy.deepcopy(method)
            member.load_state_dict(snapshot, strict=True)
            inner = list(member.members) if isinstance(member, DeepEnsemble) else [member]  # a deep ensemble's networks
            members += inner
            epochs += [epoch] * len(inner)
        ensemble = SnapshotEnsembleMethod(members, epochs).eval()
        ensemble.use_samples(n_samples)
        return ensemble
