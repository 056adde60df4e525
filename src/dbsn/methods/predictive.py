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
(under `trainer.precision=bf16-mixed` the network's logits are bfloat16). What a method's test
step predicted for one batch, the ensemble with its members and their uncertainty, is a
`PredictedBatch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

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

    def member_log_probs(self, stochastic_forward: StochasticForward, x: Tensor) -> Tensor:
        """Log-probabilities of every member, shaped (S, b, C), in float32."""
        return torch.cat([_log_softmax(stochastic_forward(x, n, first)) for n, first in self._chunks()])

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
        members: the S members' log-probabilities before calibration, one row per labelled
            entry: (S, b·H·W, C) (what the MC-sample ablation ensembles prefix by prefix).
    """

    inputs: Tensor
    targets: Tensor
    log_probs: Tensor
    scores: dict[str, Tensor]
    members: Tensor
