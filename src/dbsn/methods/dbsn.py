"""Deep Bayesian Structure Networks (Deng, Luo & Zhu, ICLR 2021), and FBN.

Point-estimate weights w, a posterior q(α | θ) on the structure: per edge a sharpened concrete
distribution (Eq. 4-5) with logits θ shared by all cells. The loss (Eq. 3, per example) is

    L(θ, w) = E_q[ -1/N log p(D | α, w) ] + KL(q(α|θ) || p(α)) / N + γ ||w||²,

estimated with T structure samples per step (Eq. 6-7) in one grouped forward (see
`ClassificationMethod.training_loss`). The KL is estimated from the same samples against the
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

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from dbsn.methods.tasks import Classification
from dbsn.methods.base import ClassificationMethod, StructureOptimizer, WeightOptimizer
from dbsn.methods.weights import WeightPosterior
from dbsn.schedules import REFERENCE_BATCH, BetaSchedule, TauSchedule
from dbsn.structure import StructureLogits


class DBSN(ClassificationMethod):
    """DBSN training (T grouped structure samples per step) and Bayes-ensemble prediction.

    Args:
        net: a structure-learnable network with `forward(x, alpha)`, `num_edges`, `num_ops`.
        weights: the weight posterior; point estimates for DBSN, Gaussian for FBN.
        train_samples: T, structure samples per training step (paper: 4).
        n_samples: S, structures in the test-time Bayes ensemble (paper: 100).
        tau, beta: the temperature (per 64 training examples, see `dbsn.schedules`) and
            sharpening (per epoch) schedules.
        test_tau: temperature of the structures drawn for prediction.
        structure_optim: Adam settings for θ.
        theta_init_std: θ ~ theta_init_std · N(0, 1) (DARTS' 1e-3).
    """

    def __init__(
        self,
        net: nn.Module,
        optim: WeightOptimizer | None = None,
        structure_optim: StructureOptimizer | None = None,
        weights: WeightPosterior | None = None,
        tau: TauSchedule | None = None,
        beta: BetaSchedule | None = None,
        train_samples: int = 4,
        n_samples: int = 100,
        val_samples: int = 10,
        samples_per_forward: int = 10,
        test_tau: float = 1.0,
        theta_init_std: float = 1e-3,
        dataset_size: int | None = None,
        temperature_scaling: bool = False,
        task: Classification | None = None,
        parallel: str = "structure",
        train_samples_per_forward: int | None = None,
    ) -> None:
        super().__init__(
            net, optim, weights, train_samples, n_samples, val_samples, samples_per_forward, dataset_size,
            temperature_scaling, task, parallel=parallel, train_samples_per_forward=train_samples_per_forward,
        )
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
        self._examples = 0
        self._warned_tau = False

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
        self._examples = int(self.examples_seen)

    def on_train_epoch_start(self) -> None:
        self.beta.fill_(self.beta_schedule(self.current_epoch))
        self.log_structure_state()

    def on_after_optimizer_step(self, batch_size: int) -> None:
        self._examples += self.examples_per_step(batch_size)
        self.examples_seen.fill_(self._examples)

    def run_facts(self) -> dict[str, float]:
        return {**super().run_facts(), "train_tau_final": self.trained_tau, "test_tau": self.test_tau}

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
            on_step=False, on_epoch=True,
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
        alpha = self.structure.sample(n, self.beta, self.tau)  # (n, E, K), reparameterised
        return alpha, self.structure.kl(alpha, self.beta, self.tau)  # (n,)

    @torch.no_grad()
    def sample_structures(self, n: int, tau: float | None = None) -> Tensor:
        """n structures α ~ q(α | θ, β) at temperature `tau` (default: test_tau), (n, E, K)."""
        return self.structure.sample(n, self.beta, self.test_tau if tau is None else tau)

    def prediction_structures(self, n: int) -> Tensor:
        return self.sample_structures(n)

    @torch.no_grad()
    def structure_probabilities(self) -> Tensor:
        """softmax(θ / β): the law of the op with the largest weight, argmax_k α_k, under the
        sharpened concrete (Gumbel-max; independent of τ)."""
        return torch.softmax(self.structure.theta / self.beta, dim=-1)
