"""The evaluation of trained models: what `evaluate.py` (and the end of `train.py`) runs, and the
report over many runs.

- `pipeline`: `Evaluator`, the test pass and the chosen evaluations of one model;
- `base`: the door for an evaluation (`Evaluation`: `check`, `run`), and what it is given (`Subject`);
- `results`: what each step returns (`Results`) and the one place that writes it down and
  hands it to the loggers (`write_results`);
- `test_pass`: metrics, calibration beyond ECE, selective prediction, reliability diagram,
  MC-sample ablation, structure posterior;
- the evaluations of `conf/evaluations/`: `ood` (`OODDetection`; `ood_groups`: OpenOOD's near /
  far groups), `shift` (`DatasetShift`), `adversarial` (`AdversarialRobustness`; `attacks`: FGSM, BIM),
  `conformal` (`ConformalPrediction`: conformal prediction sets, their coverage and size, also
  under the shift evaluation's corruptions);
- figures and tables: `ablation`, `structure` (and the training callback that tracks it), `plots`;
- `tracking`: what goes to W&B under which names; `runs`: what a run folder holds;
- `report`: the paper's tables from a folder of runs.
"""
