"""dbsn's calibrators and equal-width ECE against netcal's, on the same probabilities and labels.

netcal takes probabilities, dbsn log-probabilities of the same numbers. What is compared, and
to what tolerance:

- histogram binning and isotonic regression (one-vs-rest, `dbsn.posthoc.calibrators`): each
  class's map g_c(p_c) is a closed form of the data (bin frequencies; scikit-learn's isotonic
  fit, which both call), so they agree to float64 rounding. The renormalised output differs on
  purpose in one place: dbsn raises every g_c to at least its `floor` (1e-6) before
  renormalising (netcal divides by the sum as it is, a zero stays zero); the test applies that
  floor to netcal's per-class values. netcal's histogram binning also bins an interior edge
  differently when fitting ([a, b), scipy's binned_statistic_dd) and when applying ((a, b],
  np.digitize(right=True)); the random probabilities here never lie on an edge.
- temperature scaling, and Dirichlet calibration's ``diagonal`` map against netcal's
  LogisticCalibration (softmax(w ⊙ log p + b): vector scaling on log p, ODIR's μ = 0) and its
  ``fixed_diagonal`` map against netcal's TemperatureScaling: fitted by different optimisers
  (netcal: scipy's ``minimize`` with a finite-difference gradient and default tolerances; dbsn:
  L-BFGS with the exact gradient, torch's for the temperature, scipy's L-BFGS-B for Dirichlet).
  Both stop where the NLL changes by about 1e-9 relative, which leaves a parameter δ from the
  optimum with ½ NLL'' δ² ≈ 1e-9 NLL: about 1e-4 relative in T and w, 1e-5 in the calibrated
  probabilities, and the two fitted NLLs within 1e-8 relative. netcal's "temperature" is the
  weight 1/T. The bias of vector scaling is defined up to a constant (softmax), so the
  probabilities are compared, not b.
- the equal-width top-label ECE (`dbsn.metrics.binning`: [b/M, (b+1)/M), a confidence of
  exactly 1 in the last bin) against netcal's ECE: netcal clips confidences to [eps, 1 − eps], so
  a confidence of 1 falls in its last bin too (at 1 − eps: a difference of eps per example);
  its edges are np.linspace's, which differ from torch.linspace's by an ulp at some edges, so
  confidences exactly on an edge are compared with M = 16 (dyadic edges, exact in both);
- the equal-mass (adaptive) ECE against netcal's ECE with equal_intervals=False, where N is a
  multiple of M and no confidences tie (then both bin the same examples together).

Dirichlet calibration's ``full`` map has no oracle here: dirichletcal, its authors' package, is
not on the package mirror, and its one PyPI release (0.3.dev4, an sdist) does not build
(malformed install_requires); netcal has no full-matrix map.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("netcal", reason="netcal is not installed (pip install -e '.[oracles]')")

from netcal.binning import HistogramBinning as NetcalHistogramBinning  # noqa: E402
from netcal.binning import IsotonicRegression as NetcalIsotonic  # noqa: E402
from netcal.metrics import ECE  # noqa: E402
from netcal.scaling import LogisticCalibration, TemperatureScaling  # noqa: E402

from dbsn.metrics.calibration import adaptive_expected_calibration_error  # noqa: E402
from dbsn.metrics.classification import BinnedCalibrationError, expected_calibration_error  # noqa: E402
from dbsn.posthoc.calibrators.base import FLOOR, floored_log  # noqa: E402
from dbsn.posthoc.calibrators.dirichlet import DirichletCalibration  # noqa: E402
from dbsn.posthoc.calibrators.histogram_binning import HistogramBinning  # noqa: E402
from dbsn.posthoc.calibrators.isotonic import IsotonicCalibration  # noqa: E402
from dbsn.posthoc.calibrators.temperature import TemperatureScaling as DbsnTemperatureScaling  # noqa: E402

N, C = 800, 5


def _predictions(seed: int = 0, scale: float = 3.0, temperature: float = 2.0):
    """Over-confident log-probabilities (N, C) and labels drawn at the given temperature."""
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(N, C, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / temperature, 1), 1, generator=g).squeeze(1)
    return torch.log_softmax(logits, 1), labels


def _one_vs_rest(netcal_model, probs: np.ndarray) -> np.ndarray:
    """netcal's per-class maps g_c(p_c), (N, C), before its renormalisation."""
    return np.stack([model.transform(probs[:, c]) for c, model in netcal_model._multiclass_instances], 1)


