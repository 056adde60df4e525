"""The cyclical step size of cSG-MCMC (Zhang, Li, Zhang, Chen & Wilson, ICLR 2020, Eq. 1), its two
stages, and the steps after which a chain's state is kept as a sample.

A run of K optimiser steps is cut into M cycles; cycle c is steps ⌊cK/M⌋ … ⌊(c + 1)K/M⌋ − 1 (the
paper's ⌈K/M⌉ steps each when M divides K, as in every recipe here). At position r ∈ [0, 1) of its
cycle (steps done in the cycle over its length L) the step size is

    α = α₀ / 2 · (cos(π r) + 1),

from α₀ at the cycle's start down to nearly 0 at its end, then back to α₀ (a warm restart). The
first part of each cycle, r < `exploration` (the paper's β), is the **exploration** stage: no
noise, SGD with momentum on large steps that moves the chain to a new mode. The rest is the
**sampling** stage: noise on, small steps that explore the mode. This is the paper's and the
authors' code's naming (their CIFAR scripts add noise when ``epoch % 50 + 1 > 45``: the last 5 of
50 epochs, `exploration` = 0.9).

Samples are kept at each cycle's end: after its last step and every d·L steps before it
(`samples_per_cycle` of them, `sample_spacing` d, rounded to a whole number of steps, at least
one), i.e. at positions 1, 1 − d, 1 − 2d, … The authors keep the network after each of the last 3
epochs of a 50-epoch cycle: d = 0.02. The spacing is a fraction of a cycle, so one setting serves
any run length; in a short run the samples are at least one step apart. Knows nothing of networks
or optimisers: steps in, step sizes and stages out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CyclicalSchedule"]


@dataclass(frozen=True)
class CyclicalSchedule:
    """M cycles of a cosine step size, each an exploration then a sampling stage, and the steps
    after which a sample is kept (see the module docstring). Every method takes the step (0 for
    the run's first) and the run's length K in steps.

    Args:
        cycles: M (the authors' 4 on CIFAR).
        exploration: the fraction of each cycle without noise (the paper's β; the authors' 0.9).
            0: noise throughout; 1: never (SGD with warm restarts, as snapshot ensembles).
        samples_per_cycle: samples kept at the end of each cycle (the authors' 3).
        sample_spacing: the distance between a cycle's samples, as a fraction of the cycle (the
            authors' one epoch of 50: 0.02), rounded to whole steps, at least one.
    """

    cycles: int = 4
    exploration: float = 0.9
    samples_per_cycle: int = 3
    sample_spacing: float = 0.02

    def __post_init__(self) -> None:
        if self.cycles < 1:
            raise ValueError(f"cycles (M) must be >= 1, got {self.cycles}")
        if not 0 <= self.exploration <= 1:
            raise ValueError(f"exploration is the fraction of a cycle without noise, in [0, 1], got {self.exploration}")
        if self.samples_per_cycle < 1:
            raise ValueError(f"samples_per_cycle must be >= 1, got {self.samples_per_cycle}")
        if self.sample_spacing <= 0 or (self.samples_per_cycle - 1) * self.sample_spacing >= 1:
            raise ValueError(
                f"sample_spacing must be > 0 and put the {self.samples_per_cycle} samples of a cycle inside "
                f"it ((samples_per_cycle - 1) x sample_spacing < 1), got {self.sample_spacing}"
            )

    @property
    def kept(self) -> int:
        """Samples kept over the run: M × `samples_per_cycle`."""
        return self.cycles * self.samples_per_cycle

    def check(self, total_steps: int) -> None:
        """Refuse a run of `total_steps` too short for the schedule: cycles too short to keep their
        samples (a run of fewer than cycles × samples_per_cycle steps)."""
        shortest = total_steps // self.cycles
        if shortest < 1 or self._sample_offsets(shortest)[0] < 0:
            raise ValueError(
                f"a run of {total_steps} steps in {self.cycles} cycles cannot keep {self.samples_per_cycle} "
                f"samples {self.sample_spacing:g} of a cycle apart in each: train longer "
                "(trainer.max_epochs), or lower the sampler's cycles, samples_per_cycle or sample_spacing"
            )

    def cycle(self, step: int, total_steps: int) -> int:
        """The cycle of `step`: the c with ⌊cK/M⌋ <= step < ⌊(c + 1)K/M⌋."""
        if not 0 <= step < total_steps:
            raise ValueError(f"step {step} is outside the schedule's {total_steps} steps")
        return ((step + 1) * self.cycles + total_steps - 1) // total_steps - 1

    def bounds(self, cycle: int, total_steps: int) -> tuple[int, int]:
        """The first step of `cycle` and the first after it."""
        return cycle * total_steps // self.cycles, (cycle + 1) * total_steps // self.cycles

    def _place(self, step: int, total_steps: int) -> tuple[int, int, int]:
        """(steps done in the cycle before `step`, the cycle's length, its first step)."""
        start, end = self.bounds(self.cycle(step, total_steps), total_steps)
        return step - start, end - start, start

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The step size at `step` over α₀: (cos(π r) + 1) / 2 (Eq. 1)."""
        done, length, _ = self._place(step, total_steps)
        return 0.5 * (math.cos(math.pi * done / length) + 1.0)

    def sampling(self, step: int, total_steps: int) -> bool:
        """Whether `step` is in its cycle's sampling stage (noise on): r >= `exploration`, the
        boundary rounded to the nearest step."""
        done, length, _ = self._place(step, total_steps)
        return done >= round(self.exploration * length)

    def _sample_offsets(self, length: int) -> list[int]:
        """Steps into a cycle of `length` steps after which the samples are kept, in order (the
        first negative when the cycle is too short to keep them all)."""
        spacing = max(1, round(self.sample_spacing * length))
        return [length - 1 - j * spacing for j in reversed(range(self.samples_per_cycle))]

    def sample_steps(self, cycle: int, total_steps: int) -> list[int]:
        """The steps of `cycle` after which the chain's state is kept, in order."""
        start, end = self.bounds(cycle, total_steps)
        return [start + offset for offset in self._sample_offsets(end - start)]

    def keeps(self, step: int, total_steps: int) -> bool:
        """Whether the state after `step` is a sample."""
        return step in self.sample_steps(self.cycle(step, total_steps), total_steps)
