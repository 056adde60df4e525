"""The deep-ensemble equivalent (DEE; Ashukha et al., ICLR 2020, "Pitfalls of in-domain
uncertainty estimation and ensembling in deep learning", sec. 4).

The DEE of a method m is the number of members a deep ensemble needs to match m's calibrated
log-likelihood, DEE(m) = min{k >= 1 : CNLL_DE(k) <= CNLL(m)}, made real-valued by joining the
evaluated ensemble sizes with straight lines. Both NLLs must be calibrated the same way
(temperature fitted on held-out data), or the DEE mixes quality with over-confidence.

Conventions (the paper leaves the ends open): the curve is made monotone by its running minimum
(no bump credits a method with more members than an ensemble needed) and the DEE is its first
crossing, the start of a flat part; a method no better than one network gets 1.0; one better than
the largest ensemble available (size M) gets ``math.inf``, no extrapolation. So the result is 1.0,
a float in [1, M] or inf, never nan, and non-increasing in the NLL.

Its interval (`equivalent_interval`) inverts a test of "the curve at d equals the method's NLL",
Δ(d) = mean_j c_j(d) − mean_l m_l over r ensemble runs and k method runs, with
Var Δ(d) = σ_c²(d) / r + σ_m² / k + wᵀ Σ(d) w: the spread of each side's runs less what the
shared test examples explain, plus the test set's noise (Σ(d), from per-example NLLs), on
Welch–Satterthwaite degrees of freedom. A side with one run has no spread to estimate: that
interval is a lower bound on the uncertainty, and says so (`EquivalentInterval.leaves_out`).
Its coverage in simulation: docs/evaluation.md ("How sure the numbers are").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["EquivalentInterval", "deep_ensemble_equivalent", "deep_ensemble_equivalent_interval", "equivalent_interval"]

#: what an interval leaves out with a single ensemble run, or a single run of the method
ENSEMBLE_RUNS, METHOD_RUNS = "the ensemble's members and seeds (one ensemble run)", "the method's seeds (one run)"


def _curve(sizes: Sequence[int], ensemble_nll: Sequence[float]) -> tuple[list[int], list[float]]:
    """Checked sizes and the running minimum of the ensemble NLL curve."""
    sizes, nlls = list(sizes), [float(v) for v in ensemble_nll]
    if len(sizes) != len(nlls):
        raise ValueError(f"sizes and ensemble_nll differ in length: {len(sizes)} sizes, {len(nlls)} NLLs")
    if len(sizes) < 2:
        raise ValueError(f"need the ensemble NLL at two sizes or more (1 and 2 at least), got sizes {sizes}")
    if any(isinstance(s, bool) or int(s) != s for s in sizes):
        raise ValueError(f"ensemble sizes must be whole numbers of members, got {sizes}")
    sizes = [int(s) for s in sizes]
    if sizes[0] != 1:
        raise ValueError(f"ensemble sizes must start at 1 member, got {sizes}")
    if any(b <= a for a, b in pairwise(sizes)):
        raise ValueError(f"ensemble sizes must be strictly increasing, got {sizes}")
    if not all(math.isfinite(v) for v in nlls):
        raise ValueError(f"ensemble NLLs must be finite, got {nlls}")
    running = [nlls[0]]
    for v in nlls[1:]:
        running.append(min(running[-1], v))
    return sizes, running


def deep_ensemble_equivalent(nll: float, sizes: Sequence[int], ensemble_nll: Sequence[float]) -> float:
    """The DEE of a method whose (calibrated) NLL is `nll`, against a deep ensemble whose
    (calibrated) NLL at `sizes[i]` members is `ensemble_nll[i]`.

    `sizes` are strictly increasing whole numbers starting at 1, at least two of them. Returns
    1.0 if `nll` is no better than one network, inf if it beats the largest ensemble evaluated,
    else the linearly interpolated first crossing of the curve's running minimum (see the
    module docstring). A k-member ensemble's own NLL gives exactly k on a decreasing curve.
    """
    sizes, running = _curve(sizes, ensemble_nll)
    nll = float(nll)
    if math.isnan(nll):
        raise ValueError("nll is nan: the method's NLL must be a number")
    if nll >= running[0]:
        return 1.0
    for i in range(1, len(sizes)):
        if running[i] <= nll:  # first crossing: running[i - 1] > nll >= running[i]
            fraction = (running[i - 1] - nll) / (running[i - 1] - running[i])
            return sizes[i - 1] + fraction * (sizes[i] - sizes[i - 1])
    return math.inf


def deep_ensemble_equivalent_interval(
    low_nll: float, high_nll: float, sizes: Sequence[int], ensemble_nll: Sequence[float]
) -> tuple[float, float]:
    """An NLL interval [low_nll, high_nll] mapped through the DEE: (dee_low, dee_high).

    The DEE falls as the NLL rises, so the ends swap: dee_low is the DEE of `high_nll` and
    dee_high that of `low_nll`. Only the method's interval is carried; the ensemble curve is
    taken as exact.
    """
    if not low_nll <= high_nll:
        raise ValueError(f"need low_nll <= high_nll, got [{low_nll}, {high_nll}]")
    return (
        deep_ensemble_equivalent(high_nll, sizes, ensemble_nll),
        deep_ensemble_equivalent(low_nll, sizes, ensemble_nll),
    )


class EquivalentInterval(NamedTuple):
    """The deep-ensemble equivalent with its interval (module docstring); `leaves_out`: the sources of
    noise the interval does not carry (empty: none), which make it a lower bound on the uncertainty."""

    value: float
    low: float
    high: float
    leaves_out: tuple[str, ...]


def _seed_variance(means: Tensor, test_cov: Tensor) -> tuple[Tensor, Tensor]:
    """(population variance between runs, never below 0; the runs' sample variance) of `means` (..., runs)
    whose test-set noise has covariance `test_cov` (..., runs, runs): E[s²] = σ² + (tr Σ − 1ᵀΣ1 / r) / (r − 1)."""
    r = means.shape[-1]
    sample = means.var(-1)
    shared = (test_cov.diagonal(dim1=-2, dim2=-1).sum(-1) - test_cov.sum((-2, -1)) / r) / (r - 1)
    return (sample - shared).clamp_min(0.0), sample


def equivalent_interval(
    method_nll: Tensor, ensemble_nll: Tensor, sizes: Sequence[int], level: float = 0.95, steps: int = 100
) -> EquivalentInterval:
    """The deep-ensemble equivalent of a method and its interval at `level` (module docstring), from
    per-example (calibrated) NLLs on one test set: `method_nll` (k, n), one row per run of the method;
    `ensemble_nll` (r, len(sizes), n), each ensemble run's NLL at each of `sizes` (its first s members).
    The curve between two sizes is searched at `steps` points."""
    from scipy.stats import t as student

    method_nll, ensemble_nll = torch.as_tensor(method_nll).double(), torch.as_tensor(ensemble_nll).double()
    k, n = method_nll.shape
    r, count, n_ensemble = ensemble_nll.shape
    sizes, _ = _curve(sizes, [0.0] * count)
    if n_ensemble != n or n < 2:
        raise ValueError(f"the method and the ensemble need the same test examples (two or more): {n} and {n_ensemble}")
    curve = ensemble_nll.mean((0, 2))  # (sizes,)
    method = float(method_nll.mean())
    value = deep_ensemble_equivalent(method, sizes, curve.tolist())
    # the grid of sizes d and each one's weights on the given sizes (linear interpolation)
    segment = torch.arange(count - 1).repeat_interleave(steps)
    fraction = torch.arange(steps, dtype=torch.float64).repeat(count - 1) / steps
    segment, fraction = torch.cat([segment, torch.tensor([count - 2])]), torch.cat([fraction, torch.tensor([1.0])])
    at = torch.as_tensor(sizes, dtype=torch.float64)
    grid = at[segment] + fraction * (at[segment + 1] - at[segment])
    weights = torch.zeros(len(grid), count, dtype=torch.float64)
    weights[torch.arange(len(grid)), segment] = 1 - fraction
    weights[torch.arange(len(grid)), segment + 1] = fraction
    # every run's mean and the covariance of the test set's noise in them, at each d
    runs = ensemble_nll.mean(2) @ weights.T  # (r, grid)
    per_example = torch.cat([ensemble_nll.permute(2, 0, 1).reshape(n, r * count), method_nll.T], 1)
    cov = torch.cov(per_example.T).reshape(r * count + k, r * count + k) / n
    e_cov = cov[: r * count, : r * count].reshape(r, count, r, count)
    ensemble_cov = torch.einsum("gs,jslt,gt->gjl", weights, e_cov, weights)  # (grid, r, r)
    cross = torch.einsum("gs,jsl->gjl", weights, cov[: r * count, r * count :].reshape(r, count, k))  # (grid, r, k)
    method_cov = cov[r * count :, r * count :]
    test = ensemble_cov.sum((1, 2)) / r**2 + method_cov.sum() / k**2 - 2 * cross.sum((1, 2)) / (r * k)
    variance, terms, leaves_out = test.clamp_min(0.0), torch.zeros_like(test), []
    if r > 1:
        spread, sample = _seed_variance(runs.T, ensemble_cov)
        variance, terms = variance + spread / r, terms + (sample / r) ** 2 / (r - 1)
    else:
        leaves_out.append(ENSEMBLE_RUNS)
    if k > 1:
        spread, sample = _seed_variance(method_nll.mean(1), method_cov)
        variance, terms = variance + spread / k, terms + (sample / k) ** 2 / (k - 1)
    else:
        leaves_out.append(METHOD_RUNS)
    df = torch.where(terms > 0, variance**2 / terms.clamp_min(1e-300), torch.full_like(terms, math.inf))
    # (df >= r − 1 where the test noise is not correlated with the runs against it; at least 1 always)
    critical = torch.as_tensor(student.ppf((1 + level) / 2, df.clamp_min(1.0).numpy()), dtype=torch.float64)
    reach = critical * variance.sqrt()
    difference = curve @ weights.T - method  # Δ(d): the curve at d less the method's NLL
    kept = grid[difference.abs() <= reach].tolist()
    if difference[0] <= reach[0]:  # the method may be no better than one network
        kept.append(1.0)
    if difference[-1] >= -reach[-1]:  # it may beat the largest ensemble evaluated
        kept.append(math.inf)
    low, high = (min(kept), max(kept)) if kept else (value, value)  # (none kept: the grid is too coarse for its width)
    return EquivalentInterval(value, low, high, tuple(leaves_out))