def _nll(probs, labels) -> float:
    return F.nll_loss(torch.as_tensor(probs).log(), labels).item()


# --------------------------------------------------------------------------- the closed-form maps
@pytest.mark.parametrize("bins", [10, 15])
def test_histogram_binning_equals_netcal(bins):
    log_probs, labels = _predictions()
    test_log_probs, _ = _predictions(seed=1)
    ours = HistogramBinning(bins=bins).fit(log_probs, labels)
    theirs = NetcalHistogramBinning(bins=bins).fit(log_probs.exp().numpy(), labels.numpy())
    per_class = _one_vs_rest(theirs, test_log_probs.exp().numpy())
    np.testing.assert_allclose(ours.class_probabilities(test_log_probs).numpy(), per_class, rtol=0, atol=1e-15)
    expected = floored_log(torch.from_numpy(per_class), FLOOR)
    torch.testing.assert_close(ours(test_log_probs), expected, rtol=0, atol=1e-12)
    if (per_class >= FLOOR).all():  # the floor does not act: netcal's renormalised output itself
        np.testing.assert_allclose(
            ours(test_log_probs).exp().numpy(), theirs.transform(test_log_probs.exp().numpy()), rtol=0, atol=1e-14
        )


def test_isotonic_regression_equals_netcal():
    log_probs, labels = _predictions()
    test_log_probs, _ = _predictions(seed=1)
    ours = IsotonicCalibration().fit(log_probs, labels)
    theirs = NetcalIsotonic().fit(log_probs.exp().numpy(), labels.numpy())
    per_class = _one_vs_rest(theirs, test_log_probs.exp().numpy())
    np.testing.assert_allclose(ours.class_probabilities(test_log_probs).numpy(), per_class, rtol=0, atol=1e-14)
    torch.testing.assert_close(
        ours(test_log_probs), floored_log(torch.from_numpy(per_class), FLOOR), rtol=0, atol=1e-12
    )


# ------------------------------------------------------------------------------- the fitted maps
def test_temperature_scaling_equals_netcal_to_the_optimisers_tolerance():
    log_probs, labels = _predictions()
    probs = log_probs.exp().numpy()
    theirs = TemperatureScaling(method="mle").fit(probs, labels.numpy())
    netcal_temperature = 1 / float(np.asarray(theirs.temperature).item())
    for ours in (
        DbsnTemperatureScaling().fit(log_probs, labels),
        DirichletCalibration(map="fixed_diagonal").fit(log_probs, labels),
    ):
        temperature = ours.scaler.temperature if hasattr(ours, "scaler") else 1 / ours.weight[0, 0].item()
        assert math.isclose(temperature, netcal_temperature, rel_tol=1e-4), (temperature, netcal_temperature)
        calibrated = ours(log_probs).exp()
        np.testing.assert_allclose(calibrated.numpy(), theirs.transform(probs), rtol=0, atol=1e-5)
        assert math.isclose(_nll(calibrated, labels), _nll(theirs.transform(probs), labels), rel_tol=1e-8)
    assert not math.isclose(netcal_temperature, 1.0, rel_tol=0.1)  # the fit moved T: the comparison means something


