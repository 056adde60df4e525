"""Checkpoints that survive crashes and say clearly when they are not ours.

- `AtomicCheckpointIO` writes every checkpoint to a temporary file beside the target, fsyncs
  it and renames it into place, so a run killed mid-write never leaves a truncated `last.ckpt`.
- `RunConfigCallback` stores the run's resolved Hydra config inside each checkpoint, so
  `evaluate.py ckpt_path=...` can rebuild data and model without being told the method.
- `load_checkpoint` reads a checkpoint and turns every way it can be wrong (missing, corrupt,
  foreign) into a `CheckpointError` that says what was found and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from dbsn import __version__

CONFIG_KEY = "dbsn_config"
VERSION_KEY = "dbsn_version"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix in the message."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` to `.<name>.tmp-<pid>` in the target folder, fsync, then `os.replace`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


class RunConfigCallback(pl.Callback):
    """Adds the resolved run config (plain dicts and lists) to every checkpoint."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config
        checkpoint[VERSION_KEY] = __version__


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by `train.py`, or raise `CheckpointError` saying why not."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint not found: {path}. train.py writes checkpoints to "
            "<run dir>/checkpoints/ (last.ckpt is the most recent)."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a bad file; all mean the same here
        raise CheckpointError(
            f"Could not read checkpoint {path} ({type(err).__name__}: {err}). The file is corrupt, "
            "truncated or not a PyTorch checkpoint; copy it again, or use the run's last.ckpt, "
            "which train.py writes atomically."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(
            f"{path} is a PyTorch file but not a Lightning checkpoint (no 'state_dict')."
        )
    if CONFIG_KEY not in checkpoint:
        raise CheckpointError(
            f"{path} is a Lightning checkpoint that dbsn's train.py did not write: it carries no "
            f"'{CONFIG_KEY}' (the run config needed to rebuild data and model)."
        )
    return checkpoint
