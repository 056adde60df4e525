"""Cyclical SG-MCMC (Zhang, Li, Zhang, Chen & Wilson, ICLR 2020) as methods: a chain that keeps
samples near the end of each cycle of a cosine step size (their Eq. 1), and predicts with the
Bayes ensemble of the samples it kept.

| config           | class              | structure                                  | weights                            |
|------------------|--------------------|--------------------------------------------|------------------------------------|
| csghmc           | CSGMCMC            | fixed α (the cell network) / none          | cSGHMC (friction 0.9), T = 1/N     |
| csgld            | CSGMCMC            | fixed α (the cell network) / none          | cSGLD (friction 1), T = 1/N        |
| csghmc_structure | StructureCSGMCMC   | T chains of cSGHMC on α's Gumbel logits    | point, SGD as DBSN trains them     |

The sampler is an optimiser (`dbsn.sampling.CyclicalSGMCMC`); the methods say which parameters it
moves, which samples are kept and how they predict. `CSGMCMC` samples every weight; a sample is the
network's parameters *and BatchNorm statistics* (as the authors' saved `state_dict`), 3 per cycle,
12 in all, and member s predicts with sample s's tensors swapped in (`torch.func.functional_call`).
`StructureCSGMCMC` samples DBSN's prior's Gumbel logits u under the likelihood, so that
softmax(u / τ) is a draw of the posterior p(α | D, w) under DBSN's prior; its weights are point
estimates trained by SGD on the T chains' structures (a Monte Carlo EM). Both predict with S = the
number of kept samples (`n_samples` cannot ask for another S). The samples live in a `SampleSet`
in the checkpoint, so a resumed run continues as the uninterrupted one. In full: docs/methods.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from dbsn.methods.base import Method, Parallel
from dbsn.methods.map import MAP
from dbsn.methods.weights import WeightPosterior
from dbsn.sampling import CyclicalSampler, CyclicalSGMCMC, SampleSet

__all__ = ["CSGMCMC", "StructureCSGMCMC", "gumbel_energy", "network_tensors", "run_steps"]


def run_steps(trainer) -> int:
    """K, the optimiser steps of the run `trainer` is set up for (its epochs × batches, or
    `max_steps` when that is shorter)."""
    if trainer.max_epochs is None or trainer.max_epochs < 1:
        raise ValueError(f"The sampler's cycles divide the run: set trainer.max_epochs (got {trainer.max_epochs}).")
    steps = trainer.estimated_stepping_batches
    if not math.isfinite(steps):
        raise ValueError(
            "The sampler's cycles divide the run, and its length is unknown (an iterable without a length): "
            "set trainer.max_steps."
        )
    return int(steps)


def network_tensors(net: nn.Module) -> dict[str, Tensor]:
    """The network's parameters and persistent buffers (BatchNorm statistics), by name."""
    persistent = net.state_dict(keep_vars=True).keys()
    return {name: t for name, t in [*net.named_parameters(), *net.named_buffers()] if name in persistent}


def gumbel_energy(u: Tensor) -> Tensor:
    """−log Π Gumbel(u_ek; 0, 1) of each chain's logits u (T, E, K), constants dropped: Σ u + e^(−u),
    (T,)."""
    return (u + torch.exp(-u)).sum((-2, -1))


def _point_weights(settings: dict, name: str) -> None:
    weights = settings.get("weights")
    if weights is not None and type(weights) is not WeightPosterior:
        raise ValueError(
            f"{name} has point-estimate weights between its samples; it cannot take "
            f"{type(weights).__name__} (leave model.weights unset)"
        )


