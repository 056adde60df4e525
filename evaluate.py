"""Evaluate trained models: `python evaluate.py ckpt_path=PATH [evaluations=[ood,adversarial] ood=svhn]
[posthoc=laplace]` (the same as `dbsn-evaluate ...`).

PATH is a checkpoint, a list of checkpoints (evaluated as one deep ensemble) or a folder of
training runs (e.g. a multirun sweep: every run is evaluated, then the paper's tables are
written into PATH/report). The checkpoint carries its run config, so data and model are
rebuilt without being told the method. See conf/evaluate.yaml for the options.
"""

from dbsn.runtime.cli import evaluate

if __name__ == "__main__":
    evaluate()
