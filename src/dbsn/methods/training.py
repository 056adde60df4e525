"""How a Method's training step runs: optimisers and their schedules, the step (eager, chunked,
CUDA-graphed), the non-finite guard, warm-up, running BatchNorm statistics.

`TrainingLoop` is the part of `dbsn.methods.base.Method` that Lightning's fit calls (manual
optimisation); the method proper (its loss, `training_losses`, Eq. 3, and its prediction) stays in
`dbsn.methods.base`. It provides the paper's CIFAR recipe (SGD with momentum and weight decay on the
weights, none on the scales ρ of Gaussian weights; lr ÷ `gamma` at fractions of training; a linear
warm-up; gradient-norm clipping on the weights only), an optional second optimiser for structure
parameters (Adam on θ), and one step: the gradients of the loss part by part (one grouped forward
over the T structures, or chunks of `train_samples_per_forward`) with one BatchNorm
running-statistics update, averaged over the ranks under structure-parallel DDP. The step reads
nothing on the host (τ, β and the learning rates in device tensors, fused optimisers, a NaN/inf
guard without a synchronisation: `dbsn.methods.step.FiniteGuard`), so `execution.cuda_graph` can
capture it whole (`GraphedStep`). Under data-parallel DDP each rank draws its own structures.

It reads of the method: `training_losses`, `structure_parameters` and `structure_optimizer`,
`optim`, `execution`, `weights`, `task`, `parallel`, `dataset_size`, `check_world_size` and
`on_after_optimizer_step`. A subclass overrides any of its parts (`training_step`,
`configure_optimizers`, `accumulate_gradients`, `cuda_graph_refusal`, ...) as a `Method`'s.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from dbsn.methods.step import FiniteGuard, GraphedStep, NonFiniteLossError
from dbsn.methods.temperature import require_validation
from dbsn.methods.weight_copies import WeightCopies
from dbsn.nets.batchnorm import RunningStatistics, accumulated_running_statistics


class TrainingLoop:
    """How a `Method`'s training step runs (see the module docstring); `Method` inherits it
    before `pl.LightningModule`, so its hooks are the ones Lightning calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        # the training step's machinery: one BatchNorm update per step, the NaN/inf guard, the graph
        self._running_statistics = RunningStatistics()
        self._guard = FiniteGuard()
        self._graphed: GraphedStep | None = None
        self._scheduled_lrs: tuple[int, list[float]] = (-1, [])  # (epoch, lr of each weight group) under warm-up

    def weight_parameters(self) -> list[nn.Parameter]:
        structure = {id(p) for p in self.structure_parameters()}
        return [p for p in self.parameters() if id(p) not in structure and p.requires_grad]

    def weight_parameter_groups(self) -> list[list[nn.Parameter]]:
        """Groups of weights with their own SGD, lr schedule and gradient clipping (one per
        network; an ensemble has one per member, so members never share a clipping norm)."""
        return [self.weight_parameters()]

    def no_decay_parameters(self) -> list[nn.Parameter]:
        """Weights that SGD optimises without weight decay (the weight posterior's choice:
        a Gaussian posterior's scales ρ; none for point weights and MC dropout)."""
        return self.weights.no_decay_parameters(self.net)

    def lr_scales(self) -> dict[int, float]:
        """Weights whose lr is a multiple of the optimiser's, {id(parameter): multiplier}
        (BatchEnsemble's fast weights); none by default."""
        return {}

    def configure_optimizers(self):
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs < 1:
            raise ValueError(f"The lr schedule is defined in epochs: set trainer.max_epochs (got {max_epochs}).")
        optimizers, schedules = [], []
        no_decay, lr_scales = self.no_decay_parameters(), self.lr_scales()
        for group in self.weight_parameter_groups():
            sgd, schedule = self.optim.build(
                group, max_epochs, no_decay, lr_scales, capturable=bool(self.execution.cuda_graph)
            )
            optimizers.append(sgd)
            schedules.append(schedule)
        if self.structure_parameters():
            optimizers.append(
                self.structure_optimizer().build(
                    self.structure_parameters(), capturable=bool(self.execution.cuda_graph)
                )
            )
        return optimizers, schedules

    def on_fit_start(self) -> None:
        if self.temperature_scaling:  # refuse now, not after training
            require_validation(self.trainer.datamodule)
        if self.dataset_size is None:
            datamodule = getattr(self.trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "num_train"):
                raise ValueError("dataset_size is unset and the data module does not report num_train")
            self.dataset_size = int(datamodule.num_train)
        self.check_world_size(self.trainer.world_size)
        if (
            self.parallel == "structure"
            and self.trainer.world_size > 1
            and not getattr(self.trainer.datamodule, "same_batches_on_every_rank", False)
        ):
            raise ValueError(
                "Structure-parallel training needs the same batches on every rank: give the trainer a "
                "data module with same_batches_on_every_rank = True (train.py sets it), or use "
                "model.parallel=data."
            )
        # Training's random stream starts here from the run's seed, whatever drew random numbers
        # before (the model's initialisation on one device; Lightning re-seeds DDP ranks after
        # it). One device and every structure-parallel rank then draw the same augmentations
        # and the same T structures, of which each rank evaluates its share; data-parallel
        # ranks offset the seed, so each draws its own structures / masks / weight noise and
        # augments its own batch.
        offset = 104729 * self.global_rank if self.parallel == "data" else 0
        torch.manual_seed((torch.initial_seed() + offset) % 2**63)

    def _optimizers(self) -> list:
        opts = self.optimizers()
        return list(opts) if isinstance(opts, (list, tuple)) else [opts]

    def _check_finite(self, loss: Tensor, batch_idx: int) -> None:
        if torch.isfinite(loss.detach()).item():
            return
        last = self._last_checkpoint()
        raise NonFiniteLossError(
            f"Training loss is {loss.item()} at global step {self.trainer.global_step} "
            f"(epoch {self.current_epoch}, batch {batch_idx}); the weights were not updated with it. "
            f"Last good checkpoint: {last}. Common fixes: lower the learning rate "
            "(model.optim.lr), keep gradient clipping on (model.optim.grad_clip_norm), or use "
            "32-bit precision (trainer.precision=32-true)."
        )

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        opts = self._optimizers()
        weights = opts[: len(self.lr_schedulers_list())]
        if self._guard.attached:
            self._guard.begin(self.global_step, self.current_epoch, batch_idx)
        with self._warmed_up(weights, batch_idx):
            if self._graphed is not None:
                logs = self._graphed(x, y)
                for opt in opts:  # Lightning counts the optimiser steps it did not see
                    opt._on_before_step()
                    opt._on_after_step()
            else:
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
                logs = self.step_body(x, y, opts, weights, batch_idx=batch_idx)
        if self.parallel == "structure" and self._world_size() > 1:
            self._average_running_statistics()
        self.on_after_optimizer_step(y.shape[0])

        loss = logs.pop("loss")
        self.log_dict({f"train/{k}": v for k, v in logs.items()}, on_step=True, on_epoch=True, batch_size=y.shape[0])
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=y.shape[0])
        return loss

    def step_body(
        self, x: Tensor, y: Tensor, opts: list, weight_opts: list, backward=None, batch_idx: int = 0
    ) -> dict[str, Tensor]:
        """One step after the gradients were zeroed: the loss's gradients (`accumulate_gradients`,
        by `backward(loss, last)`: Lightning's by default), the weights' gradient clipping (the
        optimisers `weight_opts`, one per weight group) and every optimiser's update; the detached
        logs. Nothing in it reads a device value on the host, so a CUDA graph can capture it
        (`GraphedStep`)."""
        with self._weight_copies():
            logs = self.accumulate_gradients(x, y, backward or self._backward, batch_idx)
        if self.optim.grad_clip_norm:
            for opt in weight_opts:
                params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(params, self.optim.grad_clip_norm, foreach=True)
        for opt in opts:
            opt.step()
        return logs

    def _weight_copies(self):
        """`execution.weight_copies`: the 16-bit weights of this method's convolutions for this step,
        cast in one operation (`WeightCopies`; the layers found again each step, so a network
        replaced between steps is the one copied); refused outside autocast, where there is nothing
        to cast."""
        if not self.execution.weight_copies:
            return nullcontext()
        device = self.device.type
        if not torch.is_autocast_enabled(device):
            raise ValueError(
                "model.execution.weight_copies=true casts the weights for mixed precision: set "
                "trainer.precision=bf16-mixed or model.execution.weight_copies=false"
            )
        return WeightCopies(self).applied(torch.get_autocast_dtype(device))

    def attach_guard(self, optimizers: list) -> None:
        """Give the NaN/inf guard the optimisers (their own objects, not Lightning's wrappers)."""
        self._guard.attach([getattr(o, "optimizer", o) for o in optimizers], self.device)

    def cuda_graph_refusal(self) -> str | None:
        """Why this method's training step cannot be captured in a CUDA graph (None: it can).
        Methods whose step was checked against the eager one say so by overriding this."""
        return f"{type(self).__name__} has not been checked under a CUDA graph"

    def on_train_start(self) -> None:
        opts = self._optimizers()
        self.attach_guard(opts)
        self._graphed = None
        if not self.execution.cuda_graph:
            return
        reason = self._graph_refusal()
        if reason is not None and self.execution.cuda_graph == "auto":
            rank_zero_info(f"model.execution.cuda_graph=auto: eager training steps, since {reason}.")
            return
        if reason is not None:
            raise ValueError(f"model.execution.cuda_graph=true: {reason}. Set model.execution.cuda_graph=false.")
        raw = [getattr(o, "optimizer", o) for o in opts]
        for group in (g for opt in raw for g in opt.param_groups):  # a resumed optimiser's are the checkpoint's
            if isinstance(group["lr"], Tensor) and group["lr"].device != self.device:
                group["lr"] = group["lr"].to(self.device)
        weights = raw[: len(self.lr_schedulers_list())]
        self._graphed = GraphedStep(
            lambda x, y: self.step_body(x, y, raw, weights), lambda: [o.zero_grad(set_to_none=True) for o in raw]
        )

    def _graph_refusal(self) -> str | None:
        """Why this run's step cannot be captured: the method's reason, or the run's."""
        reason = self.cuda_graph_refusal()
        if reason is None and self.device.type != "cuda":
            reason = f"it captures the step on a CUDA device, and this run trains on {self.device.type}"
        if reason is None and self._world_size() > 1:
            reason = "it captures one process's step; this run has several devices (use one GPU)"
        if reason is None and not self._guard.attached:
            reason = "its optimisers cannot skip a non-finite step on the device"
        return reason

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self._guard.attached and self._guard.due(
            self.global_step, batch_idx + 1 == self.trainer.num_training_batches
        ):
            self._guard.check(self._last_checkpoint())

    def on_train_end(self) -> None:
        self._guard.check(self._last_checkpoint())
        self._guard.detach()
        self._graphed = None  # the graph holds the optimisers' tensors: free it with the fit

    def _last_checkpoint(self) -> str:
        return getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none written yet"

    @contextmanager
    def _warmed_up(self, weight_optimizers: list, batch_idx: int):
        """The weights' lr during `optim.warmup_epochs`: the scheduled lr times the fraction of the
        warm-up done after this step (`WeightOptimizer.warmup_factor`), put back after the step so
        the epoch schedule never sees it."""
        batches = self.trainer.num_training_batches if self._trainer is not None else float("inf")
        factor = self.optim.warmup_factor(self.current_epoch, batch_idx, batches)
        if factor == 1.0:
            yield
            return
        groups = [g for opt in weight_optimizers for g in opt.param_groups]
        if any(isinstance(g["lr"], Tensor) for g in groups):  # captured learning rates: written in place
            if self._scheduled_lrs[0] != self.current_epoch:  # the schedule's values, read once an epoch
                self._scheduled_lrs = (self.current_epoch, [float(g["lr"]) for g in groups])
            scheduled = self._scheduled_lrs[1]
            for g, lr in zip(groups, scheduled):
                g["lr"].fill_(lr * factor)
            try:
                yield
            finally:
                for g, lr in zip(groups, scheduled):
                    g["lr"].fill_(lr)
            return
        scheduled = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * factor
        try:
            yield
        finally:
            for g, lr in zip(groups, scheduled):
                g["lr"] = lr

    def accumulate_gradients(self, x: Tensor, y: Tensor, backward, batch_idx: int = 0) -> dict[str, Tensor]:
        """The gradients of one step's loss, chunk by chunk (`training_losses`), with one
        BatchNorm running-statistics update for the step; returns the detached logs (loss: the
        sum of the parts; nll, kl, error: means over the structures). `backward(loss, last)`
        back-propagates one part. With the guard attached (`attach_guard`) a non-finite loss
        is marked on the device; without, it raises at once (one synchronisation)."""
        logs: dict[str, Tensor] = {}
        guarded = self._guard.guards(x.device)
        keep = self._guard.found_inf if guarded else None
        with accumulated_running_statistics(self, statistics=self._running_statistics, keep=keep):
            for share, last, out in self.training_losses(x, y):
                if guarded:
                    self._guard.mark(out["loss"])
                else:
                    self._check_finite(out["loss"], batch_idx)
                extra = out.pop("backward_extra", None)
                backward(out["loss"] if extra is None else out["loss"] + extra, last)
                out["error"] = self.task.error(out.pop("logits").detach(), out.pop("targets"))
                for key, value in out.items():
                    value = value.detach() * (share if key in ("nll", "kl", "error") else 1.0)
                    logs[key] = logs[key] + value if key in logs else value
                del out
        return logs

    def _backward(self, loss: Tensor, last: bool) -> None:
        """Lightning's backward; before the last chunk DDP does not all-reduce (the last
        chunk's backward reduces the sum)."""
        block = nullcontext if last else getattr(self.trainer.strategy, "block_backward_sync", nullcontext)
        with block():
            self.manual_backward(loss)

    @torch.no_grad()
    def _average_running_statistics(self) -> None:
        """Structure-parallel training: each rank's BatchNorm running statistics moved towards
        its own structures' batch statistics; their mean over ranks is what one device moving
        towards the mean over all T structures holds (the update is linear in the statistics)."""
        buffers = [
            b
            for m in self.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            for b in (m.running_mean, m.running_var)
        ]
        if not buffers:
            return
        flat = self.trainer.strategy.reduce(torch.cat([b.flatten() for b in buffers]), reduce_op="mean")
        torch._foreach_copy_(buffers, [v.view_as(b) for b, v in zip(buffers, flat.split([b.numel() for b in buffers]))])

    def lr_schedulers_list(self) -> list:
        schedules = self.lr_schedulers()
        if schedules is None:
            return []
        return list(schedules) if isinstance(schedules, (list, tuple)) else [schedules]

    def on_train_epoch_end(self) -> None:
        for schedule in self.lr_schedulers_list():
            schedule.step()
