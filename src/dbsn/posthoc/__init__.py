"""Post-hoc posteriors: fitted on a finished run, predicting with S members, evaluated by
`evaluate.py posthoc=<name>` as methods of their own (`base`: the interface):

- `temperature`: temperature scaling of any classifier (`TemperatureScaling`);
- `laplace`: a last-layer Laplace approximation of a point-estimate run (`LastLayerLaplace`);
- `swag`: SWAG from the moments a point-estimate run collected (`SWAG`, `SWAGCollector`);
- `histogram_binning`, `isotonic`, `dirichlet`: calibration maps of any classifier's predictive
  (`calibrators`: `HistogramBinning`, `IsotonicCalibration`, `DirichletCalibration`), alone or on
  top of another posterior.

Each is chosen by `conf/posthoc/<name>.yaml`, whose `_target_` builds it.
"""
