"""Calibration maps as post-hoc posteriors (dbsn.posthoc.calibrators): isotonic regression equals
scikit-learn's per class, histogram binning a per-bin count, Dirichlet calibration helps on held-out
data; which maps keep the argmax; a calibrated method predicts (members too) through its map; and
`evaluate.py posthoc=isotonic | dirichlet` end to end.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dbsn.data.digits import DigitsDataModule
from dbsn.evaluation.runs import CONFIG_FILE
from dbsn.methods import MAP, DeepEnsemble
from dbsn.methods.tasks import Segmentation
from dbsn.methods.temperature import TemperatureScaler
from dbsn.metrics.uncertainty import uncertainty_decomposition
from dbsn.posthoc.base import PosthocError
from dbsn.posthoc.laplace import LaplaceMethod, LastLayerLaplace
from dbsn.posthoc.calibrators import (FLOOR, LOG_EPS, ODIR_GRID, DirichletMap, HistogramBinningMap, IsotonicCalibration,
                                      IsotonicMap, dirichlet_objective, floored_log)
from dbsn.runtime.run import train
from tests.support.configs import compose_config, evaluate_quietly, tiny_for
from tests.support.netutil import tiny_structure_net

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
    iso = IsotonicMap(C).fit(fit_lp, fit_y)
    p_fit, p_test = fit_lp.exp().numpy(), test_lp.exp().numpy()
    expected = np.stack([IsotonicMap.regression(p_fit[:, c], (fit_y.numpy() == c).astype(float)).predict(p_test[:, c])
                         for c in range(C)], axis=1)
    assert torch.equal(iso.class_probabilities(test_lp), torch.from_numpy(expected))
    torch.testing.assert_close(iso(test_lp), floored_log(torch.from_numpy(expected), FLOOR), rtol=0, atol=1e-12)
    assert iso.x_thresholds.shape[0] == C and iso.x_thresholds.dtype == torch.float64
    # float32 inputs come back float32; an unfitted map is the identity
    assert iso(test_lp.float()).dtype == torch.float32
    mild = torch.randn(50, C, dtype=torch.float64).log_softmax(-1)  # every p above the floor
    torch.testing.assert_close(IsotonicMap(C)(mild), mild, rtol=0, atol=1e-12)


def test_histogram_binning_is_the_fraction_of_positives_in_each_bin():
    bins = 7
    fit_lp, fit_y = miscalibrated(400, seed=3)
    test_lp, _ = miscalibrated(200, seed=4)
    hist = HistogramBinningMap(C, bins=bins).fit(fit_lp, fit_y)
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


@pytest.mark.parametrize("map", ["full", "diagonal", "fixed_diagonal"])
def test_dirichlet_lowers_the_held_out_nll_of_a_miscalibrated_set(map):
    lp, y = miscalibrated(3000, seed=5)
    fit, held = slice(0, 1500), slice(1500, None)
    dirichlet = DirichletMap(C, map, reg_lambda=1e-3).fit(lp[fit], y[fit])
    with torch.no_grad():
        assert nll(dirichlet(lp[held]), y[held]) < nll(lp[held], y[held]) - 0.05
    assert dirichlet.facts["calibrator_nll_after"] < dirichlet.facts["calibrator_nll_before"]


def test_dirichlet_is_the_identity_at_w_i_b_0_and_its_gradient_is_exact():
    lp, y = miscalibrated(200, seed=6)
    assert lp.min() > LOG_EPS
    for map in ("full", "diagonal", "fixed_diagonal"):
        torch.testing.assert_close(DirichletMap(C, map)(lp), lp, rtol=0, atol=1e-12)
    z, onehot = lp.numpy(), np.eye(C)[y.numpy()]
    rng = np.random.default_rng(0)
    for map, size in (("full", C * C + C), ("diagonal", 2 * C), ("fixed_diagonal", 1)):
        params = rng.normal(size=size) * 0.5
        params_t = torch.tensor(params, requires_grad=True)
        weight = {"full": lambda p: p[:C * C].view(C, C), "diagonal": lambda p: torch.diag(p[:C]),
                  "fixed_diagonal": lambda p: p[0].exp() * torch.eye(C, dtype=torch.float64)}[map](params_t)
        bias = params_t[-C:] if map != "fixed_diagonal" else torch.zeros(C, dtype=torch.float64)
        off = weight - torch.diag(weight.diagonal())
        loss = (F.cross_entropy(lp @ weight.T + bias, y) + 0.7 / (C * (C - 1)) * off.square().sum()
                + 0.3 / C * bias.square().sum())
        loss.backward()
        value, grad = dirichlet_objective(params, z, onehot, map, 0.7, 0.3)
        assert value == pytest.approx(loss.item(), rel=1e-12)
        np.testing.assert_allclose(grad, params_t.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_dirichlet_cross_validation_picks_the_grid_value_with_the_least_held_out_nll():
    lp, y = miscalibrated(150, seed=7, classes=3)
    dirichlet = DirichletMap(3, "full", folds=3, max_iter=200)
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


def test_which_maps_keep_the_argmax_and_the_share_they_change():
    lp, y = miscalibrated(1000, seed=8)
    random_inputs = (6 * torch.randn(500, C, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).log_softmax(-1)
    temperature = TemperatureScaler()
    temperature.fit(lp, y)
    fixed = DirichletMap(C, "fixed_diagonal").fit(lp, y)
    for keeps in (temperature, fixed):
        assert keeps.preserves_argmax
        with torch.no_grad():
            assert torch.equal(keeps(random_inputs).argmax(-1), random_inputs.argmax(-1))
    assert "calibrator_argmax_changed" not in fixed.facts
    for moves in (HistogramBinningMap(C), IsotonicMap(C), DirichletMap(C, "diagonal"),
                  DirichletMap(C, "full", reg_lambda=1e-3)):
        assert not moves.preserves_argmax
        moves.fit(lp, y)
        with torch.no_grad():
            changed = (moves(lp).argmax(-1) != lp.argmax(-1)).double().mean().item()
        assert changed > 0 and moves.facts["calibrator_argmax_changed"] == changed


def test_a_calibrated_method_predicts_and_decomposes_through_its_map():
    torch.manual_seed(0)
    method = DeepEnsemble([MAP(tiny_structure_net(C), learn_structure=False) for _ in range(3)]).eval()
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        plain, members = method.predict_log_probs(x), method.predict_members(x)
        method.calibrator = DirichletMap(C, "full")
        method.calibrator.weight.copy_(torch.eye(C) * 1.7 + 0.1 * torch.randn(C, C))
        method.calibrator.bias.copy_(torch.linspace(-0.5, 0.5, C))
        torch.testing.assert_close(method.predict_log_probs(x), method.calibrator(plain))
        scores = method.uncertainty_scores(x)
        expected = uncertainty_decomposition(method.calibrator(members))
        for key in expected:
            torch.testing.assert_close(scores[key], expected[key])
        method.temperature_scaling = True  # the temperature first, then the map
        method.temperature.log_temperature.fill_(np.log(2.0))
        torch.testing.assert_close(method.predict_log_probs(x), method.calibrator(method.temperature(plain)))
    assert method.run_facts() == {}  # facts come from a fit
    method.calibrator = None
    method.temperature_scaling = False
    with torch.no_grad():
        torch.testing.assert_close(method.predict_log_probs(x), plain)


def test_a_map_on_top_of_laplace_calibrates_the_laplace_predictive(digits_map):
    method, dm = digits_map
    posterior = IsotonicCalibration(base=LastLayerLaplace(n_samples=8, hessian="diag", prior_precision=1.0))
    assert posterior.name == "laplace+isotonic" and posterior.why_not(method, {}) is None
    posterior.check(method, dm, {})
    laplace = posterior.fit(method, dm, {})
    assert isinstance(laplace, LaplaceMethod) and isinstance(laplace.calibrator, IsotonicMap)
    assert method.calibrator is None  # the run's own method is left as it was
    x = dm.preprocess(next(iter(dm.val_dataloader()))[0][:16])
    with torch.no_grad():
        calibrated = laplace.predict_log_probs(x)
        calibrator, laplace.calibrator = laplace.calibrator, None
        plain = laplace.predict_log_probs(x)
    torch.testing.assert_close(calibrated, calibrator(plain))
    assert laplace.run_facts()["posterior"] == "last-layer Laplace"
    laplace.calibrator = calibrator
    facts = laplace.run_facts()
    assert facts["posterior"] == "last-layer Laplace" and facts["calibrator"] == "isotonic"


def test_check_refuses_segmentation_and_a_run_without_validation():
    posterior = IsotonicCalibration()
    segmentation = SimpleNamespace(task=Segmentation())
    assert "segmentation model" in posterior.why_not(segmentation, {})
    no_val = DigitsDataModule(num_workers=0, val_size=0)
    with pytest.raises(PosthocError, match="validation split.*data.val_size=0"):
        posterior.check(MAP(tiny_structure_net(), learn_structure=False), no_val, {})
    with pytest.raises(PosthocError, match=r"posthoc.bins must be >= 1"):
        from dbsn.posthoc.calibrators import HistogramBinning
        HistogramBinning(bins=0)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A finished map_fixed run on 300 digits with a 100-image validation split."""
    root = tmp_path_factory.mktemp("calibrated")
    overrides = ["data=digits", "data.num_workers=0", "data.val_size=100", "data.train_subset=300", "model=map_fixed",
                 *tiny_for("map_fixed"), "trainer.max_epochs=1", "logger=csv"]
    train(compose_config("train", overrides, root), root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("isotonic", ["posthoc=isotonic"]),
    ("dirichlet", ["posthoc=dirichlet", "posthoc.reg_lambda=0.01"]),
    ("laplace+histogram_binning", ["posthoc=histogram_binning", "+posthoc@posthoc.base=laplace",
                                   "posthoc.base.n_samples=4", "posthoc.base.hessian=diag"]),
])
def test_evaluate_with_a_calibrator_writes_its_posthoc_run(digits_run, tmp_path, name, overrides):
    evaluate_quietly(digits_run / "checkpoints" / "last.ckpt", tmp_path, overrides)
    folder = digits_run / "posthoc" / name
    record = json.loads((folder / "metrics.json").read_text())
    assert record["posthoc"] == name and record["calibrator"] == name.split("+")[-1]
    assert np.isfinite(record["metrics"]["test/nll"]) and 0 <= record["metrics"]["test/error"] <= 1
    assert record["calibrator_nll_after"] < record["calibrator_nll_before"]
    assert 0 <= record["calibrator_argmax_changed"] <= 1
    assert OmegaConf.load(folder / CONFIG_FILE).posthoc == name  # the report reads it as method map_fixed+<name>
    assert (folder / "evaluation").is_dir()
