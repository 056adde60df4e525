"""Train a method: `python train.py model=dbsn data=cifar10 [trainer.devices=4] [experiment=cifar10_paper]`
(the same as `dbsn-train ...`).

Composes conf/train.yaml, checks it, fits, tests the final model with the Bayes ensemble and
writes metrics.json + reliability_diagram.png into the run's output folder (`dbsn.runtime.cli`).
"""

from dbsn.runtime.cli import train

if __name__ == "__main__":
    train()
