"""Train a method: `python train.py model=dbsn data=cifar10 [trainer.devices=4] [experiment=cifar10_paper]`.

Composes conf/train.yaml, checks it, fits, tests the final model with the Bayes ensemble and
writes metrics.json + reliability_diagram.png into the run's output folder.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dbsn.runtime.errors import one_line_errors


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@one_line_errors
def main(cfg: DictConfig) -> float | None:
    from dbsn.runtime.run import train

    metrics = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    return metrics.get("test/error")  # what a sweep would optimise


if __name__ == "__main__":
    main()
