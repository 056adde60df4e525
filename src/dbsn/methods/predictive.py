"""The predictive distribution of a stochastic model from S stochastic forward passes.

Every stochastic method (DBSN's sampled structures, MC dropout's masks, BBB's weight samples)
predicts with the Bayes ensemble

    p(y | x) ≈ 1/S Σ_s p(y | x, ω_s),        ω_s ~ q(ω),

i.e. it averages *probabilities*, not logits. This module is the one place that computes it:
a method supplies `stochastic_forward(x, n, first) -> logits (n, b, C)`, which evaluates members
first, ..., first + n - 1 in one batched call (for DBSN: one grouped forward over n structures;
fresh draws for a method without a fixed set of members), and the ensemble runs it in chunks of
`samples_per_forward` so that S × batch never has to fit in memory at once. The members'
log-probabilities and their average are computed in float32 whatever the logits' precision
(under `trainer.precision=bf16-mixed` the network's logits are bfloat16). A method's test step
reads its members one chunk at a time into an `EnsembleStream` (the ensemble, the uncertainty
decomposition and the prefix ensembles of the MC-sample ablation, without keeping a member), so
its memory does not grow with S; what it predicted for one batch is a `PredictedBatch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dbsn.metrics.uncertainty import decomposition_of, entropy
from dbsn.precision import float32, full

StochasticForward = Callable[[Tensor, int, int], Tensor]


class BayesEnsemble:
    """Average the class probabilities of `n_samples` stochastic forward passes.

    Args:
        n_samples: S, the number of Monte Carlo draws (the paper uses 100).
        samples_per_forward: how many draws share one batched forward; bounds peak memory at
            `samples_per_forward × batch` inputs.
        first: index of the first member (methods with a fixed set of members, e.g. DBSN with
            per-structure BatchNorm statistics, use members first .. first + S - 1).
    """

    def __init__(self, n_samples: int = 100, samples_per_forward: int = 10, first: int = 0) -> None:
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if samples_per_forward < 1:
            raise ValueError(f"samples_per_forward must be >= 1, got {samples_per_forward}")
        self.n_samples = n_samples
        self.samples_per_forward = samples_per_forward
        self.first = first

    def _chunks(self):
        """(number of members, index of the first) of each batched forward."""
        done = 0
        while done < self.n_samples:
            n = min(self.samples_per_forward, self.n_samples - done)
            yield n, self.first + done
            done += n

    def member_chunks(self, stochastic_forward: StochasticForward, x: Tensor) -> Iterator[Tensor]:
        """Log-probabilities of the members, `samples_per_forward` at a time ((n, b, C) each, in
        float32, in member order)."""
        for n, first in self._chunks():
            yield _log_softmax(stochastic_forward(x, n, first))

    def member_log_probs(self, stochastic_forward: StochasticForward, x: Tensor) -> Tensor:
        """Log-probabilities of every member, shaped (S, b, C), in float32."""
        return torch.cat(list(self.member_chunks(stochastic_forward, x)))

    def __call__(self, stochastic_forward: StochasticForward, x: Tensor) -> Tensor:
        """log of the averaged probabilities, log(1/S Σ_s softmax(f_s(x))), shaped (b, C).

        Computed as logsumexp over members minus log S, one chunk at a time, so only
        `samples_per_forward` members are alive at once.
        """
        partial = [torch.logsumexp(_log_softmax(stochastic_forward(x, n, first)), dim=0) for n, first in self._chunks()]
        with float32():
            return torch.logsumexp(torch.stack(partial), dim=0) - math.log(self.n_samples)


def _log_softmax(logits: Tensor) -> Tensor:
    """log softmax over the last dimension, in float32 (at least)."""
    with float32():
        return full(logits).log_softmax(-1)


class EnsembleStream:
    """The Bayes ensemble of members that arrive a chunk at a time, and what the test pass reads of
    it, in memory that does not grow with the number of members:

    - `log_probs()`: log 1/S Σ_s p_s, the members' running logsumexp (uncalibrated);
    - `scores()`: the uncertainty decomposition of the members each calibrated by `calibrate`
      (as `uncertainty_decomposition` of the calibrated members: their running logsumexp and
      their summed entropy);
    - `prefixes`: for each s in `prefix_sizes`, the ensemble of the first s members,
      log 1/s Σ_{t ≤ s} p_t (uncalibrated), what the MC-sample ablation measures. The prefix of
      all the members is the same tensor as `log_probs()` (the same operations in the same order).

    Args:
        calibrate: applied to each member's log-probabilities for the decomposition (None: none).
        prefix_sizes: the prefix ensembles to keep.
    """

    def __init__(self, calibrate: Callable[[Tensor], Tensor] | None = None, prefix_sizes: Sequence[int] = ()) -> None:
        self.calibrate = calibrate
        self.prefix_sizes = sorted({int(s) for s in prefix_sizes})
        self.count = 0
        self.prefixes: dict[int, Tensor] = {}
        self._raw: Tensor | None = None  # logsumexp of the members so far
        self._calibrated: Tensor | None = None  # the same of the calibrated members (when calibrating)
        self._entropy: Tensor | None = None  # Σ H[calibrated member]

    def add(self, members: Tensor) -> None:
        """The next members' log-probabilities, (n, N, C) in float32."""
        n, before = members.shape[0], self._raw
        with float32():
            # the running sum after each member of the chunk, whatever prefixes are asked for: the ensemble
            # is then the same to the last bit with or without them, and the last prefix is the ensemble
            cumulative = torch.logcumsumexp(members, dim=0)
            if before is not None:
                cumulative = torch.logaddexp(before, cumulative)
            for s in self.prefix_sizes:
                if self.count < s <= self.count + n:
                    self.prefixes[s] = cumulative[s - self.count - 1] - math.log(s)
            self._raw = cumulative[-1].clone()  # not a view: the chunk's sums go
            calibrated = members if self.calibrate is None else self.calibrate(members)
            if self.calibrate is not None:
                part = torch.logsumexp(calibrated, dim=0)
                self._calibrated = part if self._calibrated is None else torch.logaddexp(self._calibrated, part)
            spread = entropy(calibrated).sum(dim=0)
            self._entropy = spread if self._entropy is None else self._entropy + spread
        self.count += n

    def extend(self, chunks: Iterable[Tensor]) -> EnsembleStream:
        for chunk in chunks:
            self.add(chunk)
        return self

    def log_probs(self) -> Tensor:
        """(N, C): the ensemble's log-probabilities, before calibration."""
        if self._raw is None:
            raise ValueError("the ensemble has no member yet")
        return self._raw - math.log(self.count)

    def scores(self) -> dict[str, Tensor]:
        """The uncertainty decomposition of the calibrated members, name -> (N,)."""
        summed = self._raw if self.calibrate is None else self._calibrated
        return decomposition_of(summed - math.log(self.count), self._entropy / self.count)


@dataclass(frozen=True)
class PredictedBatch:
    """What `Method.test_step` predicted for one test batch, for whoever records the test pass
    (`dbsn.evaluation.recorder.PredictionRecorder`); the method keeps none of it.

    Attributes:
        inputs: the network inputs x, (b, ...).
        targets: y, (b,) or, per pixel, (b, H, W).
        log_probs: the Bayes ensemble's log-probabilities as the method predicts them
            (`Method.calibrate`), class last: (b, C) or (b, H, W, C).
        scores: the uncertainty decomposition of the members, each calibrated as the
            prediction is (`uncertainty_decomposition`): name -> (b,) or (b, H, W).
        prefixes: s -> the ensemble of the first s members before calibration, one row per
            labelled entry: (b·H·W, C), for each s the test pass asked for
            (`Method.prefix_sizes`: the MC-sample ablation's).
    """

    inputs: Tensor
    targets: Tensor
    log_probs: Tensor
    scores: dict[str, Tensor]
    prefixes: dict[int, Tensor] = field(default_factory=dict)
