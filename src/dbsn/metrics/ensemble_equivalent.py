"""The deep-ensemble equivalent (DEE; Ashukha et al., ICLR 2020, "Pitfalls of in-domain
uncertainty estimation and ensembling in deep learning", sec. 4).

The DEE of a method m is the number of members a deep ensemble needs to match m's calibrated
log-likelihood. In NLL terms (lower is better):

    DEE(m) = min{k >= 1 : CNLL_DE(k) <= CNLL(m)},

made real-valued by joining the measured ensemble sizes with straight lines. Both NLLs should be
*calibrated* the same way (temperature scaling fitted on held-out data, never the test set):
uncalibrated NLLs mix how good the predictions are with how over-confident they are, which is
the comparison the DEE is meant to avoid.

Conventions (the paper leaves the ends open):

- The curve is made monotone by its running minimum: the NLL at size k is the best NLL measured
  at any size <= k. A real ensemble's NLL falls with its size up to noise; the running minimum
  never lets a bump in the curve credit a method with more members than an ensemble needed to
  reach its NLL. The DEE is then the first crossing of the running minimum, interpolated
  linearly; where the running minimum is flat, the crossing is the start of the flat part.
- A method at least as bad as one network (NLL >= the 1-member NLL) gets 1.0: "at most one
  network". The DEE is never below 1.
- A method better than the largest ensemble measured (NLL < the running minimum at the largest
  size M) gets ``math.inf``: "beyond the largest ensemble measured (> M)"; no extrapolation.

So the result is 1.0, a float in [1, M], or inf, never nan, and non-increasing in the NLL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

__all__ = ["deep_ensemble_equivalent", "deep_ensemble_equivalent_interval"]


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
    1.0 if `nll` is no better than one network, inf if it beats the largest ensemble measured,
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