def test_dirichlet_diagonal_equals_netcal_vector_scaling_to_the_optimisers_tolerance():
    log_probs, labels = _predictions()
    probs = log_probs.exp().numpy()
    theirs = LogisticCalibration(method="mle").fit(probs, labels.numpy())
    ours = DirichletCalibration(map="diagonal").fit(log_probs, labels)
    np.testing.assert_allclose(ours.weight.diagonal().numpy(), np.asarray(theirs.weights), rtol=1e-4, atol=0)
    calibrated = ours(log_probs).exp()
    np.testing.assert_allclose(calibrated.numpy(), theirs.transform(probs), rtol=0, atol=1e-5)
    assert math.isclose(_nll(calibrated, labels), _nll(theirs.transform(probs), labels), rel_tol=1e-8)


# ------------------------------------------------------------------------------------------ ECE
@pytest.mark.parametrize("bins", [10, 15, 16])
def test_ece_equals_netcal_with_confidences_of_one(bins):
    """Random predictions plus 10 wrong ones of confidence exactly 1.0 and 50 right ones of
    confidence 0.96: both put them in the last bin, where their gaps have opposite signs, so a bin
    of their own for the 1.0s (torchmetrics' convention) would give a different ECE, which the test
    checks. With 16 bins also 60 confidences exactly on the (dyadic) edges, which both bin as
    [b/M, (b+1)/M). Also the logged ECE (`BinnedCalibrationError`, fed in two batches; it
    accumulates in float64 and returns float32, so to float32's rounding)."""
    log_probs, labels = _predictions(scale=2.0, temperature=0.5)
    probs = log_probs.exp()
    probs[:10] = F.one_hot((labels[:10] + 1) % C, C).double()
    probs[10:60] = 0.01 + 0.95 * F.one_hot(labels[10:60], C).double()
    if bins == 16:
        edge = torch.randint(1, 16, (60,), generator=torch.Generator().manual_seed(2)).double() / 16
        edge = torch.maximum(edge, torch.full_like(edge, 0.25))  # stays the top label of 5 classes
        rest = (1 - edge)[:, None] / (C - 1) * torch.ones(60, C - 1, dtype=torch.float64)
        probs[60:120] = torch.cat([edge[:, None], rest], 1)
        assert (probs[60:120].amax(1) == edge).all()
    theirs = ECE(bins=bins).measure(probs.numpy(), labels.numpy())
    ours = expected_calibration_error(probs, labels, n_bins=bins).item()
    assert math.isclose(ours, theirs, rel_tol=0, abs_tol=1e-12), (ours, theirs)
    logged = BinnedCalibrationError(n_bins=bins)
    logged.update(probs[:300], labels[:300])
    logged.update(probs[300:], labels[300:])
    assert math.isclose(logged.compute().item(), theirs, rel_tol=2**-23, abs_tol=0)
    ones = probs.amax(1) == 1
    own_bin = (
        expected_calibration_error(probs[~ones], labels[~ones], n_bins=bins).item() * (~ones).sum().item()
        + ones.sum().item()
    ) / N  # the 10 wrong ones' gap |Σ (0 − 1)| = 10 in a bin of their own
    assert abs(own_bin - theirs) > 1e-3


@pytest.mark.parametrize("bins", [10, 16])
def test_adaptive_ece_equals_netcal_equal_mass_ece(bins):
    """Equal-mass bins (`adaptive_expected_calibration_error`) against netcal's ECE with
    ``equal_intervals=False`` (edges at np.quantile of the confidences). With N a multiple of M
    and no ties both put exactly N / M examples, the same ones, in each bin; otherwise netcal's
    interpolated edges can move one example to the neighbouring bin (and dbsn spreads ties, see
    its docstring), so only that case is compared."""
    log_probs, labels = _predictions(scale=2.0, temperature=0.7)
    probs = log_probs.exp()
    assert N % bins == 0 and probs.amax(1).unique().numel() == N
    theirs = ECE(bins=bins, equal_intervals=False).measure(probs.numpy(), labels.numpy())
    ours = adaptive_expected_calibration_error(probs, labels, n_bins=bins).item()
    assert math.isclose(ours, theirs, rel_tol=0, abs_tol=1e-12), (ours, theirs)
    assert not math.isclose(ours, expected_calibration_error(probs, labels, n_bins=bins).item(), abs_tol=1e-4)
