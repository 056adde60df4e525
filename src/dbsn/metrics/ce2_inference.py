"""How sure an unbiased squared calibration error is: its variance, a per-run interval, a paired test.

CE² (`calibration.squared_calibration_error`) on n test examples, with gaps
``d_i = correct_i − confidence_i`` in equal-width confidence bins b, is a U-statistic over pairs of
distinct examples, U = Σ_{i≠j} K_ij d_i d_j with K_ij = 1[b(i) = b(j)] / (n (n_b − 1)), unbiased for
θ = Σ_b P(b) μ_b². Its variance is Hoeffding's: a first-order term (4/n) (E[μ_b² d²] − θ²) and a
second-order term 2 Σ_{i≠j} K_ij² σ_i² σ_j², the only one left where θ = 0, where n U is skewed to
the right and a percentile bootstrap or a plug-in Wald interval is too wide. So the first-order
term is never taken at the estimate: at a hypothesised level (`score_interval`) or at a null level
estimated independently of the tested contrast (`paired_test`), with each predictor's gaps in the
shape of a weighted least-squares line through its bins' mean gaps (a bin's own mean is mostly
noise at θ ≈ 1e-3). The second order uses the raw gaps, Σ_{i≠j} K_ij² d_i² d_j² (unbiased where
the μ_b are 0). Several predictors on the same examples (two methods, k seeds) get a covariance
Σ1 + Σ2, Σ2 in O(n) by grouping examples by their pair of bins. The formulas and the coverage in
simulation: docs/evaluation.md ("How sure the numbers are").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import NamedTuple

import torch
from torch import Tensor

from dbsn.metrics.binning import bin_index
from dbsn.metrics.classification import _confidence_and_correct

__all__ = [
    "Gaps",
    "TestResult",
    "ce2_difference_covariance",
    "covariance",
    "first_order_covariance",
    "paired_test",
    "score_interval",
    "second_order_covariance",
    "shape_gram",
    "top_label_gaps",
]


@dataclass(frozen=True)
class Gaps:
    """One predictor on n test examples: ``d`` (n,) correct − confidence of the top label, ``bins``
    (n,) its equal-width confidence bin (`dbsn.metrics.binning`, as `calibration.squared_calibration_error`:
    [b/M, (b+1)/M), the last bin also holding a confidence of exactly 1), ``slots`` the number of bins M."""

    d: Tensor
    bins: Tensor
    slots: int

    @property
    def n(self) -> int:
        return self.d.numel()

    def per_bin(self, values: Tensor) -> Tensor:
        """(slots,) sums of per-example `values` within bins."""
        return torch.zeros(self.slots, dtype=torch.float64).index_add_(0, self.bins, values.double())

    @property
    def counts(self) -> Tensor:
        return self.per_bin(torch.ones_like(self.d))

    @property
    def pair_weight(self) -> Tensor:
        """(slots,) K of a pair of distinct examples in each bin: 1 / (n (n_b − 1)), 0 where n_b < 2."""
        counts = self.counts
        return torch.where(counts > 1, 1 / (self.n * (counts - 1).clamp_min(1)), torch.zeros_like(counts))

    @property
    def ce2(self) -> float:
        """The unbiased estimate U = Σ_b (S_b² − Q_b) / (n (n_b − 1))."""
        return float(((self.per_bin(self.d) ** 2 - self.per_bin(self.d**2)) * self.pair_weight).sum())

    @property
    def shape(self) -> Tensor:
        """(slots,) g: the weighted least-squares line (weights n_b) through the bins' mean gaps x̄_b
        against the bin centres, at the bins of at least two examples (0 elsewhere), scaled to
        Σ_b w_b g_b² = 1 (a constant where the line is 0)."""
        counts = self.counts
        used = counts > 1
        weight = torch.where(used, counts, torch.zeros_like(counts))
        mean = torch.where(used, self.per_bin(self.d) / counts.clamp_min(1), torch.zeros_like(counts))
        centre = (torch.arange(self.slots, dtype=torch.float64) + 0.5) / self.slots  # (b + 1/2) / M
        design = torch.stack([torch.ones_like(centre), centre], 1) * weight.sqrt()[:, None]
        line = torch.linalg.lstsq(design, (mean * weight.sqrt())[:, None]).solution
        shape = torch.where(used, (torch.stack([torch.ones_like(centre), centre], 1) @ line).squeeze(1), 0.0)
        norm = float((weight / self.n * shape**2).sum())
        if not norm > 1e-30:
            shape, norm = used.double(), float(weight.sum() / self.n)
        return shape / math.sqrt(norm) if norm > 0 else shape


def top_label_gaps(probs: Tensor, target: Tensor, n_bins: int = 15) -> Gaps:
    """The `Gaps` of probabilities `probs` (N, C) against `target` (N,) over `n_bins` equal-width bins."""
    probs, target = torch.as_tensor(probs).detach(), torch.as_tensor(target).detach()
    confidence, correct = _confidence_and_correct(probs, target)
    bins = bin_index(confidence, n_bins)
    return Gaps(correct.double().cpu() - confidence.double().cpu(), bins.cpu(), n_bins)


def second_order_covariance(gaps: list[Gaps]) -> Tensor:
    """(P, P) Σ2 of P predictors on the same examples (module docstring), grouped by pairs of bins."""
    if len({g.n for g in gaps}) != 1:
        raise ValueError("the predictors must be scored on the same test examples")
    out = torch.zeros(len(gaps), len(gaps), dtype=torch.float64)
    for p, a in enumerate(gaps):
        for q, b in enumerate(gaps[: p + 1]):
            group, x = a.bins * b.slots + b.bins, a.d * b.d
            sums = torch.zeros(a.slots * b.slots, dtype=torch.float64).index_add_(0, group, x)
            squares = torch.zeros(a.slots * b.slots, dtype=torch.float64).index_add_(0, group, x**2)
            weight = (a.pair_weight[:, None] * b.pair_weight[None, :]).flatten()
            out[p, q] = out[q, p] = 2 * ((sums**2 - squares) * weight).sum()
    return out


def first_order_covariance(gaps: list[Gaps], bin_gaps: list[Tensor]) -> Tensor:
    """(P, P) Σ1 if predictor p's gap in bin b were ``bin_gaps[p][b]``: (4/n) ((1/n) Σ_i μ^p_i d^p_i
    μ^q_i d^q_i − θ_p θ_q), θ_p = Σ_b w_b (μ^p_b)² (bins of fewer than two examples count nothing)."""
    n = gaps[0].n
    projected, levels = [], []
    for g, mu in zip(gaps, bin_gaps):
        mu = torch.where(g.counts > 1, torch.as_tensor(mu, dtype=torch.float64), 0.0)
        projected.append(mu[g.bins] * g.d)
        levels.append((g.counts / n * mu**2).sum())
    h, theta = torch.stack(projected), torch.stack(levels)
    return 4 / n * (h @ h.T / n - theta[:, None] * theta[None, :])


def shape_gram(gaps: list[Gaps]) -> Tensor:
    """(P, P) G_pq = (1/n) Σ_i g^p_i d^p_i g^q_i d^q_i with each predictor's unit `Gaps.shape`: Σ1 at
    levels θ is (4/n) (√θ_p √θ_q G_pq − θ_p θ_q)."""
    h = torch.stack([g.shape[g.bins] * g.d for g in gaps])
    return h @ h.T / gaps[0].n


def covariance(gaps: list[Gaps], levels: list[float]) -> Tensor:
    """(P, P) covariance of P predictors' CE² estimates on the same examples if their true CE² were
    `levels` (>= 0), each spread over its bins in its `Gaps.shape`: Σ1 + Σ2 (module docstring)."""
    theta = torch.tensor([max(float(v), 0.0) for v in levels], dtype=torch.float64)
    root = theta.sqrt()
    first = 4 / gaps[0].n * (root[:, None] * root[None, :] * shape_gram(gaps) - theta[:, None] * theta[None, :])
    return first + second_order_covariance(gaps)


class TestResult(NamedTuple):
    """An estimate, its interval at a level and the p-value of the test of 0 (the interval excludes 0
    exactly when p < 1 − level)."""

    value: float
    low: float
    high: float
    p: float


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    return NormalDist().inv_cdf((1 + level) / 2)


def score_interval(probs: Tensor, target: Tensor, level: float = 0.95, n_bins: int = 15) -> TestResult:
    """CE² of one predictor with the set of θ0 >= 0 that |U − θ0| <= z √V(θ0) does not reject, where
    V(θ0) = V2 + (4/n)(G θ0 − θ0²) is U's variance if the truth were θ0 in the data's shape (module
    docstring; G = Σ_b w_b g_b² E[d² | b], estimated). A quadratic in θ0, solved in closed form (as
    Wilson's interval for a proportion); the lower end is clipped at 0 (CE² >= 0, its estimate can be
    negative). p: of θ = 0, one-sided (U > z √V2 rejects)."""
    g = top_label_gaps(probs, target, n_bins)
    z, n, u = _z(level), g.n, g.ce2
    v2 = float(second_order_covariance([g])[0, 0])
    c = float(shape_gram([g])[0, 0])
    # (U − θ)² <= z² (V2 + 4/n (c θ − θ²))  <=>  a θ² − b θ + k <= 0
    a, b, k = 1 + 4 * z * z / n, 2 * u + 4 * z * z * c / n, u * u - z * z * v2
    disc = b * b - 4 * a * k
    low, high = (0.0, 0.0) if disc < 0 else ((b - math.sqrt(disc)) / (2 * a), (b + math.sqrt(disc)) / (2 * a))
    p = 1.0 if v2 <= 0 or u <= 0 else math.erfc(u / math.sqrt(2 * v2))
    return TestResult(u, max(low, 0.0), max(high, 0.0), p)


def _difference_variance(second: float, gram: list[list[float]], n: int, common: float, delta: float) -> float:
    """Var(U_A − U_B) if θ_A − θ_B = delta at the common level `common` (module docstring, `paired_test`)."""
    top = max(common, 0.0)
    theta_b = max(top - delta / 2, 0.0, -delta)
    theta_a = theta_b + delta
    first = theta_a * gram[0][0] + theta_b * gram[1][1] - 2 * math.sqrt(theta_a * theta_b) * gram[0][1] - delta * delta
    slope = gram[0][0] + gram[1][1] - 2 * gram[0][1]  # d Var / d common at delta = 0, times n / 4
    return max(second + 4 / n * (first + min(common, 0.0) * slope), second / 4)


def paired_test(probs_a: Tensor, probs_b: Tensor, target: Tensor, level: float = 0.95, n_bins: int = 15) -> TestResult:
    """CE²_A − CE²_B of two predictors on the same examples, the test of θ_A = θ_B and the interval of
    the δ0 it does not reject.

    The nuisance is the common level t of the two CE²: estimated by (U_A + U_B) / 2, which under
    θ_A = θ_B is (nearly) uncorrelated with L = U_A − U_B. The test of δ0 rejects when
    |L − δ0| > z √V(δ0), V(δ0) the variance of L if the truths were (θ_A, θ_B) = (t + δ0/2, t − δ0/2)
    moved into θ >= 0 along θ_A − θ_B = δ0 (each in its `Gaps.shape`, module docstring). Below 0, t
    enters V linearly (V at δ0 = 0 is V2 + (4/n) t (G_AA + G_BB − 2 G_AB) for every t), so where both
    predictors are calibrated V's mean is L's variance: clipping t at 0 instead would make the test
    conservative there, and the smaller of U_A and U_B as the level (which shrinks as |L| grows) makes
    it liberal where both are equally miscalibrated. V is kept >= V2 / 4. p: normal theory at δ0 = 0.
    """
    a, b = top_label_gaps(probs_a, target, n_bins), top_label_gaps(probs_b, target, n_bins)
    z, n = _z(level), a.n
    value, common = a.ce2 - b.ce2, (a.ce2 + b.ce2) / 2
    second_matrix = second_order_covariance([a, b])
    second = float(second_matrix[0, 0] + second_matrix[1, 1] - 2 * second_matrix[0, 1])
    gram = shape_gram([a, b]).tolist()

    def variance(delta: float) -> float:
        return _difference_variance(second, gram, n, common, delta)

    if variance(0.0) <= 0:  # the same predictions: no noise in a difference of 0
        return TestResult(value, value, value, 1.0 if value == 0 else 0.0)

    def rejected(delta: float) -> bool:
        return (value - delta) ** 2 > z * z * variance(delta)

    def bound(sign: float) -> float:  # from the accepted δ0 = L outwards: double, then bisect
        inner, step = value, z * math.sqrt(variance(value))
        while not rejected(value + sign * step):
            inner, step = value + sign * step, 2 * step
        outer = value + sign * step
        for _ in range(60):
            middle = (inner + outer) / 2
            inner, outer = (inner, middle) if rejected(middle) else (middle, outer)
        return inner

    return TestResult(value, bound(-1.0), bound(1.0), math.erfc(abs(value) / math.sqrt(2 * variance(0.0))))


def ce2_difference_covariance(pairs: list[tuple[Tensor, Tensor]], target: Tensor, n_bins: int = 15) -> Tensor:
    """(k, k) covariance of the test-set noise of k differences CE²_A_s − CE²_B_s (probabilities
    ``pairs[s] = (probs_a, probs_b)``, k seeds of two methods on the same examples `target`), under
    θ_A_s = θ_B_s at the common level t̄ (the mean of the 2k estimates; entering linearly, also below
    0, as in `paired_test`, and kept where 1ᵀ Σ 1 >= 1ᵀ Σ2 1 / 4). With a_s the contrast of pair s:
    Σ[s, r] = a_sᵀ Σ2 a_r + (4/n) t̄ a_sᵀ G a_r. At k = 1 it is `paired_test`'s V(0)."""
    gaps = [top_label_gaps(p, target, n_bins) for pair in pairs for p in pair]
    k, n = len(pairs), gaps[0].n
    contrast = torch.zeros(2 * k, k, dtype=torch.float64)
    contrast[0::2, :] = torch.eye(k, dtype=torch.float64)
    contrast[1::2, :] = -torch.eye(k, dtype=torch.float64)
    second = contrast.T @ second_order_covariance(gaps) @ contrast
    slope = 4 / n * contrast.T @ shape_gram(gaps) @ contrast
    common = sum(g.ce2 for g in gaps) / len(gaps)
    total_second, total_slope = float(second.sum()), float(slope.sum())
    if common < 0 and total_slope > 0:
        common = max(common, -0.75 * total_second / total_slope)
    return second + common * slope
