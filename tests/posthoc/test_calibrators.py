"""The calibrators' maths (dbsn.posthoc.calibrators): isotonic regression equals scikit-learn's per
class, histogram binning a per-bin count, Dirichlet calibration helps on held-out data and has an
exact gradient, temperature scaling is `TemperatureScaler`; which keep the argmax; the shared
input checks and the floor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dbsn.methods.temperature import TemperatureScaler
from dbsn.posthoc.calibrators import (
    FLOOR,
    DirichletCalibration,
    HistogramBinning,
    IsotonicCalibration,
    TemperatureScaling,
    floored_log,
)
from dbsn.posthoc.calibrators.dirichlet import LOG_EPS, ODIR_GRID, dirichlet_objective

C = 5


def miscalibrated(n: int, seed: int = 0, classes: int = C) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels drawn from softmax(true logits) and a predictive that distorts them class by class
    (scales 0.5 .. 4 and biases −1 .. 1 on the logits): over- and under-confident, and biased."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, classes, generator=torch.Generator().manual_seed(99)) * 0.8
    logits = torch.randn(n, 6, generator=g) @ weight
    y = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(1)
    bad = logits.double() * torch.linspace(0.5, 4, classes, dtype=torch.float64) + torch.linspace(-1, 1, classes)
    return bad.log_softmax(-1), y


def nll(log_probs, y) -> float:
    return F.nll_loss(log_probs, y).item()


def test_isotonic_equals_scikit_learns_per_class_maps():
    fit_lp, fit_y = miscalibrated(600, seed=1)
    test_lp, _ = miscalibrated(300, seed=2)
    corners = torch.eye(C, dtype=torch.float64).clamp_min(1e-300).log()  # p = 0 and p = 1: clipped to the range
    test_lp = torch.cat([test_lp, corners, fit_lp[:20]])  # fitted points themselves: on the thresholds
    iso = IsotonicCalibration().fit(fit_lp, fit_y)
    p_fit, p_test = fit_lp.exp().numpy(), test_lp.exp().numpy()
    expected = np.stack(
        [
            IsotonicCalibration.regression(p_fit[:, c], (fit_y.numpy() == c).astype(float)).predict(p_test[:, c])
            for c in range(C)
        ],
        axis=1,
    )
    assert torch.equal(iso.class_probabilities(test_lp), torch.from_numpy(expected))
    torch.testing.assert_close(iso(test_lp), floored_log(torch.from_numpy(expected), FLOOR), rtol=0, atol=1e-12)
    assert iso.x_thresholds.shape[0] == C and iso.x_thresholds.dtype == torch.float64
    assert iso(test_lp.float()).dtype == torch.float32  # float32 inputs come back float32


def test_histogram_binning_is_the_fraction_of_positives_in_each_bin():
    bins = 7
    fit_lp, fit_y = miscalibrated(400, seed=3)
    test_lp, _ = miscalibrated(200, seed=4)
    hist = HistogramBinning(bins=bins).fit(fit_lp, fit_y)
    p_fit, p_test = fit_lp.exp(), test_lp.exp()
    expected = torch.empty_like(p_test)
    for c in range(C):
        for m in range(bins):
            low, high = m / bins, (m + 1) / bins
            inside = (p_fit[:, c] >= low) & ((p_fit[:, c] < high) if m < bins - 1 else (p_fit[:, c] <= 1))
            value = (fit_y[inside] == c).double().mean() if inside.any() else torch.tensor((low + high) / 2)
            here = (p_test[:, c] >= low) & ((p_test[:, c] < high) if m < bins - 1 else (p_test[:, c] <= 1))
            expected[here, c] = value.double()
    torch.testing.assert_close(hist.class_probabilities(test_lp), expected, rtol=0, atol=1e-12)
    assert hist.facts["calibrator_bins"] == bins
    # a class no validation example has: its bins hold 0 (the empty ones their centres), floored
    others = fit_y != 0
    hist.fit(fit_lp[others], fit_y[others])
    assert (hist.values[0] == 0).any()
    out = hist(test_lp)
    assert torch.isfinite(out).all() and out.exp().min() > 0
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(len(out), dtype=torch.float64))


def test_temperature_scaling_is_the_methods_temperature_scaler():
    fit_lp, fit_y = miscalibrated(400, seed=3)
    test_lp, _ = miscalibrated(100, seed=4)
    scaler = TemperatureScaler()
    scaler.fit(fit_lp, fit_y)
    temperature = TemperatureScaling().fit(fit_lp, fit_y)
    assert temperature.facts["calibrator_temperature"] == scaler.temperature
    for inputs in (test_lp, test_lp.float()):  # applied in the input's dtype, as the run's own temperature
        with torch.no_grad():
            assert torch.equal(temperature(inputs), scaler(inputs))
    assert temperature.facts["calibrator_nll_after"] == pytest.approx(scaler.nll_after, rel=1e-12)


@pytest.mark.parametrize("map", ["full", "diagonal", "fixed_diagonal"])
def test_dirichlet_lowers_the_held_out_nll_of_a_miscalibrated_set(map):
    lp, y = miscalibrated(3000, seed=5)
    fit, held = slice(0, 1500), slice(1500, None)
    dirichlet = DirichletCalibration(map, reg_lambda=1e-3).fit(lp[fit], y[fit])
    with torch.no_grad():
        assert nll(dirichlet(lp[held]), y[held]) < nll(lp[held], y[held]) - 0.05
    assert dirichlet.facts["calibrator_nll_after"] < dirichlet.facts["calibrator_nll_before"]


def test_dirichlet_is_the_identity_at_w_i_b_0_and_its_gradient_is_exact():
    lp, y = miscalibrated(200, seed=6)
    assert lp.min() > LOG_EPS
    for map in ("full", "diagonal", "fixed_diagonal"):
        identity = DirichletCalibration(map)
        identity.num_classes, identity.weight, identity.bias = (
            C,
            torch.eye(C, dtype=torch.float64),
            torch.zeros(C, dtype=torch.float64),
        )
        torch.testing.assert_close(identity(lp), lp, rtol=0, atol=1e-12)
    z, onehot = lp.numpy(), np.eye(C)[y.numpy()]
    rng = np.random.default_rng(0)
    for map, size in (("full", C * C + C), ("diagonal", 2 * C), ("fixed_diagonal", 1)):
        params = rng.normal(size=size) * 0.5
        params_t = torch.tensor(params, requires_grad=True)
        weight = {
            "full": lambda p: p[: C * C].view(C, C),
            "diagonal": lambda p: torch.diag(p[:C]),
            "fixed_diagonal": lambda p: p[0].exp() * torch.eye(C, dtype=torch.float64),
        }[map](params_t)
        bias = params_t[-C:] if map != "fixed_diagonal" else torch.zeros(C, dtype=torch.float64)
        off = weight - torch.diag(weight.diagonal())
        loss = (
            F.cross_entropy(lp @ weight.T + bias, y)
            + 0.7 / (C * (C - 1)) * off.square().sum()
            + 0.3 / C * bias.square().sum()
        )
        loss.backward()
        value, grad = dirichlet_objective(params, z, onehot, map, 0.7, 0.3)
        assert value == pytest.approx(loss.item(), rel=1e-12)
        np.testing.assert_allclose(grad, params_t.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_dirichlet_cross_validation_picks_the_grid_value_with_the_least_held_out_nll():
    lp, y = miscalibrated(150, seed=7, classes=3)
    dirichlet = DirichletCalibration("full", folds=3, max_iter=200)
    dirichlet.num_classes = 3
    lam, mu = dirichlet.cross_validate(lp, y)
    parts = torch.randperm(150, generator=torch.Generator().manual_seed(0)).tensor_split(3)
    scores = []
    for grid_lam in ODIR_GRID:
        total = 0.0
        for k in range(3):
            fit = torch.cat([p for j, p in enumerate(parts) if j != k])
            weight, bias = dirichlet.solve(lp[fit], y[fit], grid_lam, grid_lam)
            total += F.cross_entropy(lp[parts[k]] @ weight.T + bias, y[parts[k]], reduction="sum").item()
        scores.append(total)
    assert lam == mu == ODIR_GRID[int(np.argmin(scores))]
    dirichlet.fit(lp, y)
    assert dirichlet.facts["odir_lambda"] == lam and dirichlet.facts["odir_chosen_by"] == "3-fold cross-validation"


def test_which_calibrators_keep_the_argmax_and_the_share_they_change():
    lp, y = miscalibrated(1000, seed=8)
    random_inputs = (
        6 * torch.randn(500, C, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ).log_softmax(-1)
    for keeps in (TemperatureScaling(), DirichletCalibration("fixed_diagonal")):
        assert keeps.preserves_argmax
        keeps.fit(lp, y)
        with torch.no_grad():
            assert torch.equal(keeps(random_inputs).argmax(-1), random_inputs.argmax(-1))
        assert "calibrator_argmax_changed" not in keeps.facts
    for moves in (
        HistogramBinning(),
        IsotonicCalibration(),
        DirichletCalibration("diagonal"),
        DirichletCalibration("full", reg_lambda=1e-3),
    ):
        assert not moves.preserves_argmax
        moves.fit(lp, y)
        with torch.no_grad():
            changed = (moves(lp).argmax(-1) != lp.argmax(-1)).double().mean().item()
        assert changed > 0 and moves.facts["calibrator_argmax_changed"] == changed


def test_settings_and_inputs_are_checked_in_one_line():
    for make, message in (
        (lambda: HistogramBinning(bins=0), "bins must be >= 1"),
        (lambda: IsotonicCalibration(floor=0.7), r"floor must lie in \(0, 1/C\)"),
        (lambda: DirichletCalibration("half"), "map must be one of"),
        (lambda: DirichletCalibration(reg_lambda=-1), "reg_lambda must be >= 0"),
        (lambda: DirichletCalibration(folds=1), "folds must be >= 2"),
    ):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match=r"\(0, 0.1\) for 10 classes, got 0.2"):
        IsotonicCalibration(floor=0.2).check(10)
    lp, y = miscalibrated(20)
    with pytest.raises(RuntimeError, match="not fitted"):
        IsotonicCalibration()(lp)
    for bad_lp, bad_y, message in (
        (lp[:, :1], y, "C >= 2"),
        (lp, y.double(), "integer labels"),
        (lp.clone().fill_(float("nan")), y, "NaN"),
        (lp, y + 10, "must lie in 0..4"),
    ):
        with pytest.raises(ValueError, match=message):
            HistogramBinning().fit(bad_lp, bad_y)
