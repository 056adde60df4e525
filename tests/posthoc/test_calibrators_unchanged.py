"""The calibrators give the numbers they gave before each became one class in a file of its own
behind one post-hoc wrapper (`PosthocCalibration`): the references below were computed by the
classes they replace (`HistogramBinningMap`, `IsotonicMap`, `DirichletMap` and their
`HistogramBinning`, `IsotonicCalibration`, `DirichletCalibration` posteriors in the former
`dbsn/posthoc/calibrators.py`, and `dbsn.posthoc.temperature.TemperatureScaling`, at commit
884e68b), on the same inputs, in float64 on the CPU: each case's calibrated log-probabilities are
compared bit for bit (by their SHA-256) and its fit by the validation NLL it reached (exactly).
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import pytest
import torch

from dbsn.posthoc.calibrators import (DirichletCalibration, HistogramBinning, IsotonicCalibration, PosthocCalibration,
                                      TemperatureScaling)
from dbsn.posthoc.laplace import LastLayerLaplace
from tests.posthoc.test_calibrators import C, miscalibrated


def digest(values: torch.Tensor) -> str:
    return hashlib.sha256(np.ascontiguousarray(values.numpy()).tobytes()).hexdigest()[:20]


#: case: (the calibrator, on which inputs (all, without class 0, 3 classes), digest of its float64
#: outputs, of its float32 outputs, the validation NLL after the fit (temperature scaling: T))
REFERENCE = {
    "histogram_binning": (lambda: HistogramBinning(), "all", "8fb2795999a9b25dbf5c", "78911b284c9e9ab82b43",
                          1.084955954920304),
    "histogram_binning_bins7": (lambda: HistogramBinning(bins=7), "all", "30aba3644fbe2c924952", "02558491b3fa58d6c5d8",
                                1.1518029235059277),
    "histogram_binning_no_class0": (lambda: HistogramBinning(), "no class 0", "661e26aee7b7faeff1b1",
                                    "374056d0b673d33f490b", 0.8146632122909667),
    "isotonic": (lambda: IsotonicCalibration(), "all", "98c753e47d5ffeb7cc44", "c5de224c713b6f5d3db7",
                 0.9637524784132112),
    "isotonic_no_class0": (lambda: IsotonicCalibration(floor=1e-4), "no class 0", "e524191c8ce40789eaf0",
                           "ff51faa5f9b6e0e2a524", 0.7102677857029512),
    "dirichlet_full": (lambda: DirichletCalibration("full", reg_lambda=1e-3), "all", "9c844d81994e5f3a555e",
                       "127a0411851157217e8f", 0.8157238874355515),
    "dirichlet_full_mu": (lambda: DirichletCalibration("full", reg_lambda=1e-2, reg_mu=0.1), "all", "2a404da03a8fddcf463c",
                          "1384d054936dddddda07", 0.8189684936406287),
    "dirichlet_diagonal": (lambda: DirichletCalibration("diagonal"), "all", "44f60da139143cf12df1", "c5d159d05ffa411f0132",
                           0.9787195099410126),
    "dirichlet_diagonal_mu": (lambda: DirichletCalibration("diagonal", reg_mu=0.5), "all", "9621dd5036eb10640812",
                              "c5587251108342610ebc", 1.0604367170016817),
    "dirichlet_fixed_diagonal": (lambda: DirichletCalibration("fixed_diagonal"), "all", "2f23629966143ffeb82f",
                                 "d18f2b5a9055b5521bcb", 1.200906268979022),
    "dirichlet_cross_validated": (lambda: DirichletCalibration("full", folds=3, max_iter=200), "3 classes",
                                  "aee95bf8f6559e16b900", "44204296fea6ba8905ad", 0.725382434099324),
    "temperature": (lambda: TemperatureScaling(), "all", "57b6c706838a5b9c90d6", "e9000509a24b692902e5",
                    4.2776872430701856),
}

#: the post-hoc posterior on the digits model of conftest.py: (the posterior, digest of its predictive
#: log-probabilities (float32) on 32 validation images, the validation NLL after the fit (temperature: T))
METHOD_REFERENCE = {
    "histogram_binning": (lambda: HistogramBinning(), None, "5dfbb689e8fc44d679a1", 0.7325216166693009),
    "isotonic": (lambda: IsotonicCalibration(), None, "d738a764c3d9b373f741", 0.7607194139590123),
    "dirichlet": (lambda: DirichletCalibration(reg_lambda=0.01), None, "50188822362e9a7eb06e", 0.12321138308942675),
    "dirichlet_fixed_diagonal": (lambda: DirichletCalibration("fixed_diagonal"), None, "a9bdd388b779aecb2e69",
                                 1.2686736714131528),
    "temperature": (lambda: TemperatureScaling(), None, "c3c95d0c4a728187474c", 1.8780677345670689),
    "laplace+isotonic": (lambda: IsotonicCalibration(),
                         lambda: LastLayerLaplace(n_samples=8, hessian="diag", prior_precision=1.0),
                         "d6dfcf49a7b74db25bb2", 0.7497505016394372),
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
    assert fitted_value(calibrator, calibrator.facts) == expected_fit
    with torch.no_grad():
        assert digest(calibrator(test_lp)) == expected64
        assert digest(calibrator(test_lp.float())) == expected32


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


@pytest.mark.parametrize("case", list(METHOD_REFERENCE))
def test_each_posthoc_calibration_predicts_as_before(digits_map, case):
    make, base, expected, expected_fit = METHOD_REFERENCE[case]
    method, dm = digits_map
    x = dm.preprocess(next(iter(dm.val_dataloader()))[0][:32])
    posterior = PosthocCalibration(make(), base=None if base is None else base())
    assert case.startswith(posterior.name)  # laplace+isotonic: after its base
    fitted = posterior.fit(copy.deepcopy(method), dm, {})
    with torch.no_grad():
        assert digest(fitted.predict_log_probs(x)) == expected
    assert fitted_value(fitted.calibrator, fitted.run_facts()) == expected_fit
