"""Where a run keeps its files, in one place for the code that writes them and the code that reads them.

A run folder (`outputs/<task>/runs/<time>/`, or `<sweep>/<job>/` in a multirun) holds the files named below.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "resolved_config.yaml"   # the resolved run config; DDP children and the report read it
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"           # written atomically at every epoch end (and on preemption)
WANDB_ID_FILE = "wandb_id"             # the W&B run id, kept so a resumed run continues the same W&B run
SLURM_FILE = "slurm.json"               # the SLURM job that ran (or last resumed) this run: ids, node list, logs


def last_checkpoint(run_dir: str | Path) -> Path:
    """`<run_dir>/checkpoints/last.ckpt`: what a resumed or requeued run continues from."""
    return Path(run_dir) / CHECKPOINT_DIR / LAST_CHECKPOINT
