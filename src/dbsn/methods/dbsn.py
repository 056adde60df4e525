"""Deep Bayesian Structure Networks (Deng, Luo & Zhu, ICLR 2021), and FBN.

Point-estimate weights w, a posterior q(α | θ) on the structure: per edge a sharpened concrete
distribution (Eq. 4-5) with logits θ shared by all cells. The loss (Eq. 3, per example) is

    L(θ, w) = E_q[ -1/N log p(D | α, w) ] + KL(q(α|θ) || p(α)) / N + γ ||w||²,

estimated with T structure samples per step (Eq. 6-7) in one grouped forward (see
`Method.training_loss`). The KL is estimated from the same samples against the
uniform prior (β = 1, same τ). Weight decay implements γ||w||² through SGD.

τ follows training progress counted in examples seen / 64 (the paper's batch), not in
optimiser steps, so it reaches 1 at the same epoch at any batch size and on any number of
devices. Prediction is the Bayes ensemble over S structures drawn at τ = `test_tau` (1 in the
paper) with the final β, network in eval mode; when training ended at another τ, the test warns
once, naming both.

FBN (the paper's "fully Bayesian network") is DBSN with a Gaussian weight posterior as well:
`DBSN(weights=GaussianWeights(...))`, which is what `model=fbn` configures.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from dbsn.methods.base import Method, Parallel
from dbsn.methods.settings import Prediction, StructureOptimizer
from dbsn.nets.batchnorm import Statistics, concatenate, select, structure_statistics, using_statistics
from dbsn.structure import StructureLogits
from dbsn.structure.schedules import REFERENCE_BATCH, BetaSchedule, TauSchedule


@dataclass
class BatchNormRecalibration:
    """Per-structure BatchNorm statistics at prediction (beyond the paper; off in the paper).

    In training every BatchNorm normalises each sampled structure with its own batch
    statistics, but the running statistics average over all the structures training saw, so
    at test a fresh structure is normalised with statistics that belong to none of them. With
    `enabled`, the test pass fixes its S members (structures drawn once, then reused for
    every batch) and computes each member's own statistics on `images` training images (a
    seeded subset, with the training augmentation if `augment`), in grouped forwards of
    `samples_per_forward` structures over batches of `batch_size` images, averaged over
    batches as `momentum=None` does. The research code (and `enabled=False`) predicts with the
    running statistics.
    """

    enabled: bool = False
    images: int = 256
    augment: bool = False
    batch_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.images < 1 or self.batch_size < 1:
            raise ValueError(
                f"bn_recalibration: images and batch_size must be >= 1, got {self.images}, {self.batch_size}"
            )

    def calibration_batches(self, datamodule, device: torch.device, what: str, fix: str = "") -> list[Tensor]:
        """The `images` seeded training images on `device`, preprocessed (augmented if asked,
        with the setting's seed) in batches of `batch_size`; `what` and `fix` word the error
        for a data module without training images."""
        if not hasattr(datamodule, "training_images"):
            raise ValueError(f"{what} needs training images; {type(datamodule).__name__} does not provide them{fix}")
        images = datamodule.training_images(self.images, seed=self.seed).to(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.seed)  # the augmentation, if any, is part of the setting
            return [datamodule.preprocess(batch, train=self.augment) for batch in images.split(self.batch_size)]


def outside_inference(t: Tensor) -> Tensor:
    """The members are fixed during the test pass, under inference mode; the attacks that
    follow it need tensors autograd can save."""
    return t.clone() if t.is_inference() and not torch.is_inference_mode_enabled() else t


class DBSN(Method):
    """DBSN training (T grouped structure samples per step) and Bayes-ensemble prediction.

    Args:
        net: a structure-learnable network with `forward(x, alpha)`, `num_edges`, `num_ops`.
        structure_optim: Adam settings for θ.
        tau: the temperature schedule (per 64 training examples, see `dbsn.structure.schedules`).
        beta: the sharpening schedule (per epoch).
        test_tau: temperature of the structures drawn for prediction.
        theta_init_std: θ ~ theta_init_std · N(0, 1) (DARTS' 1e-3).
        bn_recalibration: per-structure BatchNorm statistics at prediction (see
            `BatchNormRecalibration`); None = the running statistics (the paper).
        prediction: S and how the ensemble is evaluated; None: `prediction_defaults` (the paper's
            S, fewer members for validation).
        train_samples: T, structure samples per training step (paper: 4).
        parallel: "structure" by default (see `Method`).
        settings: the rest of `Method`'s settings (weights: point estimates for DBSN, Gaussian
            for FBN; optim, execution, task, dataset_size, train_samples_per_forward).
    """

    samples_structure = True
    networks = "cells"
    prediction_defaults = {"n_samples": 100, "val_samples": 10}

    def __init__(
        self,
        net: nn.Module,
        *,
        structure_optim: StructureOptimizer | None = None,
        tau: TauSchedule | None = None,
        beta: BetaSchedule | None = None,
        test_tau: float = 1.0,
        theta_init_std: float = 1e-3,
        bn_recalibration: BatchNormRecalibration | None = None,
        prediction: Prediction | None = None,
        train_samples: int = 4,
        parallel: Parallel = "structure",
        **settings,
    ) -> None:
        if net.num_edges == 0:  # before the weight posterior transforms the network
            raise ValueError(
                f"{type(self).__name__} learns a distribution over the structure of DBSN's cells, and "
                f"{type(net).__name__} has no structure (num_edges = 0): use a StructureNet, or a method "
                "without structure (MAP, DeepEnsemble)"
            )
        super().__init__(net, prediction=prediction, train_samples=train_samples, parallel=parallel, **settings)
        self.structure = StructureLogits(net.num_edges, net.num_ops, init_std=theta_init_std)
        self.structure_optim = structure_optim if structure_optim is not None else StructureOptimizer()
        self.tau_schedule = tau if tau is not None else TauSchedule()
        self.beta_schedule = beta if beta is not None else BetaSchedule()
        self.test_tau = test_tau
        # Schedule state lives in buffers so that checkpoints carry it: the training examples
        # seen (over all ranks) drive τ, and β is the value of the current (after training:
        # final) epoch.
        self.register_buffer("examples_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("beta", torch.tensor(self.beta_schedule(0)))
        # epochs trained by the runs this one started from (`init_from`): β continues from there
        self.register_buffer("epochs_before", torch.zeros((), dtype=torch.long))
        self._examples = 0
        self._warned_tau = False
        self.bn_recalibration = bn_recalibration if bn_recalibration is not None else BatchNormRecalibration()
        # With per-structure statistics: the calibration batches, and the fixed prediction
        # members so far (structures (M, E, K) and their statistics), grown on demand.
        self._calibration: list[Tensor] | None = None
        self._members: tuple[Tensor, Statistics] | None = None
        self._held: Tensor | None = None  # structures held fixed by `fixed_members`

    # ------------------------------------------------------------------ schedules
    @property
    def tau(self) -> float:
        """τ of the training structures now (a host-side count: no device sync per step)."""
        return self.tau_schedule(self._examples / REFERENCE_BATCH)

    @property
    def trained_tau(self) -> float:
        """τ at the progress the checkpointed model reached: the τ training ended at."""
        return self.tau_schedule(int(self.examples_seen) / REFERENCE_BATCH)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._examples = int(self.examples_seen)
        self._calibration = self._members = None  # validation predicts with the running statistics

    def on_train_epoch_start(self) -> None:
        self.beta.fill_(self.beta_schedule(self.current_epoch + int(self.epochs_before)))
        self.log_structure_state()

    def continue_schedules(self, epochs_trained: int) -> None:
        """`init_from`: this run starts from another run's weights and θ, which were learned
        while τ and β annealed; both continue from where that run ended (τ from the examples it
        saw, which came with its state, β from its epochs), so that the structure posterior is
        not re-annealed from τ = 3, β = 1 around an already sharpened θ."""
        self.epochs_before.add_(int(epochs_trained))

    def on_after_optimizer_step(self, batch_size: int) -> None:
        self._examples += self.examples_per_step(batch_size)
        self.examples_seen.fill_(self._examples)

    def run_facts(self) -> dict[str, float]:
        return {
            **super().run_facts(),
            "train_tau_final": self.trained_tau,
            "test_tau": self.test_tau,
            "bn_statistics": "running"
            if self._calibration is None
            else f"per structure, {sum(len(b) for b in self._calibration)} images"
            + (", augmented" if self.bn_recalibration.augment else ""),
        }

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # checkpoints written before τ counted examples hold the optimiser step count; at the
        # paper's batch of 64 per step it is the same progress (and the same τ)
        if prefix + "structure_step" in state_dict and prefix + "examples_seen" not in state_dict:
            state_dict[prefix + "examples_seen"] = state_dict.pop(prefix + "structure_step") * REFERENCE_BATCH
        state_dict.setdefault(prefix + "epochs_before", torch.zeros((), dtype=torch.long))  # older checkpoints
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def on_test_start(self) -> None:
        super().on_test_start()
        self.warn_if_tau_differs()

    def warn_if_tau_differs(self) -> None:
        """Warn (once) when prediction draws structures at another τ than training ended at."""
        tau = self.trained_tau
        if self._warned_tau or abs(tau - self.test_tau) < 1e-3:
            return
        self._warned_tau = True
        progress = int(self.examples_seen) / REFERENCE_BATCH
        schedule = self.tau_schedule
        hint = ""
        if progress > 0 and schedule.initial > self.test_tau >= schedule.minimum:
            decay = math.log(schedule.initial / self.test_tau) / progress
            hint = f", or train so that τ reaches it (this run's length: model.tau.decay={decay:.3g})"
        rank_zero_warn(
            f"Training ended at τ = {tau:.3f} but prediction draws structures at test_tau = "
            f"{self.test_tau:g}. To predict at the training temperature set model.test_tau={tau:.3f} "
            f"(evaluate.py: test_tau={tau:.3f}){hint}."
        )

    def log_structure_state(self) -> None:
        probs = self.structure.probs().detach()
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean()
        self.log_dict(
            {"structure/tau": self.tau, "structure/beta": float(self.beta), "structure/entropy": entropy},
            on_step=False,
            on_epoch=True,
        )

    # ------------------------------------------------------------------ structure
    @property
    def structure_is_stochastic(self) -> bool:
        return True

    def structure_parameters(self) -> list[nn.Parameter]:
        return [self.structure.theta]

    def structure_optimizer(self) -> StructureOptimizer:
        return self.structure_optim

    def training_structures(self, n: int) -> tuple[Tensor, Tensor]:
        # τ from the examples seen, on the device: the step reads no host value that changes
        tau = self.tau_schedule(self.examples_seen.double() / REFERENCE_BATCH)
        alpha = self.structure.sample(n, self.beta, tau)  # (n, E, K), reparameterised
        return alpha, self.structure.kl(alpha, self.beta, tau)  # (n,)

    def cuda_graph_refusal(self) -> str | None:
        return self.weights.cuda_graph_refusal()

    @torch.no_grad()
    def sample_structures(self, n: int, tau: float | None = None) -> Tensor:
        """n structures α ~ q(α | θ, β) at temperature `tau` (default: test_tau), (n, E, K)."""
        return self.structure.sample(n, self.beta, self.test_tau if tau is None else tau)

    def prediction_structures(self, n: int, first: int = 0) -> Tensor:
        if self._held is not None and first + n <= self._held.shape[0]:
            return self._held[first : first + n]
        if self._calibration is None:
            return self.sample_structures(n)
        return outside_inference(self._fixed_members(first + n)[0][first : first + n])

    @contextmanager
    def fixed_members(self, n: int):
        """Members 0 .. n - 1 are n structures drawn once (with per-structure BatchNorm they are
        fixed already), so that member s is the same network on training and test images."""
        if self._calibration is not None or n < 1:
            yield
            return
        held, self._held = self._held, self.sample_structures(n)
        try:
            yield
        finally:
            self._held = held

    # ------------------------------------------------------------------ per-structure BatchNorm
    def prepare_prediction(self, datamodule) -> None:
        """With `bn_recalibration.enabled`: take the calibration images from the training split
        and start a new fixed set of prediction members (their statistics come on demand)."""
        self._calibration = self._members = None
        if self.bn_recalibration.enabled:
            self.use_calibration_images(
                self.bn_recalibration.calibration_batches(
                    datamodule, self.device, "bn_recalibration", ". Set model.bn_recalibration.enabled=false."
                )
            )

    def use_calibration_images(self, batches: list[Tensor]) -> None:
        """Predict from now on with a fixed set of members, each normalised with its own
        structure's BatchNorm statistics on these (preprocessed) batches."""
        self._calibration, self._members = batches, None

    def _fixed_members(self, count: int) -> tuple[Tensor, Statistics]:
        """The first `count` fixed members: structures drawn at test_tau, and each one's
        BatchNorm statistics on the calibration images."""
        have = 0 if self._members is None else self._members[0].shape[0]
        if count > have:
            # from their own seed, not the rank's stream: data-parallel ranks (whose streams differ)
            # test their shards with the same members, one ensemble for the run's metrics
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(self.bn_recalibration.seed + 7919 * (have + 1))
                alpha = self.sample_structures(count - have)
            parts = [
                structure_statistics(lambda x, a=a: self.network(x, a), self.net, self._calibration, a.shape[0])
                for a in alpha.split(self.samples_per_forward)
            ]
            if self._members is not None:
                alpha, parts = torch.cat([self._members[0], alpha]), [self._members[1], *parts]
            self._members = (alpha, concatenate(parts))
        return self._members

    def prediction_statistics(self, n: int, first: int = 0):
        if self._calibration is None:
            return super().prediction_statistics(n, first)
        statistics = select(self._fixed_members(first + n)[1], slice(first, first + n))
        return using_statistics(self.net, {k: tuple(map(outside_inference, v)) for k, v in statistics.items()})

    @torch.no_grad()
    def structure_probabilities(self) -> Tensor:
        """softmax(θ / β): the law of the op with the largest weight, argmax_k α_k, under the
        sharpened concrete (Gumbel-max; independent of τ)."""
        return torch.softmax(self.structure.theta / self.beta, dim=-1)