class ChainMembers:
    """What both methods share (put it first): the sampler's settings, the kept samples as the
    prediction's members (S = how many were kept), kept after the schedule's steps."""

    # Its members are the kept samples, fixed once trained: S does not apply (the registry's
    # fixed_members), though the chain samples during training.
    samples_weights = False
    # Deep-ensemble members train without their own step hooks, which keep the samples.
    epoch_state = True

    def _start_chain(self, sampler: CyclicalSampler | None) -> None:
        self.sampler = sampler if sampler is not None else CyclicalSampler()
        for key in ("n_samples", "val_samples"):
            if getattr(self.prediction, key) != 1:
                raise ValueError(
                    f"prediction.{key}={getattr(self.prediction, key)}: a {type(self).__name__} predicts "
                    "with the samples its chain keeps (sampler.schedule: cycles x samples_per_cycle); "
                    f"leave prediction.{key} at 1"
                )
        self.samples = SampleSet()

    def _current_members(self) -> int:
        """Members before any sample is kept: the chains' current states."""
        raise NotImplementedError

    @property
    def is_stochastic(self) -> bool:
        return True

    @property
    def n_samples(self) -> int:
        """S: the samples kept (before the first, the chains' current states)."""
        return self.samples.count or self._current_members()

    @n_samples.setter
    def n_samples(self, value: int) -> None:
        if int(value) != self.n_samples:
            raise ValueError(
                f"a {type(self).__name__} predicts with the S = {self.n_samples} samples its chain kept: "
                f"it cannot predict with S = {value} (leave n_samples unset)"
            )

    def _num_draws(self, n_samples: int | None) -> int:
        return self.n_samples

    def resolved_dataset_size(self) -> int:
        """N, read from the data module when unset (the optimisers are built before `on_fit_start`)."""
        if self.dataset_size is None:
            datamodule = getattr(self.trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "num_train"):
                raise ValueError("dataset_size is unset and the data module does not report num_train")
            self.dataset_size = int(datamodule.num_train)
        return self.dataset_size

    def chain_optimizer(self) -> CyclicalSGMCMC | None:
        """The run's sampler (None outside a fit)."""
        trainer = self._trainer
        return next(
            (o for o in (trainer.optimizers if trainer is not None else []) if isinstance(o, CyclicalSGMCMC)), None
        )

    def keep_sample(self, step: int) -> None:
        """Keep the chains' state after `step` as samples."""
        raise NotImplementedError

    def on_after_optimizer_step(self, batch_size: int) -> None:
        super().on_after_optimizer_step(batch_size)
        opt = self.chain_optimizer()
        if opt is None:
            return
        if opt.keeps():
            self.keep_sample(opt.steps - 1)
        group = opt.param_groups[0]
        self.log_dict(
            {
                "sampler/lr": opt.lr(group, opt.steps - 1),
                "sampler/noise_std": opt.noise_std(group, opt.steps - 1),
                "sampler/samples": float(self.samples.count),
            },
            on_step=True,
            on_epoch=False,
        )

    def run_facts(self) -> dict[str, float]:
        facts = {**super().run_facts(), "samples_kept": self.samples.count}
        if self.dataset_size is not None:
            facts["sampler_temperature"] = self.sampler.posterior_temperature(self.dataset_size)
        opt = self.chain_optimizer()
        if opt is not None:  # the largest noise a step added (at T = 1/N about 3e-6 on CIFAR: nearly SGD's path)
            facts["sampler_noise_std_max"] = opt.peak_noise_std()
        return facts


