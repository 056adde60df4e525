"""Checkpoints that survive crashes and say clearly when they are not ours.

- `AtomicCheckpointIO` writes every checkpoint to a temporary file beside the target, fsyncs
  it and renames it into place, so a run killed mid-write never leaves a truncated `last.ckpt`;
  the checkpoint carries the digest of its tensors (`checkpoint_digest`, `dbsn.runtime.integrity`),
  recorded in the same write.
- `RunConfigCallback` stores the run's resolved Hydra config inside each checkpoint, so
  `evaluate.py ckpt_path=...` can rebuild data and model without being told the method.
- `RandomStateCallback` stores the random state (torch CPU/CUDA, numpy, Python) inside each
  checkpoint and puts it back before the first resumed epoch, so a resumed run draws the same
  structures, masks and weight noise as an uninterrupted one.
- `load_checkpoint` reads a checkpoint and turns every way it can be wrong (missing, truncated,
  damaged after it was written, foreign) into a `CheckpointError` that says what was found and
  what to do (`dbsn.runtime.integrity`). Every path that reads a checkpoint (evaluate, resume,
  `init_from`, refine, the post-hoc posteriors) goes through it.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from dbsn import __version__
from dbsn.evaluation.runs import RUN_ID_KEY
from dbsn.runtime.disk import OutputError, disk_problem
from dbsn.runtime.integrity import (
    DIGEST_KEY,
    VERSION_KEY,
    CheckpointError,
    checkpoint_digest,
    read_checkpoint,
    with_digest,
)

__all__ = [
    "CONFIG_KEY",
    "DIGEST_KEY",
    "VERSION_KEY",
    "AtomicCheckpointIO",
    "CheckpointError",
    "RandomStateCallback",
    "RunConfigCallback",
    "check_resume_checkpoint",
    "checkpoint_digest",
    "load_checkpoint",
    "upgrade_config",
    "version_note",
]

CONFIG_KEY = "dbsn_config"


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` to `.<name>.tmp-<pid>` in the target folder, fsync, then `os.replace`; the
    checkpoint written carries its tensors' digest (`DIGEST_KEY`, `dbsn.runtime.integrity.with_digest`)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(with_digest(checkpoint), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, RuntimeError) as err:
            problem = disk_problem(err, path.parent)
            if problem is None:
                raise
            raise OutputError(
                f"Could not write the checkpoint {path}: {problem}. The run stopped; the checkpoints "
                f"written before are intact: free space, then continue with resume=true in the same "
                f"run folder."
            ) from err
        finally:
            tmp.unlink(missing_ok=True)


class RunConfigCallback(pl.Callback):
    """Adds the resolved run config (plain dicts and lists), the version and the run's id to every
    checkpoint."""

    def __init__(self, config: dict[str, Any], run_id: str | None = None) -> None:
        self.config, self.run_id = config, run_id

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config
        checkpoint[VERSION_KEY] = __version__
        if self.run_id is not None:
            checkpoint[RUN_ID_KEY] = self.run_id


class RandomStateCallback(pl.Callback):
    """Saves the random state with every checkpoint; restores it when the resumed fit starts its
    first epoch.

    Checkpoints are written at the end of an epoch, and nothing between that point and the next
    `on_train_epoch_start` draws random numbers (the training loader's order and worker seeds
    come from their own generators, see `dbsn.data.base.in_memory_loader`), so single-process
    resume reproduces the uninterrupted run bit for bit on the same hardware. Under DDP only
    rank 0's state is saved and every rank restores it: structure-parallel ranks share one
    stream anyway (resume as exact as on one device); data-parallel ranks then re-derive their
    own streams from it (reproducible, not identical to the uninterrupted run)."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # tensors and plain Python values only: Lightning resumes with torch.load(weights_only=True)
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
            "python": random.getstate(),
        }
        if torch.cuda.is_available():
            state["torch.cuda"] = torch.cuda.get_rng_state_all()
            state["torch.cuda.current"] = torch.cuda.get_rng_state()  # the device this rank trains on
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        torch.set_rng_state(state["torch"])
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        cuda = state.get("torch.cuda", [])
        if torch.cuda.is_available() and trainer.world_size > 1 and "torch.cuda.current" in state:
            # rank 0 saved the state of the device it trained on; every rank continues it on its own
            torch.cuda.set_rng_state(state["torch.cuda.current"])
        elif torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():  # else keep the current ones
            torch.cuda.set_rng_state_all(cuda)
        if trainer.world_size > 1 and getattr(pl_module, "parallel", "data") == "data":
            # rank 0's state was saved; give every data-parallel rank its own stream
            seed = int(torch.randint(2**62, ())) + 104729 * trainer.global_rank
            torch.manual_seed(seed % 2**63)


#: `_target_` prefixes of classes that moved; checkpoints written before keep loading
MOVED_TARGETS = {
    "dbsn.schedules.": "dbsn.structure.schedules.",
    "dbsn.tracking.": "dbsn.evaluation.tracking.",
    "dbsn.calibration.": "dbsn.methods.temperature.",
    "dbsn.posthoc.temperature.": "dbsn.methods.temperature.",
    "dbsn.ensemble.": "dbsn.methods.predictive.",
}


#: a method's flat settings that now travel together, by the object that holds them
PREDICTION_KEYS = ("n_samples", "val_samples", "samples_per_forward", "temperature_scaling")
EXECUTION_KEYS = ("channels_last", "compile")


