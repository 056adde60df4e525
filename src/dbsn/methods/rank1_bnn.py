"""Rank-1 BNN (Dusenberry et al., ICML 2020): BatchEnsemble with a posterior over its fast weights.

The network transform (`dbsn.nets.rank1`) gives every convolution and linear layer random rank-1
factors r, s around its shared weight, their posterior a mixture of M components; this method
trains and predicts with them, following the authors' CIFAR code (uncertainty-baselines
`baselines/cifar/rank1_bnn.py`, `models/rank1_bnn_utils.py`; edward2's `Conv2DRank1` /
`DenseRank1`):

- each training batch repeated M times (`tf.tile`), every row with its own draw of every factor;
  the NLL is the mean over the M·b rows;
- plus the KL of every factor entry of every component against the prior (normal N(1, 0.1²) in
  closed form; Cauchy by a one-draw Monte Carlo estimate, `dbsn.bayes.rank1`), summed, divided by
  N and weighted by a factor rising linearly to 1 at the fraction `kl_annealing` of training;
- SGD's weight decay on the shared weights, BatchNorm and the components' biases, none on the
  factors, which take `fast_weight_lr_multiplier` times the lr; BatchNorm shared, over the whole
  repeated batch in training;
- prediction: the Bayes ensemble of S = K·M members, member j a draw of component j mod M, every
  example its own draw; the evaluation's members (`fixed_members`) are n networks drawn once.

On DBSN's cell network every component uses MAP's point structure. Details: docs/methods.md.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dbsn.bayes.rank1 import FactorDistribution
from dbsn.methods.base import Method
from dbsn.methods.map import MAP
from dbsn.methods.settings import Prediction
from dbsn.methods.weights import WeightPosterior
from dbsn.nets.batch_ensemble import fast_parameters
from dbsn.nets.ops import expand_groups
from dbsn.nets.rank1 import draw_members, holding, rank1, rank1_layers, scale_parameters


class Rank1BNN(MAP):
    """A rank-1 BNN of M components on any network of `nn.Conv2d` / `nn.Linear` layers (see the
    module docstring); the network is transformed in place.

    It is not a `SinglePassEnsemble` as BatchEnsemble is: its members are draws, any number S of
    them, not the M networks inside it.

    Args:
        size: M, the mixture's components (the authors' `ensemble_size` 4).
        prior: "normal" or "cauchy", the family of the factors' prior and posterior.
        prior_mean: the prior's location (the authors' 1).
        prior_stddev: the prior's scale (the authors' 0.1).
        dropout_rate: p of the posterior scales' initial value sqrt(p / (1 − p)) (the authors' 1e-3).
        random_sign_init: initialisation of the factors' locations, BatchEnsemble's flag: p > 0
            random signs with P(+1) = p (the authors' 0.5), p < 0 N(1, p²), 0 every location 1.
        kl_annealing: the fraction of training over which the KL's weight rises to 1 (0: no
            annealing; the authors' 200 of 250 epochs: 0.8).
        fast_weight_lr_multiplier: the factors' lr as a multiple of the weights' (the authors' 1).
        settings: `MAP`'s and `Method`'s; the weights are point estimates. S
            (`prediction.n_samples`, `val_samples`; default M, one draw of each component) weighs
            the components equally where it is a multiple of M; otherwise the first S mod M
            components have one draw more.
    """

    samples_weights = True  # S draws of its factors' posterior

    def __init__(
        self,
        net: nn.Module,
        *,
        size: int = 4,
        prior: str = "normal",
        prior_mean: float = 1.0,
        prior_stddev: float = 0.1,
        dropout_rate: float = 1e-3,
        random_sign_init: float = 0.5,
        kl_annealing: float = 0.8,
        fast_weight_lr_multiplier: float = 1.0,
        prediction: Prediction | None = None,
        **settings,
    ) -> None:
        weights = settings.get("weights")
        if weights is not None and type(weights) is not WeightPosterior:
            raise ValueError(
                f"a rank-1 BNN's shared weights are point estimates; it cannot take "
                f"{type(weights).__name__} (leave model.weights unset)"
            )
        if size < 1:
            raise ValueError(f"size (M, the number of components) must be >= 1, got {size}")
        if not 0 < dropout_rate < 1:
            raise ValueError(
                f"dropout_rate sets the factors' initial stddev sqrt(p / (1 - p)); it must be in (0, 1), "
                f"got {dropout_rate}"
            )
        if not 0 <= kl_annealing <= 1:
            raise ValueError(f"kl_annealing is a fraction of training in [0, 1], got {kl_annealing}")
        if fast_weight_lr_multiplier <= 0:
            raise ValueError(f"fast_weight_lr_multiplier must be > 0, got {fast_weight_lr_multiplier}")
        prediction = prediction if prediction is not None else Prediction(size, size, size)
        distribution = FactorDistribution(prior, prior_mean, prior_stddev)
        init_stddev = math.sqrt(dropout_rate / (1 - dropout_rate))
        net = rank1(net, size, distribution, random_sign_init, init_stddev)
        super().__init__(net, prediction=prediction, **settings)
        self.size = size
        self.distribution = distribution
        self.kl_annealing = kl_annealing
        self.fast_weight_lr_multiplier = fast_weight_lr_multiplier
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # optimiser steps taken: the KL's annealing
        self._held: tuple[int, dict] | None = None  # (n, each layer's draws) of members drawn once: `fixed_members`

    # ------------------------------------------------------------------ the settings
    @property
    def is_stochastic(self) -> bool:
        return True

    def cuda_graph_refusal(self) -> str | None:
        return Method.cuda_graph_refusal(self)

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return super().no_decay_parameters() + self.factor_parameters()

    def lr_scales(self) -> dict[int, float]:
        return {id(p): self.fast_weight_lr_multiplier for p in self.factor_parameters()}

    def factor_parameters(self) -> list[nn.Parameter]:
        """The factors' posterior parameters: the locations r, s and their raw scales."""
        return fast_parameters(self.net) + scale_parameters(self.net)

    # ------------------------------------------------------------------ training
    def training_structures(self, n: int) -> tuple[Tensor, float]:
        """The point structure once per component, (M, E, K) (`n`, T, does not apply)."""
        return self.alpha().unsqueeze(0).expand(self.size, -1, -1), 0.0

    def network(self, x: Tensor, alpha: Tensor) -> Tensor:
        """Every example under G = alpha.shape[0] rows, row i·G + g (the batch repeated G times,
        as the authors' `tf.tile`), one forward with BatchNorm statistics over all the rows: row g
        is component g mod M with a draw of its own, or the g-th held member (`fixed_members`)."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(expand_groups(x, alpha.shape[0]), alpha[:1])  # one group: BatchNorm shared by the rows

    def kl(self) -> Tensor:
        """KL(q || p) of every factor entry of every component and layer, summed."""
        return torch.stack(
            [
                self.distribution.kl(loc, scale)
                for layer in rank1_layers(self.net)
                for loc, scale in zip((layer.r, layer.s), layer.scales())
            ]
        ).sum()

    def kl_scale(self) -> Tensor | float:
        """The KL's weight at this step: (step + 1) / (kl_annealing × the run's steps), at most 1;
        1 without annealing or outside a trainer's fit (a step timed alone)."""
        trainer = self._trainer
        if not self.kl_annealing or trainer is None or not math.isfinite(trainer.num_training_batches):
            return 1.0
        span = self.kl_annealing * trainer.max_epochs * trainer.num_training_batches
        return ((self.steps + 1) / span).clamp(max=1.0)

    def training_loss(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """The mean NLL over the M·b rows + kl_scale · KL / N."""
        out = super().training_loss(x, y)
        kl, scale = self.kl(), self.kl_scale()
        out["loss"] = out["loss"] + scale * kl / self.dataset_size
        out["weight_kl"] = kl
        out["kl_scale"] = torch.as_tensor(scale, dtype=kl.dtype, device=kl.device)
        return out

    def on_after_optimizer_step(self, batch_size: int) -> None:
        self.steps += 1

    # ------------------------------------------------------------------ prediction
    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits (n, b, C) of members first .. first + n - 1, member j a draw of component
        j mod M: one forward of whole rounds of M components (a round more where the members
        start or end inside one), or of the held members themselves."""
        if self._held is not None and first + n <= self._held[0]:
            with holding(self._held[1], slice(first, first + n)):
                logits = self.task.class_last(self.network(x, self.prediction_structures(n)))
            return logits.view(x.shape[0], n, *logits.shape[1:]).transpose(0, 1)
        offset = first % self.size
        rows = math.ceil((offset + n) / self.size) * self.size
        logits = self.task.class_last(self.network(x, self.prediction_structures(rows)))
        return logits.view(x.shape[0], rows, *logits.shape[1:]).transpose(0, 1)[offset : offset + n]

    @contextmanager
    def fixed_members(self, n: int):
        """Members 0 .. n - 1 are n networks drawn once, member j with one draw of component
        j mod M's factors, the same for every example and at every call (the detection scores fit
        on training features and score test features member by member)."""
        if n < 1:
            yield
            return
        held, self._held = self._held, (n, draw_members(self.net, n))
        try:
            yield
        finally:
            self._held = held

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]]:
        """Member j's last layer as one linear map, W_j = diag(s_j) W diag(r_j) with its bias:
        the held draws of its factors, or outside `fixed_members` the locations of component
        j mod M."""
        head = self.feature_head()
        weight = head.layer.weight.detach()
        if self._held is not None and n <= self._held[0]:
            r, s, bias = (None if p is None else p[:n] for p in self._held[1][head])
        else:
            components = torch.arange(n, device=weight.device) % self.size
            r, s = head.r.detach()[components], head.s.detach()[components]
            bias = None if head.bias is None else head.bias.detach()[components]
        bias = weight.new_zeros(n, weight.shape[0]) if bias is None else bias
        return [(s[j, :, None] * weight * r[j, None, :], bias[j]) for j in range(n)]
