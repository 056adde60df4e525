"""The calibrators give the numbers they gave before each became one class in a file of its own
behind one post-hoc wrapper (`PosthocCalibration`): the references below were computed by the
classes they replace (`HistogramBinningMap`, `IsotonicMap`, `DirichletMap` and their
`HistogramBinning`, `IsotonicCalibration`, `DirichletCalibration` posteriors in the former
`dbsn/posthoc/calibrators.py`, and `dbsn.posthoc.temperature.TemperatureScaling`, at commit
884e68b), on the same inputs, in float64 on the CPU: each case's calibrated log-probabilities are
compared by three fixed random projections of its calibrated probabilities and its fit by the
validation NLL it reached (to 1e-9, relative: a CPU that rounds sums in another order passes).
On the digits model, each post-hoc posterior is its calibrator fitted on the validation predictive.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dbsn.posthoc.calibrators import (DirichletCalibration, HistogramBinning, IsotonicCalibration, PosthocCalibration,
                                      TemperatureScaling, validation_predictive)
from dbsn.posthoc.laplace import LastLayerLaplace
from tests.posthoc.test_calibrators import C, miscalibrated


def projections(log_probs: torch.Tensor) -> list[float]:
    """Three fixed random projections of the probabilities: a change of any of them beyond rounding
    shows, and a CPU that sums in another order does not fail the test."""
    probs = log_probs.double().exp()
    weights = torch.rand((3, *probs.shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [float((w * probs).sum()) for w in weights]


#: case: (the calibrator, on which inputs (all, without class 0, 3 classes), three fixed random projections
#: of its calibrated probabilities from float64 inputs, the same from float32 inputs, the validation NLL
#: after the fit (temperature scaling: T)
REFERENCE = {
    "histogram_binning": (lambda: HistogramBinning(), "all",
        [163.62179090018827, 165.1204766559766, 166.91352537218728],
        [163.62179172537225, 165.12047747770805, 166.91352622314616], 1.084955954920304),
    "histogram_binning_bins7": (lambda: HistogramBinning(bins=7), "all",
        [163.02281608299648, 166.68963814885336, 166.67891688919644],
        [163.02281772327603, 166.6896400327197, 166.67891875403296], 1.1518029235059277),
    "histogram_binning_no_class0": (lambda: HistogramBinning(), "no class 0",
        [164.36912464691483, 161.78209431109286, 167.7937887435996],
        [164.36912489974858, 161.78209454371, 167.79378892179625], 0.8146632122909667),
    "isotonic": (lambda: IsotonicCalibration(), "all",
        [163.7021188294448, 166.3442763503596, 167.88062458561015],
        [163.70211888970132, 166.34427615603303, 167.88062490025288], 0.9637524784132112),
    "isotonic_no_class0": (lambda: IsotonicCalibration(floor=1e-4), "no class 0",
        [165.19562023505716, 163.67150378730076, 167.40967896620865],
        [165.19562082736036, 163.6715036645116, 167.40967952789111], 0.7102677857029512),
    "dirichlet_full": (lambda: DirichletCalibration("full", reg_lambda=1e-3), "all",
        [163.28945169876425, 166.17955406468695, 167.32075277180238],
        [163.289451802501, 166.1795540341679, 167.32075297676442], 0.8157238874355515),
    "dirichlet_full_mu": (lambda: DirichletCalibration("full", reg_lambda=1e-2, reg_mu=0.1), "all",
        [163.17578622631862, 166.15504596971815, 167.11537997630228],
        [163.17578604658172, 166.15504578496757, 167.1153800355522], 0.8189684936406287),
    "dirichlet_diagonal": (lambda: DirichletCalibration("diagonal"), "all",
        [162.8774291547764, 166.95803055206042, 167.86266668059025],
        [162.87742919511595, 166.95803068236623, 167.86266672428164], 0.9787195099410126),
    "dirichlet_diagonal_mu": (lambda: DirichletCalibration("diagonal", reg_mu=0.5), "all",
        [163.62487096377163, 165.8487884701421, 168.44253194769718],
        [163.62487080054905, 165.84878825892824, 168.44253187230768], 1.0604367170016817),
    "dirichlet_fixed_diagonal": (lambda: DirichletCalibration("fixed_diagonal"), "all",
        [163.9056149606764, 164.28662604409962, 168.62078793187803],
        [163.9056148336952, 164.28662598722903, 168.6207879951241], 1.200906268979022),
    "dirichlet_cross_validated": (lambda: DirichletCalibration("full", folds=3, max_iter=200), "3 classes",
        [72.49214971570899, 77.5773592301428, 69.19167432985742],
        [72.49214972533511, 77.57735923695358, 69.19167434757117], 0.725382434099324),
    "temperature": (lambda: TemperatureScaling(), "all",
        [163.90544852566833, 164.28661115982322, 168.62087901758554],
        [163.905447896397, 164.28661104490874, 168.62087872805455], 4.2776872430701856),
}

def inputs(which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fit log-probabilities, fit labels, test log-probabilities) of a reference case."""
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


def fitted_value(calibrator, facts: dict) -> float:
    return calibrator.facts["calibrator_temperature"] if isinstance(calibrator, TemperatureScaling) \
        else facts["calibrator_nll_after"]


@pytest.mark.parametrize("case", list(REFERENCE))
def test_each_calibrator_gives_its_former_outputs(case):
    make, which, expected64, expected32, expected_fit = REFERENCE[case]
    fit_lp, fit_y, test_lp = inputs(which)
    calibrator = make().fit(fit_lp, fit_y)
    assert fitted_value(calibrator, calibrator.facts) == pytest.approx(expected_fit, rel=1e-9)
    with torch.no_grad():
        assert projections(calibrator(test_lp)) == pytest.approx(expected64, rel=1e-9)
        assert projections(calibrator(test_lp.float())) == pytest.approx(expected32, rel=1e-6)


def test_the_recorded_facts_keep_their_names_and_values():
    calibrator = HistogramBinning().fit(*inputs("all")[:2])
    assert calibrator.facts == {"calibrator": "histogram_binning", "calibrator_bins": 15, "calibrator_floor": 1e-06,
                                "calibrator_examples": 600, "calibrator_nll_before": 2.316009036439538,
                                "calibrator_nll_after": 1.084955954920304, "calibrator_argmax_changed": 0.25}
    calibrator = DirichletCalibration("full", folds=3, max_iter=200).fit(*inputs("3 classes")[:2])
    assert calibrator.facts == {"calibrator": "dirichlet", "dirichlet_map": "full", "odir_lambda": 0.001, "odir_mu": 0.001,
                                "odir_chosen_by": "3-fold cross-validation", "calibrator_examples": 150,
                                "calibrator_nll_before": 1.647606409722292, "calibrator_nll_after": 0.725382434099324,
                                "calibrator_argmax_changed": 0.18666666666666668}


#: the post-hoc posteriors checked on the digits model of conftest.py: (its calibrator, its base or None)
METHOD_CASES = {
    "histogram_binning": (lambda: HistogramBinning(), None),
    "isotonic": (lambda: IsotonicCalibration(), None),
    "dirichlet": (lambda: DirichletCalibration(reg_lambda=0.01), None),
    "temperature": (lambda: TemperatureScaling(), None),
    "laplace+isotonic": (lambda: IsotonicCalibration(),
                         lambda: LastLayerLaplace(n_samples=8, hessian="diag", prior_precision=1.0)),
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
