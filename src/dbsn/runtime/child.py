"""One extra DDP rank on this node: `python -m dbsn.runtime.child <resolved_config.yaml> <run dir>`.

`dbsn.runtime.ddp` starts these; each runs `dbsn.runtime.run.train` on the run's saved config
and folder without Hydra (see that module's docstring). A rank stopped by a signal exits with
128 + the signal's number, as rank 0 does (rank 0 says why)."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from omegaconf import OmegaConf

    from dbsn.runtime.run import train
    from dbsn.runtime.signals import RunInterrupted

    config_path, run_dir = argv
    try:
        train(OmegaConf.load(config_path), Path(run_dir))
    except RunInterrupted as stop:
        sys.exit(stop.exit_status)


if __name__ == "__main__":
    main(sys.argv[1:])
