"""Helpers shared by the test modules (`from tests.support.<module> import ...`).

- configs: the real Hydra configs composed as train.py / evaluate.py would, TINY overrides, an
  in-process quiet evaluate, small models and their configured optimisers.
- fakedata: fake data sets in their real on-disk formats (CIFAR, SVHN, CamVid, the OpenOOD sets,
  CIFAR-10-C, docs/extending.md's image folder) and crafted predictions.
- fakeruns: hand-made run folders for the report.
- scripts: `run_python`, the one way tests start train.py, evaluate.py or `python -m/-c`.
- invariants: checks several modules share (a grouped forward equals G copies; replicate; a
  post-hoc posterior's fixed members).
- netutil, steputil, autocast, marks: structures and grouped batches, one training step outside
  Lightning, bf16 autocast, shared marks.
- cluster_probe, grad_probe: callbacks that runs in subprocesses load by `_target_`.
- slurm_cluster, wandb_records: a local SLURM cluster; reading offline W&B run files.
"""