def _grouped_settings(node: dict) -> dict:
    """A method node written before its settings were grouped: `n_samples`, `val_samples`,
    `samples_per_forward`, `temperature_scaling` into `prediction`, `channels_last` and
    `compile` into `execution`; VOGN's `num_samples` (draws per step) renamed `draws_per_step`."""
    target = str(node.get("_target_", ""))
    if not target.startswith("dbsn.methods.") or target.endswith(("DeepEnsemble", "Prediction", "Execution")):
        return node
    node = dict(node)
    prediction = {k: node.pop(k) for k in PREDICTION_KEYS if k in node}
    execution = {k: node.pop(k) for k in EXECUTION_KEYS if k in node}
    if prediction and "prediction" not in node:
        node["prediction"] = {"_target_": "dbsn.methods.Prediction", **prediction}
    if execution and "execution" not in node:
        node["execution"] = {"_target_": "dbsn.methods.Execution", **execution}
    vogn = node.get("vogn")
    if isinstance(vogn, dict) and "num_samples" in vogn:
        node["vogn"] = {("draws_per_step" if k == "num_samples" else k): v for k, v in vogn.items()}
    return node


#: networks of cells, whose `cell` choice (fused or per_edge) came after the per-edge cell
CELL_NETWORKS = ("dbsn.nets.StructureNet", "dbsn.nets.DBSNSegNet")


def _cell_choices(node: Any) -> list[str]:
    """The `cell` of every network of cells in a config, in order."""
    if isinstance(node, dict):
        own = [str(node.get("cell", "fused"))] if node.get("_target_") in CELL_NETWORKS else []
        return own + [c for value in node.values() for c in _cell_choices(value)]
    if isinstance(node, list):
        return [c for item in node for c in _cell_choices(item)]
    return []


def upgrade_config(node: Any) -> Any:
    """A run config written by an earlier version, in today's form: every `_target_` of a moved
    class renamed (`MOVED_TARGETS`), a method's settings grouped (`_grouped_settings`), a network of
    cells written before the fused cell given the per-edge cell it ran with."""
    if isinstance(node, dict):
        out = {key: upgrade_config(value) for key, value in node.items()}
        target = out.get("_target_")
        if isinstance(target, str):
            for old, new in MOVED_TARGETS.items():
                if target.startswith(old) and not target.startswith(new):
                    out["_target_"] = new + target[len(old) :]
                    break
            out = _grouped_settings(out)
            if out["_target_"] in CELL_NETWORKS:
                out.setdefault("cell", "per_edge")
        return out
    if isinstance(node, list):
        return [upgrade_config(item) for item in node]
    return node


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by `train.py`, or raise `CheckpointError` saying why not: its
    container and tensors are checked against what its writer recorded (`dbsn.runtime.integrity`)."""
    path = Path(path).expanduser()
    checkpoint = read_checkpoint(path)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path} is a PyTorch file but not a Lightning checkpoint (no 'state_dict').")
    if CONFIG_KEY not in checkpoint:
        raise CheckpointError(
            f"{path} is a Lightning checkpoint that dbsn's train.py did not write: it carries no "
            f"'{CONFIG_KEY}' (the run config needed to rebuild data and model)."
        )
    checkpoint[CONFIG_KEY] = upgrade_config(checkpoint[CONFIG_KEY])
    note = version_note(path, checkpoint)
    if note is not None and DIGEST_KEY in checkpoint and str(path) not in _VERSION_SAID:  # else integrity said it
        _VERSION_SAID.add(str(path))
        print(note, file=sys.stderr, flush=True)
    return checkpoint


_VERSION_SAID: set[str] = set()


def version_note(path: str | os.PathLike, checkpoint: dict[str, Any]) -> str | None:
    """The one Note line for a checkpoint written by another version of dbsn (or by one that did not
    record its version), None when this version wrote it. Such a checkpoint still loads: its config
    is upgraded (`upgrade_config`) and its weights are the same modules'."""
    version = checkpoint.get(VERSION_KEY)
    if version == __version__:
        return None
    writer = f"dbsn {version}" if version else "a version of dbsn that did not record its version"
    return f"Note: {path} was written by {writer}; this is dbsn {__version__}."


def check_resume_checkpoint(path: str | os.PathLike, config: dict[str, Any]) -> Path:
    """Check, before data or model are built, that `path` is a checkpoint this run can resume:
    readable, written by train.py, and of the same method on the same data as `config`."""
    checkpoint = load_checkpoint(path)
    saved = checkpoint[CONFIG_KEY]
    for section in ("model", "data"):
        theirs = (saved.get(section) or {}).get("_target_")
        ours = (config.get(section) or {}).get("_target_")
        if theirs != ours:
            raise CheckpointError(
                f"ckpt_path={path} is a {section} {theirs} checkpoint, but this run's {section} is {ours}: "
                f"resume with the run's own config (its {section}= choice), or use init_from= to start a new "
                "run from its weights."
            )
    theirs, ours = _cell_choices(saved.get("model")), _cell_choices(config.get("model"))
    if theirs and len(theirs) == len(ours) and theirs != ours:
        raise CheckpointError(
            f"ckpt_path={path} trained with model.net.cell={theirs[0]}, and this run asks for {ours[0]}: the two cells "
            f"compute the same function, but the optimiser's state belongs to one layout. Resume with "
            f"model.net.cell={theirs[0]} (evaluate.py and init_from= load either)."
        )
    return Path(path)
