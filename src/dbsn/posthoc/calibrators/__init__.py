"""Calibrators: maps from a classifier's predictive log-probabilities to calibrated ones, fitted on
the validation split of a finished run, each evaluated as a post-hoc posterior with
`evaluate.py ckpt_path=<run> posthoc=<name>`.

- `base`: the door, `Calibrator` (what a calibrator says: `name`, `fit_map`, `transform`);
- `posthoc`: `PosthocCalibration`, any calibrator as a post-hoc posterior (written once);
- one file per calibrator: `temperature` (`TemperatureScaling`), `histogram_binning`
  (`HistogramBinning`), `isotonic` (`IsotonicCalibration`), `dirichlet` (`DirichletCalibration`).

A calibrator of your own is one class (a `Calibrator`, in your package or here) and one
`conf/posthoc/<name>.yaml`:

    _target_: dbsn.posthoc.calibrators.PosthocCalibration
    calibrator:
      _target_: myext.platt.PlattScaling
    n_samples: null
    base: null

`docs/extending.md` shows a complete one.
"""

from dbsn.posthoc.calibrators.base import FLOOR, Calibrator, OneVsRestCalibrator, floored_log
from dbsn.posthoc.calibrators.dirichlet import DirichletCalibration
from dbsn.posthoc.calibrators.histogram_binning import HistogramBinning
from dbsn.posthoc.calibrators.isotonic import IsotonicCalibration
from dbsn.posthoc.calibrators.posthoc import PosthocCalibration, validation_predictive
from dbsn.posthoc.calibrators.temperature import TemperatureScaling

__all__ = [
    "FLOOR",
    "Calibrator",
    "DirichletCalibration",
    "HistogramBinning",
    "IsotonicCalibration",
    "OneVsRestCalibrator",
    "PosthocCalibration",
    "TemperatureScaling",
    "floored_log",
    "validation_predictive",
]
