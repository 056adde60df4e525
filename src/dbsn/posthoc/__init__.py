"""Post-hoc posteriors: fitted on a finished run, predicting with S members, evaluated by
`evaluate.py posthoc=<name>` as methods of their own (`base`: the interface):

- `laplace`: a last-layer Laplace approximation of a point-estimate run (`LastLayerLaplace`);
- `swag`: SWAG from the moments a point-estimate run collected (`SWAG`, `SWAGCollector`);
- `temperature`, `histogram_binning`, `isotonic`, `dirichlet`: calibrators of any classifier's
  predictive (`calibrators`: one file per calibrator, each a `Calibrator`, made a posterior by one
  generic `PosthocCalibration`), alone or on top of another posterior.

Each is chosen by `conf/posthoc/<name>.yaml`, whose `_target_` builds it.
"""