class CSGMCMC(ChainMembers, MAP):
    """cSGHMC / cSGLD on every weight of a network (see the module docstring).

    Args:
        sampler: the sampler's settings (`CyclicalSampler`: step size, friction, weight decay,
            temperature, cycles); they replace SGD's (`optim` is refused).
        learn_structure: must stay False: on DBSN's cell network the structure is fixed (the
            uniform α, or `fixed_structure`); `model=csghmc_structure` samples structures.
        settings: `MAP`'s (fixed_structure) and `Method`'s (prediction, execution, task,
            dataset_size); the weights are point estimates between samples.
    """

    optimizer_key = "sampler"
    # cSGHMC and cSGLD are one class; the friction tells them apart (a dotted key of the config)
    variant_keys = (*Method.variant_keys, "sampler.friction")

    def __init__(
        self, net: nn.Module, *, sampler: CyclicalSampler | None = None, learn_structure: bool = False, **settings
    ) -> None:
        if learn_structure:
            raise ValueError(
                f"{type(self).__name__} samples the weights of a network with a fixed structure: leave "
                "model.learn_structure=false (the uniform alpha, or model.fixed_structure); "
                "model=csghmc_structure samples the structure"
            )
        if "optim" in settings:
            raise ValueError(
                f"{type(self).__name__}'s weights move by its sampler, not SGD: set model.sampler.* "
                "(lr, friction, weight_decay, temperature, schedule), not model.optim"
            )
        _point_weights(settings, type(self).__name__)
        super().__init__(net, learn_structure=False, **settings)
        if self.execution.cuda_graph_prediction:
            raise ValueError(
                f"{type(self).__name__} predicts with each sample's tensors swapped into the network, which "
                "a captured forward would not see: set model.execution.cuda_graph_prediction=false"
            )
        self._start_chain(sampler)
        self._on_device: dict[tuple[int, torch.device], tuple[dict, dict[str, Tensor]]] = {}

    def _current_members(self) -> int:
        return 1

    # ------------------------------------------------------------------ training
    def weight_parameter_groups(self) -> list[list[nn.Parameter]]:
        """None: no weight trains by SGD (the sampler moves them all)."""
        return []

    def run_optimizers(self, total_steps: int, max_epochs: int | None = None) -> tuple[list, list]:
        """The optimisers of a run of `total_steps` steps: the sampler over every weight."""
        sampler = self.sampler.build(
            self.weight_parameters(),
            total_steps=total_steps,
            dataset_size=self.resolved_dataset_size(),
            seed=torch.initial_seed(),
        )
        return [sampler], []

    def configure_optimizers(self):
        return self.run_optimizers(run_steps(self.trainer))

    @torch.no_grad()
    def keep_sample(self, step: int) -> None:
        self.samples.append(network_tensors(self.net), step)

    # ------------------------------------------------------------------ prediction
    def _member(self, index: int, device: torch.device) -> dict[str, Tensor]:
        """Sample `index`'s tensors on `device`, copied there once."""
        source = self.samples[index]
        cached = self._on_device.get((index, device))
        if cached is None or cached[0] is not source:
            cached = (source, {name: t.to(device) for name, t in source.items()})
            self._on_device[index, device] = cached
        return cached[1]

    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits of members first .. first + n − 1 (counted modulo the samples kept), (n, b, C):
        one forward of the network per member, with that sample's parameters and BatchNorm
        statistics; before the first sample, the network as it is."""
        if not self.samples.count:
            logits = super().stochastic_forward(x, 1)
            return logits.expand(n, *logits.shape[1:])
        alpha = self.prediction_structures(1)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return torch.stack(
            [
                self.task.class_last(
                    functional_call(
                        self.net, self._member(m % self.samples.count, x.device), (x, alpha), {"replicate": True}
                    )
                )
                for m in range(first, first + n)
            ]
        )

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]] | None:
        """Each member's last layer: the sample's `classifier` weights."""
        head, heads = self.feature_head(), super().member_heads(n)
        if heads is None or not self.samples.count:
            return heads
        names = {id(p): name for name, p in self.net.named_parameters()}
        weight, bias = names.get(id(getattr(head, "weight", None))), names.get(id(getattr(head, "bias", None)))
        if weight is None:
            return None
        device = heads[0][0].device
        return [
            (
                self.samples[j % self.samples.count][weight].to(device),
                heads[j][1] if bias is None else self.samples[j % self.samples.count][bias].to(device),
            )
            for j in range(n)
        ]


class StructureCSGMCMC(ChainMembers, Method):
    """T chains of cSGHMC on the Gumbel logits of DBSN's structure, the weights trained by SGD (see
    the module docstring).

    DBSN's prior is α = softmax(u / τ), u_ek ~ Gumbel(0, 1) (q(α | θ) at θ = 0, β = 1). The chains
    sample p(u | D, w) ∝ p(D | softmax(u / τ), w) Π Gumbel(u_ek), whose image under softmax(· / τ) is
    the posterior p(α | D, w) itself (the likelihood sees u only through α). The T chains' states
    are the step's T structures; the weights are trained by SGD on their mean NLL, as DBSN trains
    them (a Monte Carlo EM); each kept u_s is one member α_s = softmax(u_s / τ), predicting with the
    final weights and BatchNorm's running statistics.

    Args:
        net: a structure network (`num_edges > 0`, DBSN's cells).
        sampler: the chains' sampler (`CyclicalSampler`); its weight decay must be 0 (the prior on
            the logits is DBSN's, in the loss).
        structure_tau: τ of α = softmax(u / τ) and of the prior (DBSN's test τ, 1).
        train_samples: T, the chains (DBSN's T = 4 structures per step).
        parallel: as DBSN's ("structure": every device the same batch, T / devices chains each).
        settings: `Method`'s (optim: the weights' SGD, as DBSN's; prediction, execution, task,
            dataset_size, train_samples_per_forward); point-estimate weights.
    """

    networks = "cells"

    def __init__(
        self,
        net: nn.Module,
        *,
        sampler: CyclicalSampler | None = None,
        structure_tau: float = 1.0,
        train_samples: int = 4,
        parallel: Parallel = "structure",
        **settings,
    ) -> None:
        if net.num_edges == 0:
            raise ValueError(
                f"{type(self).__name__} samples the structure of DBSN's cells, and {type(net).__name__} has "
                "none (num_edges = 0): use model/net=structure_net, or model=csghmc on this network"
            )
        _point_weights(settings, type(self).__name__)
        if structure_tau <= 0:
            raise ValueError(f"structure_tau must be > 0, got {structure_tau}")
        super().__init__(net, train_samples=train_samples, parallel=parallel, **settings)
        self._start_chain(sampler)
        if self.sampler.weight_decay:
            raise ValueError(
                "the chains' prior is DBSN's (Gumbel logits, in the loss): set model.sampler.weight_decay=0, "
                f"not {self.sampler.weight_decay}"
            )
        self.structure_tau = structure_tau
        gumbel = torch.distributions.Gumbel(torch.zeros(()), torch.ones(()))
        self.chains = nn.Parameter(gumbel.sample((train_samples, net.num_edges, net.num_ops)))  # prior draws

    def _current_members(self) -> int:
        return self.chains.shape[0]

    # ------------------------------------------------------------------ training
    def structure_parameters(self) -> list[nn.Parameter]:
        return [self.chains]

    def training_structures(self, n: int) -> tuple[Tensor, Tensor]:
        """The chains' structures softmax(u_t / τ) (T, E, K) and T × each chain's prior energy: the
        loss averages the T structures (the weights' loss, DBSN's), so each chain gets 1/T of its
        NLL's gradient and of this term's mean; its gradient is scaled back by T (the value is
        unchanged), so chain t moves on its own energy N · NLL_t − log p(u_t), over N."""
        u = self.chains
        if n != u.shape[0]:
            raise ValueError(f"{n} structures asked of {u.shape[0]} chains")
        scaled = u.detach() + n * (u - u.detach())
        return torch.softmax(scaled / self.structure_tau, dim=-1), n * gumbel_energy(u)

    def run_optimizers(self, total_steps: int, max_epochs: int) -> tuple[list, list]:
        """The optimisers of a run of `total_steps` steps in `max_epochs` epochs: the weights' SGD and
        its schedule (DBSN's), then the chains' sampler."""
        sgd, schedule = self.optim.build(
            self.weight_parameters(), max_epochs, self.no_decay_parameters(), self.lr_scales()
        )
        sampler = self.sampler.build(
            self.structure_parameters(),
            total_steps=total_steps,
            dataset_size=self.resolved_dataset_size(),
            seed=torch.initial_seed(),
        )
        return [sgd, sampler], [schedule]

    def configure_optimizers(self):
        return self.run_optimizers(run_steps(self.trainer), self.trainer.max_epochs)

    @torch.no_grad()
    def keep_sample(self, step: int) -> None:
        for u in self.chains:
            self.samples.append({"logits": u}, step)

    # ------------------------------------------------------------------ prediction
    def member_logits(self) -> Tensor:
        """The members' Gumbel logits (S, E, K): the kept samples, or the chains' states before any."""
        if not self.samples.count:
            return self.chains.detach()
        return torch.stack([s["logits"] for s in self.samples.members]).to(self.chains.device)

    def prediction_structures(self, n: int, first: int = 0) -> Tensor:
        """Members first .. first + n − 1 (counted modulo S): α_s = softmax(u_s / τ)."""
        logits = self.member_logits()
        index = torch.arange(first, first + n, device=logits.device) % logits.shape[0]
        return torch.softmax(logits[index] / self.structure_tau, dim=-1)

    @torch.no_grad()
    def structure_probabilities(self) -> Tensor:
        """The share of members whose largest weight on an edge is op k, (E, K)."""
        logits = self.member_logits()
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float().mean(0)
