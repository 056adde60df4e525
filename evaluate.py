"""Evaluate trained models: `python evaluate.py ckpt_path=PATH [evaluations=[ood,adversarial]]`.

PATH is a checkpoint, a list of checkpoints (evaluated as one deep ensemble) or a folder of
training runs (e.g. a multirun sweep: every run is evaluated, then the paper's tables are
written into PATH/report). The checkpoint carries its run config, so data and model are
rebuilt without being told the method. See conf/evaluate.yaml for the options.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dbsn.runtime.errors import one_line_errors


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from dbsn.runtime.run import evaluate

    evaluate(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
