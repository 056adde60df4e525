"""Inference over seeds that share one test set: the interval of a mean over k seeds' estimates
(a paired difference, or a method's metric) that counts each source of noise once, and what Holm's
correction can reject at that number of seeds.

**The model.** Seed s's estimate is X_s = μ + a_s + t_s: a_s its seed effect (variance σ²,
independent across seeds) and t_s its test-set noise, correlated across seeds that share one test
set: Cov(t) = Σ, c its mean off-diagonal entry. With s² the seeds' sample variance,

    Var(X̄) = σ²/k + 1ᵀΣ1/k²,    E[s²] = σ² + (tr Σ − 1ᵀΣ1/k)/(k − 1),    so  Var(X̄) = E[s²]/k + c:

the seeds' spread already holds the test noise in which they differ; only the shared part c is
added (adding the whole test-noise variance, as a bootstrap of the mean would, counts each seed's
own noise twice). `combine_seeds` takes Σ: the covariance of the seeds' metrics over common
resamples of the test examples, or without per-example data a bound (`bounded_covariance`).

**Degrees of freedom** are Welch–Satterthwaite's, with s² at its one-sided 75 % upper confidence
bound s²(k − 1)/χ²_{k−1}(0.25): the plug-in version is liberal at few seeds (a small s² by chance
gives many degrees of freedom and a short interval at once); this holds the level at k = 3 over
every ratio of c to s²/k (coverage: docs/evaluation.md). **Holm at few seeds**: its first step (p <= alpha/m)
can need a t beyond reach (`holm_threshold`, `holm_reachable`, `holm_note`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "HOLM_REACH",
    "SeedLevel",
    "bounded_covariance",
    "combine_seeds",
    "holm_note",
    "holm_reachable",
    "holm_threshold",
    "resampled_covariance",
]

#: the confidence of the upper bound on s² that the degrees of freedom use (module docstring)
DF_UPPER_QUANTILE = 0.25
#: Holm's first step is out of reach where, at the comparison's degrees of freedom, it needs a |t| more than
#: this many times the one it needs with the noise known (normal theory: many seeds)
HOLM_REACH = 2.0


class SeedLevel(NamedTuple):
    """The mean over seeds with its interval at `level`, the p-value of its t test against 0 and the
    test's degrees of freedom (inf: normal theory)."""

    value: float
    low: float
    high: float
    p: float
    df: float


def _quantile(q: float, df: float) -> float:
    from scipy.stats import norm, t

    return float(norm.ppf(q)) if math.isinf(df) else float(t.ppf(q, df))


def _two_sided_p(statistic: float, df: float) -> float:
    from scipy.stats import norm, t

    return float(2 * (norm.sf(abs(statistic)) if math.isinf(df) else t.sf(abs(statistic), df)))


def combine_seeds(values: Tensor, test_cov: Tensor, level: float) -> SeedLevel:
    """The mean of k seeds' estimates `values` (k,) whose test-set noise has covariance `test_cov`
    (k, k), with its t interval at `level` and p-value (module docstring): variance s²/k + c, c the
    mean off-diagonal of `test_cov` (at least 0), degrees of freedom Welch–Satterthwaite's with s²
    at its upper bound. k = 1: normal theory on the test noise alone, value ± z·sqrt(test_cov)
    (a caller with the resamples keeps its percentile interval instead, and this p). Seeds that agree
    exactly, with no shared noise measured, fall back to the test noise of the mean, 1ᵀΣ1/k²."""
    values, test_cov = values.double().flatten(), test_cov.double().reshape(len(values), len(values))
    k = len(values)
    value = float(values.mean())
    shared_mean = max(float(test_cov.sum()) / k**2, 0.0)
    if k == 1:
        variance, df = shared_mean, math.inf
    else:
        from scipy.stats import chi2

        seeds = float(values.var()) / k
        c = max((float(test_cov.sum()) - float(test_cov.diagonal().sum())) / (k * (k - 1)), 0.0)
        variance = seeds + c
        upper = seeds * (k - 1) / float(chi2.ppf(DF_UPPER_QUANTILE, k - 1))
        df = math.inf if upper == 0 else (upper + c) ** 2 / (upper**2 / (k - 1))
        if variance == 0:
            variance, df = shared_mean, math.inf
    if variance == 0:
        return SeedLevel(value, value, value, 1.0 if value == 0 else 0.0, df)
    se = variance**0.5
    half = _quantile((1 + level) / 2, df) * se
    return SeedLevel(value, value - half, value + half, _two_sided_p(value / se, df), df)


def resampled_covariance(resampled: Tensor) -> Tensor:
    """(k, k) covariance of k seeds' values on the same resamples of the test examples (k, resamples):
    their test noise's covariance, the bootstrap's estimate."""
    resampled = resampled.double()
    if resampled.shape[1] < 2:
        return torch.zeros(len(resampled), len(resampled), dtype=torch.float64)
    return torch.cov(resampled).reshape(len(resampled), len(resampled))


def bounded_covariance(intervals: list, level: float = 0.95) -> Tensor:
    """(k, k) upper bound on the test noise's covariance of k seeds from each seed's interval [low,
    high] alone: each seed's test SD (high − low) / (2 z), and the seeds' noises perfectly correlated
    (the covariance of two seeds is at most the product of their SDs), so c is never understated."""
    from scipy.stats import norm

    z = float(norm.ppf((1 + level) / 2))
    sd = torch.tensor([(float(high) - float(low)) / (2 * z) for low, high in intervals], dtype=torch.float64)
    return torch.outer(sd, sd)


def holm_threshold(m: int, df: float, alpha: float = 0.05) -> float:
    """The |t| Holm's first step needs in a family of `m`: its p at most alpha / m, at `df`."""
    return _quantile(1 - alpha / (2 * m), df)


def holm_reachable(m: int, df: float, alpha: float = 0.05) -> bool:
    """Whether Holm's first step is within reach at `df`: it needs at most `HOLM_REACH` times the |t| it
    needs with the noise known (at m = 30: up to 4 degrees of freedom it is not; 24.5 at 2 against 3.1)."""
    return holm_threshold(m, df, alpha) <= HOLM_REACH * holm_threshold(m, math.inf, alpha)


def holm_note(m: int, dfs: list[float], alpha: float = 0.05) -> str:
    """The report's sentence on the comparisons of a family of `m` that Holm's first step cannot reach
    at their degrees of freedom `dfs` (one per such comparison; "" for none)."""
    if not dfs:
        return ""
    low, high = min(dfs), max(dfs)
    at = f"{low:.1f}" if high - low < 0.05 else f"{low:.1f}–{high:.1f}"
    needs = sorted({round(holm_threshold(m, df, alpha), 1) for df in (low, high)})
    span = "–".join(f"{x:.1f}" for x in needs)
    return (
        f"Holm's correction cannot reach significance for {len(dfs)} of these {m} comparisons at their few seeds "
        f"unless |t| ≥ {span}: its first step needs p ≤ {alpha / m:.2g} ({alpha:g} / {m}), which is that |t| at "
        f"their {at} degrees of freedom, against {holm_threshold(m, math.inf, alpha):.1f} with the noise known "
        f"(many seeds). Read their `*` one comparison at a time, knowing that {m} were made, or add seeds."
    )
