"""Conformal prediction sets for a classifier: conformity scores, the conformal quantile, and what
the sets achieve (coverage, size, coverage by set size and by class).

Split conformal prediction (Vovk et al. 2005; Angelopoulos & Bates 2023, sec. 1): a score s(x, y)
says how badly label y conforms to the prediction at x (higher = worse); on n calibration examples
q̂ is the ⌈(n + 1)(1 − α)⌉-th smallest of s(x_i, y_i) (+inf when that rank exceeds n) and
C(x) = {y : s(x, y) ≤ q̂}. For exchangeable examples P(y ∈ C(x)) ≥ 1 − α, and at most
1 − α + 1 / (n + 1) where scores do not tie (appendix D; tested by simulation). Scores: `thr`
(1 − p_y, Sadinle et al. 2019), `aps` (Romano et al. 2020), `raps` (Angelopoulos et al. 2021) and
the randomised `aps_randomized`, `raps_randomized` (u·p_y for p_y). Labels are ranked by
decreasing probability, ties by class index.

Conventions: a set the bare rule leaves empty gets its top label by default
(`allow_empty_sets=False`, the authors' `ConformalModel(allow_zero_sets=False)`): coverage can only
rise, and the upper bound holds for the bare rule only. RAPS's k_reg and λ are tuned as the
authors' `pick_kreg` / `pick_lamda_size` on a random `TUNING_FRACTION` of the calibration
examples, the rest giving q̂; unlike their code no temperature is fitted first, q̂ is the
finite-sample rank, and the calibration scores are of the same variant as the sets. The scores,
the empty-set rule and the set metrics (`set_metrics`, `weighted_set_metrics`): docs/evaluation.md
("Conformal prediction sets").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LAMBDA_GRID",
    "SCORES",
    "SET_METRICS",
    "TUNING_FRACTION",
    "Calibrated",
    "aps_scores",
    "calibrate",
    "conformal_quantile",
    "conformity_scores",
    "label_ranks",
    "pick_k_reg",
    "pick_lambda",
    "prediction_sets",
    "quantile_rank",
    "raps_scores",
    "set_metrics",
    "set_rule",
    "size_strata",
    "stratum_name",
    "thr_scores",
    "top_labels",
    "tuning_size",
    "weighted_set_metrics",
]

#: score name -> (randomised, penalised)
SCORES: dict[str, tuple[bool, bool]] = {
    "thr": (False, False),
    "aps": (False, False),
    "aps_randomized": (True, False),
    "raps": (False, True),
    "raps_randomized": (True, True),
}
#: the numbers `set_metrics` reports per (level, score), in this order
SET_METRICS = ("coverage", "size", "empty", "ssc", "class_coverage_min")
#: the share of the calibration examples that tunes RAPS's k_reg and λ (the authors' `pct_paramtune`)
TUNING_FRACTION = 0.3
#: the λ the authors' `pick_lamda_size` chooses from
LAMBDA_GRID = (0.001, 0.01, 0.1, 0.2, 0.5)
#: the upper ends of the set-size strata: Angelopoulos et al. 2021's (0–1, 2–3, 4–6, 7–10, 11–100, 101–1000,
#: the authors' `pick_lamda_adaptiveness`). Empty sets share the first stratum with sets of one label, as
#: theirs: a stratum of empty sets alone would have coverage 0 by definition and make `ssc` 0 whenever a
#: non-randomised set is empty (their share is `empty`).
STRATA_ENDS = (1, 3, 6, 10, 100, 1000)
#: rounding allowance for ranks computed from α: (n + 1)(1 − α) = 9.000000000000002 is rank 9
_EPS = 1e-9


# --- scores ------------------------------------------------------------------------------------


def label_ranks(probs: Tensor) -> tuple[Tensor, Tensor]:
    """(order, ranks), both (N, C): `order[i]` the labels by decreasing probability (ties by
    increasing class index), `ranks[i, y]` the 1-based rank of label y."""
    order = torch.sort(probs, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    positions = torch.arange(1, probs.shape[1] + 1, device=probs.device).expand_as(order)
    return order, ranks.scatter_(1, order, positions)


def top_labels(probs: Tensor) -> Tensor:
    """(N,) each example's top-ranked label (`label_ranks`' first: the most probable, ties by class
    index), the label a set that would be empty gets unless empty sets are allowed."""
    return label_ranks(probs)[0][:, 0]


def thr_scores(probs: Tensor) -> Tensor:
    """(N, C) THR / LAC scores 1 − p_y (Sadinle et al. 2019)."""
    return 1 - probs.double()


def aps_scores(probs: Tensor, u: Tensor | None = None) -> Tensor:
    """(N, C) APS scores (Romano et al. 2020): the mass of the labels ranked before y, plus p_y, or
    plus u·p_y with `u` (N,) in [0, 1] (randomised: one u per example)."""
    return raps_scores(probs, 0, 0.0, u)


def raps_scores(probs: Tensor, k_reg: int, lam: float, u: Tensor | None = None) -> Tensor:
    """(N, C) RAPS scores (Angelopoulos et al. 2021): APS plus λ·max(0, rank_y − k_reg)."""
    probs = probs.double()
    order, _ = label_ranks(probs)
    ranked = probs.gather(1, order)
    before = torch.nn.functional.pad(ranked.cumsum(1)[:, :-1], (1, 0))  # mass of the labels ranked higher
    own = ranked if u is None else u.double()[:, None] * ranked
    rank = torch.arange(1, probs.shape[1] + 1, dtype=torch.float64, device=probs.device)
    penalty = float(lam) * (rank - int(k_reg)).clamp_min(0)
    return torch.empty_like(ranked).scatter_(1, order, before + own + penalty)


def conformity_scores(probs: Tensor, score: str, u: Tensor | None = None, k_reg: int = 0, lam: float = 0.0) -> Tensor:
    """(N, C) scores of every label under `score` (a name of `SCORES`); randomised scores take `u`
    (N,), RAPS its `k_reg` and `lam`."""
    if score not in SCORES:
        raise ValueError(f"unknown conformity score {score!r}; choose from {list(SCORES)}")
    randomized, penalised = SCORES[score]
    if randomized and u is None:
        raise ValueError(f"{score} needs u, one U(0, 1) draw per example")
    u = u if randomized else None
    if score == "thr":
        return thr_scores(probs)
    return raps_scores(probs, k_reg, lam, u) if penalised else aps_scores(probs, u)


# --- calibration -------------------------------------------------------------------------------


def quantile_rank(n: int, alpha: float) -> int:
    """⌈(n + 1)(1 − α)⌉: the rank of q̂ among n calibration scores (above n: q̂ = +inf)."""
    return max(math.ceil((n + 1) * (1 - alpha) - _EPS), 1)


def conformal_quantile(scores: Tensor, alpha: float) -> float:
    """q̂: the ⌈(n + 1)(1 − α)⌉-th smallest of the n calibration scores (each example's score of
    its own label), +inf when that rank exceeds n (too few examples for the level: every set is
    every label)."""
    scores = scores.double().flatten()
    rank = quantile_rank(len(scores), alpha)
    return math.inf if rank > len(scores) else float(torch.sort(scores).values[rank - 1])


def prediction_sets(scores: Tensor, qhat: float, top: Tensor | None = None) -> Tensor:
    """(N, C) bool: label y is in the set of example i where s(x_i, y) ≤ q̂. With `top` (N,), each
    example's top-ranked label (`top_labels`), a set that this leaves empty gets that label alone
    and every other set is unchanged (the authors' `allow_zero_sets=False`); None: the bare rule,
    empty sets kept."""
    sets = scores <= qhat
    if top is not None:
        empty = ~sets.any(1)
        sets[empty, top.to(sets.device)[empty]] = True
    return sets


def set_rule(allow_empty_sets: bool) -> str:
    """How files and tables name the empty-set convention."""
    return (
        "{y : s ≤ q̂}, empty sets kept"
        if allow_empty_sets
        else "{y : s ≤ q̂}, the top label alone where that is empty (never empty)"
    )


def _own(scores: Tensor, targets: Tensor) -> Tensor:
    return scores.gather(1, targets[:, None]).squeeze(1)


def _uniform(n: int, generator: torch.Generator | None) -> Tensor:
    return torch.rand(n, generator=generator, dtype=torch.float64)


def pick_k_reg(probs: Tensor, targets: Tensor, alpha: float) -> int:
    """The authors' `pick_kreg`: the 'higher' (1 − α) quantile of the true labels' 1-based ranks
    (numpy's method: the sorted value at index ⌈(1 − α)(n − 1)⌉)."""
    _, ranks = label_ranks(probs)
    own = torch.sort(_own(ranks, targets)).values
    return int(own[math.ceil((1 - alpha) * (len(own) - 1) - _EPS)])


def pick_lambda(
    probs: Tensor,
    targets: Tensor,
    alpha: float,
    k_reg: int,
    randomized: bool,
    generator: torch.Generator | None = None,
    grid: tuple[float, ...] = LAMBDA_GRID,
    allow_empty_sets: bool = False,
) -> float:
    """The authors' `pick_lamda_size`: the λ of `grid` whose RAPS sets, calibrated and evaluated on
    these (tuning) examples, are smallest on average; the first on ties. The sets follow
    `allow_empty_sets` (`prediction_sets`), as the authors' pass `allow_zero_sets` on."""
    score = "raps_randomized" if randomized else "raps"
    top = None if allow_empty_sets else top_labels(probs)
    best, best_size = grid[0], math.inf
    for lam in grid:
        draws = _uniform(len(targets), generator) if randomized else None
        qhat = conformal_quantile(_own(conformity_scores(probs, score, draws, k_reg, lam), targets), alpha)
        draws = _uniform(len(targets), generator) if randomized else None
        size = float(
            prediction_sets(conformity_scores(probs, score, draws, k_reg, lam), qhat, top).sum(1).double().mean()
        )
        if size < best_size:
            best, best_size = lam, size
    return float(best)


@dataclass(frozen=True)
class Calibrated:
    """A conformal predictor: a score, its level 1 − α and q̂, RAPS's k_reg and λ (0 for the other
    scores), how many calibration examples gave q̂ and how many tuned RAPS, and whether its sets may
    be empty (False: a set s ≤ q̂ leaves empty gets the top label; see `prediction_sets`)."""

    score: str
    alpha: float
    qhat: float
    k_reg: int = 0
    lam: float = 0.0
    n_calibration: int = 0
    n_tuning: int = 0
    allow_empty_sets: bool = False

    def scores(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(N, C) this predictor's scores of every label (randomised: fresh u from `generator`)."""
        u = _uniform(len(probs), generator) if SCORES[self.score][0] else None
        return conformity_scores(probs, self.score, u, self.k_reg, self.lam)

    def sets(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(N, C) bool prediction sets of examples with these probabilities (never empty unless
        `allow_empty_sets`)."""
        top = None if self.allow_empty_sets else top_labels(probs)
        return prediction_sets(self.scores(probs, generator), self.qhat, top)

    def record(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "level": 1 - self.alpha,
            "qhat": self.qhat if math.isfinite(self.qhat) else "inf",
            "k_reg": self.k_reg,
            "lambda": self.lam,
            "n_calibration": self.n_calibration,
            "n_tuning": self.n_tuning,
            "allow_empty_sets": self.allow_empty_sets,
        }


def tuning_size(n: int, score: str, tuning_fraction: float = TUNING_FRACTION) -> int:
    """How many of n calibration examples tune RAPS (⌈fraction · n⌉, as the authors); 0 for the
    other scores."""
    return math.ceil(tuning_fraction * n - _EPS) if SCORES[score][1] else 0


def calibrate(
    probs: Tensor,
    targets: Tensor,
    score: str,
    alpha: float,
    generator: torch.Generator | None = None,
    k_reg: int | None = None,
    lam: float | None = None,
    tuning_fraction: float = TUNING_FRACTION,
    allow_empty_sets: bool = False,
) -> Calibrated:
    """The conformal predictor of `score` at level 1 − α from calibration examples (probabilities
    (n, C), labels (n,)). RAPS: unless both `k_reg` and `lam` are given, a random part of the
    examples (`tuning_size`; `generator` draws it) tunes the missing ones (`pick_k_reg`,
    `pick_lambda`) and only the rest gives q̂. `allow_empty_sets` (default False: the top label
    where a set would be empty) changes the sets, not the scores nor q̂ at given k_reg and λ (a
    tuned λ is chosen on sets of the same convention)."""
    if score not in SCORES:
        raise ValueError(f"unknown conformity score {score!r}; choose from {list(SCORES)}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    probs = probs.double()
    randomized, penalised = SCORES[score]
    n_tuning = 0
    if penalised and (k_reg is None or lam is None):
        n_tuning = tuning_size(len(targets), score, tuning_fraction)
        order = torch.randperm(len(targets), generator=generator)
        tune, rest = order[:n_tuning], order[n_tuning:]
        if k_reg is None:
            k_reg = pick_k_reg(probs[tune], targets[tune], alpha)
        if lam is None:
            lam = pick_lambda(
                probs[tune], targets[tune], alpha, k_reg, randomized, generator, allow_empty_sets=allow_empty_sets
            )
        probs, targets = probs[rest], targets[rest]
    k_reg, lam = (int(k_reg), float(lam)) if penalised else (0, 0.0)
    u = _uniform(len(targets), generator) if randomized else None
    qhat = conformal_quantile(_own(conformity_scores(probs, score, u, k_reg, lam), targets), alpha)
    return Calibrated(score, float(alpha), qhat, k_reg, lam, len(targets), n_tuning, bool(allow_empty_sets))


# --- what the sets achieve ---------------------------------------------------------------------


def size_strata(num_classes: int) -> list[tuple[int, int]]:
    """The set-size strata (lowest, highest) for C classes: 0–1, 2–3, 4–6, 7–10, 11–100, 101–1000,
    1001–C, cut at C (only strata a set can fall in)."""
    strata, low = [], 0
    for end in STRATA_ENDS:
        if low > num_classes:
            break
        strata.append((low, min(end, num_classes)))
        low = end + 1
    if low <= num_classes:
        strata.append((low, num_classes))
    return strata


def stratum_name(stratum: tuple[int, int]) -> str:
    """'0-1', '2-3', ...: how files name a stratum."""
    low, high = stratum
    return str(low) if low == high else f"{low}-{high}"


def _groups(sets: Tensor, targets: Tensor, strata: list[tuple[int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    covered = sets.gather(1, targets[:, None]).squeeze(1).double()
    size = sets.sum(1)
    highs = torch.tensor([high for _, high in strata], dtype=size.dtype)
    stratum = torch.searchsorted(highs, size)  # the first stratum whose upper end is ≥ the size
    return covered, size.double(), stratum


def set_metrics(sets: Tensor, targets: Tensor, strata: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Coverage, mean size, share of empty sets, size-stratified coverage and classwise coverage of
    prediction sets (N, C) for labels (N,): `SET_METRICS` as floats, `strata` (per stratum: sizes,
    count, coverage; only strata that occur) and `classes` (per class with examples: count,
    coverage). `strata` default: `size_strata(C)`."""
    strata = strata or size_strata(sets.shape[1])
    covered, size, stratum = _groups(sets, targets, strata)
    per_stratum = []
    for k, bounds in enumerate(strata):
        members = stratum == k
        if members.any():
            per_stratum.append(
                {"sizes": stratum_name(bounds), "count": int(members.sum()), "coverage": float(covered[members].mean())}
            )
    per_class = []
    for label in range(sets.shape[1]):
        members = targets == label
        if members.any():
            per_class.append({"class": label, "count": int(members.sum()), "coverage": float(covered[members].mean())})
    return {
        "coverage": float(covered.mean()),
        "size": float(size.mean()),
        "empty": float((size == 0).double().mean()),
        "ssc": min(s["coverage"] for s in per_stratum),
        "class_coverage_min": min(c["coverage"] for c in per_class),
        "strata": per_stratum,
        "classes": per_class,
    }


def _smallest_group_mean(values: Tensor, group: Tensor, groups: int, weights: Tensor) -> Tensor:
    """(B,) the smallest weighted mean of `values` within a group, over the groups that carry weight."""
    mass = torch.zeros(len(weights), groups, dtype=torch.float64).index_add_(1, group, weights)
    hits = torch.zeros(len(weights), groups, dtype=torch.float64).index_add_(1, group, weights * values)
    means = torch.where(mass > 0, hits / mass.clamp_min(1e-300), torch.full_like(mass, math.inf))
    return means.min(1).values


def weighted_set_metrics(
    sets: Tensor, targets: Tensor, weights: Tensor, strata: list[tuple[int, int]] | None = None
) -> dict[str, Tensor]:
    """`SET_METRICS` at every row of `weights` ((B, N) counts of the examples, as
    `dbsn.metrics.intervals`): weighted means, and the smallest weighted stratum / class coverage
    over the strata / classes a row draws. Row values at unit counts equal `set_metrics`'."""
    strata = strata or size_strata(sets.shape[1])
    weights = torch.as_tensor(weights, dtype=torch.float64)
    weights = weights.unsqueeze(0) if weights.ndim == 1 else weights
    if weights.ndim != 2 or weights.shape[1] != len(targets):
        raise ValueError(f"weights must be (B, {len(targets)}) (one row per resample), got {tuple(weights.shape)}")
    covered, size, stratum = _groups(sets, targets, strata)
    total = weights.sum(1)
    return {
        "coverage": weights @ covered / total,
        "size": weights @ size / total,
        "empty": weights @ (size == 0).double() / total,
        "ssc": _smallest_group_mean(covered, stratum, len(strata), weights),
        "class_coverage_min": _smallest_group_mean(covered, targets, sets.shape[1], weights),
    }
