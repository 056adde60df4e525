"""cSGHMC and cSGLD (Zhang et al., ICLR 2020) as a PyTorch optimiser over any parameters.

One step, for a loss that is a *per-example* mean (the energy U(w) = −log p(D | w) − log p(w)
divided by N, the training set's size), gradient g, at step size α_k (`CyclicalSchedule`):

    d = g + λ w                                   (weight decay λ: a Gaussian prior N(0, 1 / (N λ)))
    v ← (1 − a) v − α_k d + √(2 α_k a T / N) ε,   ε ~ N(0, I), only in the sampling stage
    w ← w + v

This is the authors' code (ruqizhang/csgmcmc, `experiments/cifar_csghmc.py`, `update_params`): `a`
is their `alpha`, the friction, and 1 − a the momentum; a = 1 is SGLD (their `cifar_csgmcmc.py`,
which adds the same noise through the loss to a momentum-free SGD step). With the loss a mean,
α_k g = (α_k / N) ∇U, so the chain is SGHMC on U with step η = α_k / N and noise variance 2 a η T:
it samples p(w | D)^(1/T) ∝ exp(−U / T). `temperature` T = 1 is the posterior itself; T = 0 turns
the noise off (SGD with momentum 1 − a on the cyclical step size, with the step size inside the
velocity as above); 0 < T < 1 is a cold posterior. The authors' CIFAR runs use T = 1/N
(`--temperature 1/50000`, "1/dataset_size"), a very cold one.

Each param group's `peak_lr` is α₀ and its `lr` the step size of the next step (what an lr monitor
logs). The noise comes from the optimiser's own generator, seeded at construction and saved in its state
dict with the velocities and the step count: a resumed chain continues exactly (its place in the
cycle, its momentum, its noise), and processes that share the seed draw the same noise (DDP ranks
keep identical weights). Knows nothing of networks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim import Optimizer

from dbsn.sampling.schedule import CyclicalSchedule

__all__ = ["CyclicalSGMCMC", "CyclicalSampler"]


class CyclicalSGMCMC(Optimizer):
    """cSGHMC (friction < 1) or cSGLD (friction = 1) over `params` (see the module docstring).

    Args:
        params: the parameters (or param groups) the chain moves.
        lr: α₀, the step size at each cycle's start (the authors' 0.5).
        schedule: the cycles, their stages and the kept samples.
        total_steps: K, the run's length in steps (the schedule's cycles divide it).
        dataset_size: N, the training set's size (the loss is a mean over it).
        friction: a, one minus the momentum (the authors' `alpha`; 1 = SGLD).
        weight_decay: λ, the Gaussian prior's precision per example.
        temperature: T (1: the posterior; 0: no noise).
        seed: the seed of the noise's generator.
    """

    def __init__(
        self,
        params,
        *,
        lr: float,
        schedule: CyclicalSchedule,
        total_steps: int,
        dataset_size: int,
        friction: float = 0.9,
        weight_decay: float = 0.0,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        _check(lr, friction, weight_decay, temperature)
        if dataset_size < 1:
            raise ValueError(f"dataset_size (N) must be >= 1, got {dataset_size}")
        schedule.check(total_steps)
        super().__init__(params, dict(lr=lr, friction=friction, weight_decay=weight_decay, temperature=temperature))
        self.schedule, self.total_steps, self.dataset_size = schedule, int(total_steps), int(dataset_size)
        self.steps = 0  # steps taken: the next step's index
        self.generator = torch.Generator(device=self.param_groups[0]["params"][0].device)
        self.generator.manual_seed(int(seed))
        for group in self.param_groups:
            group.setdefault("peak_lr", group["lr"])
        self._show_lr()

    def lr(self, group: dict, step: int | None = None) -> float:
        """The step size of `group` at `step` (default: the next step)."""
        return group["peak_lr"] * self.schedule.lr_factor(self.steps if step is None else step, self.total_steps)

    def _show_lr(self) -> None:
        """Every group's `lr`: the next step's step size (after the last step, the last one's)."""
        step = min(self.steps, self.total_steps - 1)
        for group in self.param_groups:
            group["lr"] = self.lr(group, step)

    def noise_std(self, group: dict, step: int | None = None) -> float:
        """The noise's standard deviation at `step` (default: the next): √(2 α_k a T / N) in the
        sampling stage, else 0."""
        step = self.steps if step is None else step
        if not self.schedule.sampling(step, self.total_steps):
            return 0.0
        return math.sqrt(2.0 * self.lr(group, step) * group["friction"] * group["temperature"] / self.dataset_size)

    def peak_noise_std(self, group: dict | None = None) -> float:
        """The largest noise standard deviation of the run (of `group`, default the first): at the
        first step of a cycle's sampling stage, where the step size is the largest the noise sees;
        0 when no step samples. At the authors' T = 1/N it is what sets the chain apart from SGD."""
        group = self.param_groups[0] if group is None else group
        peak = 0.0
        for cycle in range(self.schedule.cycles):
            start, end = self.schedule.bounds(cycle, self.total_steps)
            first = start + round(self.schedule.exploration * (end - start))
            if first < end:
                peak = max(peak, self.noise_std(group, first))
        return peak

    def keeps(self) -> bool:
        """Whether the state after the last step taken is one of the schedule's samples."""
        return self.steps > 0 and self.schedule.keeps(self.steps - 1, self.total_steps)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, std = self.lr(group), self.noise_std(group)
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            velocities = [self.state[p].setdefault("velocity", torch.zeros_like(p)) for p in params]
            torch._foreach_mul_(velocities, 1.0 - group["friction"])
            torch._foreach_add_(velocities, grads, alpha=-lr)
            if std > 0:
                torch._foreach_add_(velocities, [self._noise(p) for p in params], alpha=std)
            torch._foreach_add_(params, velocities)
        self.steps += 1
        self._show_lr()
        return loss

    def _noise(self, p: Tensor) -> Tensor:
        device = self.generator.device
        return torch.randn(p.shape, generator=self.generator, device=device, dtype=p.dtype).to(p.device)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "steps": self.steps, "generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.steps = int(state_dict.pop("steps"))
        self.generator.set_state(state_dict.pop("generator").cpu())
        super().load_state_dict(state_dict)
        self._show_lr()


def _check(lr: float, friction: float, weight_decay: float, temperature: float | None) -> None:
    if lr <= 0:
        raise ValueError(f"lr (the cycles' first step size) must be > 0, got {lr}")
    if not 0 < friction <= 1:
        raise ValueError(f"friction (one minus the momentum; 1 = SGLD) must be in (0, 1], got {friction}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0 (1: the posterior, 0: no noise), got {temperature}")


@dataclass
class CyclicalSampler:
    """cSG-MCMC's settings, the authors' CIFAR cSGHMC recipe by default (`CyclicalSGMCMC` for
    what each means).

    Args:
        lr: α₀ (the authors' 0.5 at batch 64).
        friction: one minus the momentum (the authors' `alpha`: 0.9 for cSGHMC, 1 for cSGLD).
        weight_decay: λ (the authors' 5e-4 on every parameter).
        temperature: T; None: 1 / N, the authors' default (`--temperature 1/50000` on CIFAR).
        schedule: the cycles, their stages and the samples kept (`CyclicalSchedule`).
    """

    lr: float = 0.5
    friction: float = 0.9
    weight_decay: float = 5e-4
    temperature: float | None = None
    schedule: CyclicalSchedule = field(default_factory=CyclicalSchedule)

    def __post_init__(self) -> None:
        _check(self.lr, self.friction, self.weight_decay, self.temperature)

    def posterior_temperature(self, dataset_size: int) -> float:
        """T for a training set of `dataset_size`: `temperature`, or 1 / N when it is None."""
        return 1.0 / dataset_size if self.temperature is None else float(self.temperature)

    def build(self, params, *, total_steps: int, dataset_size: int, seed: int = 0) -> CyclicalSGMCMC:
        """The sampler over `params` for a run of `total_steps` steps on `dataset_size` examples."""
        return CyclicalSGMCMC(
            params,
            lr=self.lr,
            schedule=self.schedule,
            total_steps=total_steps,
            dataset_size=dataset_size,
            friction=self.friction,
            weight_decay=self.weight_decay,
            temperature=self.posterior_temperature(dataset_size),
            seed=seed,
        )
