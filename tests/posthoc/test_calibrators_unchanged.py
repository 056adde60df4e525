"""Each calibrator computes what its algorithm defines, checked against a float64 reference that the
test computes itself from the same inputs, so that it holds on every CPU: a CPU that sums in
another order (vector width, BLAS kernel, threads) changes the inputs and the fits in their last
digits, and the references with them.

- Histogram binning and isotonic regression: the test's own per-bin fractions and pool-adjacent-
  violators fit (exact up to rounding, 1e-12); isotonic is non-decreasing and calibrated on the fit
  data (its values there sum to the class counts).
- Dirichlet calibration: the fitted map is the optimum of the test's own ODIR objective (found by
  Newton's method with the exact Hessian), up to what the calibrator's L-BFGS-B stop leaves: with
  g the gradient that L-BFGS-B reports where it stopped and h the least curvature of the
  objective, f − f* ≤ |g|² / h (twice the quadratic model's ½ gᵀH⁻¹g). As configured, also no
  worse than a point that meets L-BFGS-B's own gradient tolerance (1e-5 in each of P
  coordinates: P · 1e-10 / h); and once more with the stopping tolerances tightened (|g| ~1e-8),
  where a change of the objective of 1e-10 shows. A free intercept makes the fit calibrated in
  the large (its first-order condition) up to |g|.
- Temperature scaling: T is the NLL-optimal temperature (the test's Newton iteration on log T) up
  to the loss tolerance of the scaler's L-BFGS (`tolerance_change` = 1e-9).
- Every map: log-probabilities (summing to one), float32 inputs computed in float64, the facts
  (validation NLL before and after, the share of changed predictions) those of its outputs.

On the digits model, each post-hoc posterior is its calibrator fitted on the validation predictive.
"""

from __future__ import annotations

import copy
import functools
import math
from unittest import mock

import numpy as np
import pytest
import scipy.optimize
import torch
import torch.nn.functional as F
from torch.autograd.functional import hessian, jacobian

from dbsn.posthoc.calibrators import (
    DirichletCalibration,
    HistogramBinning,
    IsotonicCalibration,
    PosthocCalibration,
    TemperatureScaling,
    validation_predictive,
)
from dbsn.posthoc.calibrators.dirichlet import ODIR_GRID
from dbsn.posthoc.laplace import LastLayerLaplace
from tests.posthoc.test_calibrators import C, miscalibrated

#: log p is clipped at the float64 machine epsilon before Dirichlet calibration's map
LOG_EPS = math.log(2.0**-52)
#: the least probability of a one-vs-rest map before renormalising, unless given
FLOOR = 1e-6
#: the loss tolerance of torch's L-BFGS (`tolerance_change`), with which temperature scaling stops
LBFGS_TOLERANCE_CHANGE = 1e-9
#: what the float64 rounding of a mean NLL over a few hundred examples can move it by (a relative bound)
ROUNDING = 1e-12


