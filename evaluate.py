"""Evaluate a checkpoint: `python evaluate.py ckpt_path=PATH [n_samples=100] [data_root=DIR]`.

The checkpoint carries its run config, so data and model are rebuilt without being told the
method. Writes metrics.json and reliability_diagram.png into this run's output folder.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from dbsn.run import evaluate

    evaluate(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
