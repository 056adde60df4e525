"""One extra DDP rank on this node: `python -m dbsn.runtime.child <resolved_config.yaml> <run dir>`.

`dbsn.runtime.ddp` starts these; each runs `dbsn.runtime.run.train` on the run's saved config
and folder without Hydra (see that module's docstring)."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from omegaconf import OmegaConf

    from dbsn.runtime.run import train

    config_path, run_dir = argv
    train(OmegaConf.load(config_path), Path(run_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