def inputs(which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fit log-probabilities, fit labels, test log-probabilities) of a case: all classes, without
    class 0 among the fit labels, or 3 classes. The test inputs hold the corners (p = 0 and 1: the
    ends of each map) and fitted points themselves (on the thresholds)."""
    if which == "3 classes":
        lp, y = miscalibrated(150, seed=7, classes=3)
        return lp, y, lp
    fit_lp, fit_y = miscalibrated(600, seed=1)
    test_lp, _ = miscalibrated(300, seed=2)
    corners = torch.eye(C, dtype=torch.float64).clamp_min(1e-300).log()
    test_lp = torch.cat([test_lp, corners, fit_lp[:20]])
    if which == "no class 0":
        return fit_lp[fit_y != 0], fit_y[fit_y != 0], test_lp
    return fit_lp, fit_y, test_lp


def nll(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    """The mean NLL, computed apart from the calibrators (numpy)."""
    lp, y = log_probs.numpy(), targets.numpy()
    return float(-lp[np.arange(len(y)), y].mean())


def check_log_probabilities(calibrator, test_lp: torch.Tensor) -> torch.Tensor:
    """The calibrated float64 log-probabilities of `test_lp`, checked: finite, summing to one; from
    float32 inputs, float32 outputs computed in float64 (the same map of the same inputs)."""
    with torch.no_grad():
        out = calibrator(test_lp)
        torch.testing.assert_close(out.logsumexp(-1), torch.zeros(len(out), dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.isfinite(out).all()
        low = test_lp.float()
        out32 = calibrator(low)
        assert out32.dtype == torch.float32
        if not isinstance(calibrator, TemperatureScaling):  # applied in the input's dtype (below)
            assert torch.equal(out32, calibrator(low.double()).float())
    return out


def check_facts(calibrator, fit_lp: torch.Tensor, fit_y: torch.Tensor) -> None:
    """The recorded validation NLL before and after and the share of changed predictions are those
    of the inputs and of the calibrator's outputs on them."""
    with torch.no_grad():
        after = calibrator(fit_lp)
    facts = calibrator.facts
    assert facts["calibrator_examples"] == len(fit_y)
    assert facts["calibrator_nll_before"] == pytest.approx(nll(fit_lp, fit_y), rel=ROUNDING)
    assert facts["calibrator_nll_after"] == pytest.approx(nll(after, fit_y), rel=ROUNDING)
    if not calibrator.preserves_argmax:
        assert facts["calibrator_argmax_changed"] == (after.argmax(-1) != fit_lp.argmax(-1)).double().mean().item()


def floored_log(q: np.ndarray, floor: float) -> np.ndarray:
    """log of q raised to at least `floor`, renormalised (numpy)."""
    q = np.maximum(q, floor)
    return np.log(q) - np.log(q.sum(-1, keepdims=True))


# ------------------------------------------------------------------ one-vs-rest maps


def histogram_binning(fit_p: np.ndarray, fit_y: np.ndarray, p: np.ndarray, bins: int) -> np.ndarray:
    """Per class, the fraction of the fit examples of p_c's bin (equal widths, p = 1 in the last) whose
    label is c; a bin that no fit example fell in: its centre."""

    def bin_of(values):
        return np.minimum(np.floor(values * bins).astype(int), bins - 1)

    out = np.empty_like(p)
    for c in range(p.shape[1]):
        fit_bins, positive = bin_of(fit_p[:, c]), fit_y == c
        for m in range(bins):
            inside = fit_bins == m
            value = positive[inside].sum() / inside.sum() if inside.any() else (m + 0.5) / bins
            out[bin_of(p[:, c]) == m, c] = value
    return out


def pool_adjacent_violators(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The non-decreasing fit of the 0/1 labels y on x closest in squared error, at the sorted unique
    x: equal x pooled first, then each block that falls below the one before merged into it. Blocks
    are compared by their counts (exact integers), not by rounded means."""
    order = np.argsort(x, kind="stable")
    ux, start = np.unique(x[order], return_index=True)
    ends = np.append(start, len(x))
    blocks: list[list[float]] = []  # [positives, examples, unique x]
    for a, b in zip(ends[:-1], ends[1:]):
        blocks.append([float(y[order][a:b].sum()), float(b - a), 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            positives, examples, points = blocks.pop()
            blocks[-1][0] += positives
            blocks[-1][1] += examples
            blocks[-1][2] += points
    return ux, np.repeat([s / n for s, n, _ in blocks], [k for *_, k in blocks])


def isotonic(fit_p: np.ndarray, fit_y: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Per class, the isotonic fit of 1[y = c] on p_c, interpolated linearly between the fitted points
    and constant beyond them."""
    out = np.empty_like(p)
    for c in range(p.shape[1]):
        xs, values = pool_adjacent_violators(fit_p[:, c], (fit_y == c).astype(np.float64))
        out[:, c] = np.interp(p[:, c], xs, values)
    return out


#: case: (the calibrator, on which inputs, its reference (fit p, fit labels, p) -> per-class values, its floor)
ONE_VS_REST = {
    "histogram_binning": (lambda: HistogramBinning(), "all", lambda *a: histogram_binning(*a, bins=15), FLOOR),
    "histogram_binning_bins7": (
        lambda: HistogramBinning(bins=7),
        "all",
        lambda *a: histogram_binning(*a, bins=7),
        FLOOR,
    ),
    "histogram_binning_no_class0": (
        lambda: HistogramBinning(),
        "no class 0",
        lambda *a: histogram_binning(*a, bins=15),
        FLOOR,
    ),
    "isotonic": (lambda: IsotonicCalibration(), "all", isotonic, FLOOR),
    "isotonic_no_class0": (lambda: IsotonicCalibration(floor=1e-4), "no class 0", isotonic, 1e-4),
}


@pytest.mark.parametrize("case", list(ONE_VS_REST))
def test_each_one_vs_rest_map_is_its_algorithm(case):
    make, which, reference, floor = ONE_VS_REST[case]
    fit_lp, fit_y, test_lp = inputs(which)
    calibrator = make().fit(fit_lp, fit_y)
    fit_p, labels = fit_lp.exp().numpy(), fit_y.numpy()
    expected = reference(fit_p, labels, test_lp.exp().numpy())
    np.testing.assert_allclose(calibrator.class_probabilities(test_lp).numpy(), expected, rtol=0, atol=1e-12)
    out = check_log_probabilities(calibrator, test_lp)
    np.testing.assert_allclose(out.numpy(), floored_log(expected, floor), rtol=1e-12, atol=1e-12)
    check_facts(calibrator, fit_lp, fit_y)
    # the fit does not depend on the order of the examples
    order = torch.randperm(len(fit_y), generator=torch.Generator().manual_seed(3))
    shuffled = make().fit(fit_lp[order], fit_y[order])
    assert all(torch.equal(a, b) for a, b in zip(shuffled.buffers(), calibrator.buffers()))
    if isinstance(calibrator, IsotonicCalibration):
        # non-decreasing in p_c, and on the fit data its values add up to each class's count
        grid = torch.linspace(0, 1, 1001, dtype=torch.float64).log().unsqueeze(1).expand(-1, C)
        assert (calibrator.class_probabilities(grid).diff(dim=0) >= 0).all()
        fitted = calibrator.class_probabilities(fit_lp).sum(0)
        counts = torch.bincount(fit_y, minlength=C).double()
        torch.testing.assert_close(fitted, counts, rtol=0, atol=1e-9)


# ------------------------------------------------------------------ Dirichlet calibration


def odir_parameters(weight: torch.Tensor, bias: torch.Tensor, map: str) -> torch.Tensor:
    """The free parameters of a map: full: W then b; diagonal: W's diagonal then b; fixed_diagonal: log w."""
    if map == "full":
        return torch.cat([weight.reshape(-1), bias])
    if map == "diagonal":
        return torch.cat([weight.diagonal(), bias])
    return weight[0, 0].log().reshape(1)


def odir_map(params: torch.Tensor, c: int, map: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, b) of `odir_parameters`."""
    if map == "full":
        return params[: c * c].reshape(c, c), params[c * c :]
    if map == "diagonal":
        return torch.diag(params[:c]), params[c:]
    return params[0].exp() * torch.eye(c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64)


def odir_objective(log_probs: torch.Tensor, targets: torch.Tensor, map: str, lam: float, mu: float):
    """Kull et al.'s objective of the map's parameters: the mean NLL of softmax(W log p + b), log p
    clipped at LOG_EPS, plus λ / (C(C − 1)) Σ_{i≠j} W_ij² + μ / C Σ_j b_j²."""
    z, c = log_probs.clamp_min(LOG_EPS), log_probs.shape[1]

    def objective(params: torch.Tensor) -> torch.Tensor:
        weight, bias = odir_map(params, c, map)
        off = weight - torch.diag(weight.diagonal())
        return (
            F.cross_entropy(z @ weight.T + bias, targets)
            + lam / (c * (c - 1)) * off.square().sum()
            + mu / c * bias.square().sum()
        )

    return objective


def newton_minimum(objective, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimiser of a smooth convex objective by Newton's method with the exact Hessian
    (pseudo-inverse: a direction the objective does not depend on is left alone), backtracking
    while the predicted decrease is above rounding; and the Hessian there."""
    params = start.clone()
    for _ in range(50):
        gradient, curvature = jacobian(objective, params), hessian(objective, params, vectorize=True)
        step = torch.linalg.pinv(curvature, hermitian=True) @ gradient
        decrease = float(gradient @ step)  # twice what the full step would gain on the quadratic model
        t = 1.0
        if decrease > 1e-20:  # far from the minimum: halve the step until it decreases enough
            value = objective(params)
            while objective(params - t * step) > value - t * decrease / 4 and t > 1e-6:
                t /= 2
        params = params - t * step
        if decrease < 1e-24:  # ~1e-28 is the rounding floor of the gradient's
            break
    return params, hessian(objective, params, vectorize=True)


class Minimize:
    """`scipy.optimize.minimize` as the calibrator calls it, recording each result; with `options`,
    those stopping options replace the calibrator's."""

    original = staticmethod(scipy.optimize.minimize)

    def __init__(self, **options) -> None:
        self.options = options
        self.results: list = []

    def __call__(self, fun, x0, **kwargs):
        if self.options:
            kwargs["options"] = {**kwargs.get("options", {}), **self.options}
        result = self.original(fun, x0, **kwargs)
        self.results.append(result)
        return result


#: case: (the calibrator, on which inputs, its (λ, μ); None: chosen by cross-validation with μ = λ)
DIRICHLET = {
    "dirichlet_full": (lambda: DirichletCalibration("full", reg_lambda=1e-3), "all", (1e-3, 1e-3)),
    "dirichlet_full_mu": (lambda: DirichletCalibration("full", reg_lambda=1e-2, reg_mu=0.1), "all", (1e-2, 0.1)),
    "dirichlet_diagonal": (lambda: DirichletCalibration("diagonal"), "all", (0.0, 0.0)),
    "dirichlet_diagonal_mu": (lambda: DirichletCalibration("diagonal", reg_mu=0.5), "all", (0.0, 0.5)),
    "dirichlet_fixed_diagonal": (lambda: DirichletCalibration("fixed_diagonal"), "all", (0.0, 0.0)),
    "dirichlet_cross_validated": (lambda: DirichletCalibration("full", folds=3, max_iter=200), "3 classes", None),
}
#: scipy's L-BFGS-B gradient tolerance (`gtol`), which the calibrator keeps
PGTOL = 1e-5
#: stopping options that leave L-BFGS-B's gradient at ~1e-8 (the calibrator's own stop leaves ~1e-5 to 1e-4)
TIGHT = {"ftol": 0.0, "gtol": 1e-12, "maxiter": 20_000}


@functools.cache
def fitted_dirichlet(case: str) -> tuple[DirichletCalibration, scipy.optimize.OptimizeResult]:
    """The case's calibrator fitted on its inputs, and where its L-BFGS-B stopped on all the data
    (its last run, after the cross-validation's); fitted once for the tests that read it."""
    make, which, _ = DIRICHLET[case]
    minimize = Minimize()
    with mock.patch.object(scipy.optimize, "minimize", minimize):
        calibrator = make().fit(*inputs(which)[:2])
    return calibrator, minimize.results[-1]


@pytest.mark.parametrize("case", list(DIRICHLET))
def test_each_dirichlet_fit_is_the_optimum_of_its_odir_objective(case):
    _, which, regularisers = DIRICHLET[case]
    fit_lp, fit_y, test_lp = inputs(which)
    c = fit_lp.shape[1]
    as_configured, stopped = fitted_dirichlet(case)
    if regularisers is None:
        assert as_configured.chosen[0] in ODIR_GRID
    lam, mu = regularisers or (as_configured.chosen[0],) * 2
    assert as_configured.chosen == (lam, mu)
    tight = Minimize(**TIGHT)
    with mock.patch.object(scipy.optimize, "minimize", tight):
        tightened = as_configured.solve(fit_lp, fit_y, lam, mu)

    objective = odir_objective(fit_lp, fit_y, as_configured.map, lam, mu)
    start = odir_parameters(torch.eye(c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64), as_configured.map)
    optimum, curvature = newton_minimum(objective, start)
    best = objective(optimum).item()
    eigenvalues = torch.linalg.eigvalsh(curvature)
    least = eigenvalues[eigenvalues > 1e-9 * eigenvalues.max()].min().item()  # not a flat one (b + t·1 at μ = 0)
    rounding = ROUNDING * max(1.0, best)
    gap = {}
    for name, (weight, bias), result in (
        ("as configured", (as_configured.weight, as_configured.bias), stopped),
        ("tightened", tightened, tight.results[-1]),
    ):
        assert result.status == 0, (name, result.message)  # converged (not stopped by its iteration limit)
        gap[name] = objective(odir_parameters(weight, bias, as_configured.map)).item() - best
        bound = float(np.square(result.jac).sum()) / least + rounding
        assert -rounding <= gap[name] <= bound, (name, gap, bound, result.message)
    # as configured, as close as a point that meets L-BFGS-B's gradient tolerance in every coordinate
    assert gap["as configured"] <= len(stopped.x) * PGTOL**2 / least + rounding, (gap, stopped.message)

    # the map as the docstring writes it, and a log-probability
    out = check_log_probabilities(as_configured, test_lp)
    z = test_lp.clamp_min(LOG_EPS)
    expected = F.log_softmax(z @ as_configured.weight.T + as_configured.bias, -1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    check_facts(as_configured, fit_lp, fit_y)
    if as_configured.map != "fixed_diagonal":
        # a free intercept: the mean calibrated probability of each class is its frequency, less 2μ/C · b
        with torch.no_grad():
            mean = as_configured(fit_lp).exp().mean(0)
        frequency = torch.bincount(fit_y, minlength=c).double() / len(fit_y)
        np.testing.assert_allclose(
            (mean - frequency + 2 * mu / c * as_configured.bias).numpy(), 0, atol=np.abs(stopped.jac).max() + 1e-12
        )


# ------------------------------------------------------------------ temperature scaling


def test_temperature_scaling_is_the_nll_optimal_temperature():
    fit_lp, fit_y, test_lp = inputs("all")
    calibrator = TemperatureScaling().fit(fit_lp, fit_y)
    temperature = calibrator.facts["calibrator_temperature"]
    assert temperature == calibrator.scaler.temperature

    def objective(log_t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fit_lp * torch.exp(-log_t), fit_y)

    log_t = torch.zeros((), dtype=torch.float64)
    for _ in range(50):  # Newton's method on log T (a few steps from T = 1)
        step = jacobian(objective, log_t) / hessian(objective, log_t)
        log_t = log_t - step
        if abs(step) < 1e-15:
            break
    # the scaler's L-BFGS stops once an iteration lowers the NLL by less than tolerance_change (or
    # its gradient is below 1e-7, which leaves less): f − f* ≤ that, |log T − log T*| ≤ √(2 that / f'')
    fitted = torch.tensor(math.log(temperature), dtype=torch.float64)
    assert objective(fitted) - objective(log_t) <= LBFGS_TOLERANCE_CHANGE
    curvature = hessian(objective, log_t).item()
    assert math.log(temperature) == pytest.approx(log_t.item(), abs=math.sqrt(2 * LBFGS_TOLERANCE_CHANGE / curvature))
    out = check_log_probabilities(calibrator, test_lp)
    expected = F.log_softmax(test_lp / temperature, -1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # applied in float32 to float32 inputs, as a run's own temperature: float32 rounding of the scaled
    # inputs and of the largest of them in the log-sum-exp
    with torch.no_grad():
        low = calibrator(test_lp.float()).double()
    scale = 1 + (test_lp / temperature).abs().amax(-1, keepdim=True)
    assert ((low - expected).abs() <= 8 * torch.finfo(torch.float32).eps * scale).all()
    check_facts(calibrator, fit_lp, fit_y)


def test_the_recorded_facts_keep_their_names_and_values():
    fit_lp, fit_y, _ = inputs("all")
    calibrator = HistogramBinning().fit(fit_lp, fit_y)
    with torch.no_grad():
        after = calibrator(fit_lp)
    changed = (after.argmax(-1) != fit_lp.argmax(-1)).double().mean().item()
    assert calibrator.facts == {
        "calibrator": "histogram_binning",
        "calibrator_bins": 15,
        "calibrator_floor": 1e-06,
        "calibrator_examples": 600,
        "calibrator_nll_before": pytest.approx(nll(fit_lp, fit_y), rel=ROUNDING),
        "calibrator_nll_after": pytest.approx(nll(after, fit_y), rel=ROUNDING),
        "calibrator_argmax_changed": changed,
    }
    fit_lp, fit_y, _ = inputs("3 classes")
    calibrator, _ = fitted_dirichlet("dirichlet_cross_validated")
    with torch.no_grad():
        after = calibrator(fit_lp)
    changed = (after.argmax(-1) != fit_lp.argmax(-1)).double().mean().item()
    lam = calibrator.chosen[0]
    assert lam in ODIR_GRID
    assert calibrator.facts == {
        "calibrator": "dirichlet",
        "dirichlet_map": "full",
        "odir_lambda": lam,
        "odir_mu": lam,
        "odir_chosen_by": "3-fold cross-validation",
        "calibrator_examples": 150,
        "calibrator_nll_before": pytest.approx(nll(fit_lp, fit_y), rel=ROUNDING),
        "calibrator_nll_after": pytest.approx(nll(after, fit_y), rel=ROUNDING),
        "calibrator_argmax_changed": changed,
    }


#: the post-hoc posteriors checked on the digits model of conftest.py: (its calibrator, its base or None)
METHOD_CASES = {
    "histogram_binning": (lambda: HistogramBinning(), None),
    "isotonic": (lambda: IsotonicCalibration(), None),
    "dirichlet": (lambda: DirichletCalibration(reg_lambda=0.01), None),
    "temperature": (lambda: TemperatureScaling(), None),
    "laplace+isotonic": (
        lambda: IsotonicCalibration(),
        lambda: LastLayerLaplace(n_samples=8, hessian="diag", prior_precision=1.0),
    ),
}


@pytest.mark.parametrize("case", list(METHOD_CASES))
def test_each_posthoc_calibration_predicts_its_calibrator_fitted_on_the_validation_predictive(digits_map, case):
    """The post-hoc posterior predicts what its calibrator, fitted by hand on the validation predictive
    of the method (or of its base), makes of the method's (its base's) predictive."""
    make, base = METHOD_CASES[case]
    method, dm = digits_map
    x = dm.preprocess(next(iter(dm.val_dataloader()))[0][:32])
    posterior = PosthocCalibration(make(), base=None if base is None else base())
    assert case.startswith(posterior.name)  # laplace+isotonic: after its base
    fitted = posterior.fit(copy.deepcopy(method), dm, {}, posterior.n_samples)  # laplace+isotonic: the base's S
    with torch.no_grad():
        predicted = fitted.predict_log_probs(x)
        fitted.calibrator = None  # the method (its base) as the calibrator saw it
        by_hand = make().fit(*validation_predictive(fitted, dm))
        torch.testing.assert_close(predicted, by_hand(fitted.predict_log_probs(x)), rtol=1e-5, atol=1e-6)
