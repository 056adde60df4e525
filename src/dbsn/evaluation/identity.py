"""Which run a run folder's files belong to, and which checkpoint an evaluation evaluated.

A training run names itself in every file that belongs to it (`dbsn.evaluation.runs`): run.json's
`run_id` is metrics.json's `run_id` and every checkpoint's `dbsn_run_id`, and run.json's
`config_sha256` is the sha256 of resolved_config.yaml's bytes. `disagreement` says where a run
folder's files disagree (a run folder without run.json, written before runs named themselves, is
not checked). An evaluation records the identity of each checkpoint it evaluated
(`checkpoint_identity`: the run id, epoch, global step and tensor digest), so that a folder an
evaluation wrote says which checkpoint its numbers are of (`same_checkpoint`).

Checkpoints are read here with `torch.load(mmap=True)`: their tensors stay on disk, so naming a
checkpoint costs its metadata, not its size.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dbsn.evaluation.runs import CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE, RUN_ID_KEY, read_run_record

__all__ = [
    "DIGEST_KEY",
    "checkpoint_identity",
    "describe_checkpoint",
    "disagreement",
    "examine",
    "file_sha256",
    "read_checkpoint",
    "read_json",
    "same_checkpoint",
    "stored_digest",
]

#: the tensor digest its writer stores in a checkpoint: {"algorithm": "sha256", "tensors": <hex>}
DIGEST_KEY = "dbsn_digest"


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (run.json's `config_sha256` of resolved_config.yaml)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None where it is missing or not a JSON object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """A checkpoint with its tensors memory-mapped (not read), or None where it cannot be read."""
    import torch

    try:
        checkpoint = torch.load(Path(path), map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 - torch raises many types for a bad file; the caller says what it needs
        return None
    return checkpoint if isinstance(checkpoint, dict) else None


def stored_digest(checkpoint: dict) -> dict | None:
    """The tensor digest its writer recorded in `checkpoint` (`DIGEST_KEY`), or None."""
    found = checkpoint.get(DIGEST_KEY)
    if isinstance(found, dict) and isinstance(found.get("tensors"), str):
        return {"algorithm": str(found.get("algorithm", "sha256")), "tensors": found["tensors"]}
    return None


def checkpoint_identity(path: Path, checkpoint: dict, digest: dict | None = None) -> dict:
    """What names the checkpoint at `path`: its run id (None for a checkpoint written before runs
    named themselves), epoch, global step, and tensor digest (`digest`, else the one stored in it)."""
    return {
        "path": str(Path(path).absolute()),
        "run_id": checkpoint.get(RUN_ID_KEY),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "digest": digest if digest is not None else stored_digest(checkpoint),
    }


def same_checkpoint(a: dict, b: dict) -> bool:
    """Whether two identities (`checkpoint_identity`) name the same checkpoint: by their tensor
    digests where both have one of the same algorithm, else by run id, epoch and global step
    (by path, epoch and step for checkpoints that name no run)."""
    da, db = a.get("digest") or {}, b.get("digest") or {}
    if da.get("tensors") and db.get("tensors") and da.get("algorithm") == db.get("algorithm"):
        return da["tensors"] == db["tensors"]
    step = (a.get("epoch"), a.get("global_step")) == (b.get("epoch"), b.get("global_step"))
    if a.get("run_id") or b.get("run_id"):
        return step and a.get("run_id") == b.get("run_id")
    return step and _resolved(a.get("path")) == _resolved(b.get("path"))


def _resolved(path) -> str | None:
    return None if path is None else str(Path(path).resolve())


def describe_checkpoint(identity: dict) -> str:
    """`<path> (run 1a2b3c4d, epoch 3, step 120)`: a checkpoint as a refusal names it."""
    facts = [f"run {identity['run_id'][:8]}" if identity.get("run_id") else "no run id"]
    facts += [
        f"{key} {identity[name]}"
        for key, name in (("epoch", "epoch"), ("step", "global_step"))
        if identity.get(name) is not None
    ]
    return f"{identity.get('path')} ({', '.join(facts)})"


def _run_record_of(run_dir: Path) -> tuple[dict | None, Path]:
    """The run.json that speaks for `run_dir`: its own, or for a post-hoc posterior's folder
    (`<run>/posthoc/<name>/`) the training run's."""
    if Path(run_dir).parent.name == "posthoc":
        return read_run_record(Path(run_dir).parent.parent), Path(run_dir).parent.parent
    return read_run_record(run_dir), Path(run_dir)


def _checkpoints(run_dir: Path) -> list[dict]:
    """The identity of every readable checkpoint in `<run_dir>/checkpoints` (an unreadable one is
    named by evaluate when it is used; it is no evidence of another run)."""
    found = []
    for path in sorted((Path(run_dir) / CHECKPOINT_DIR).glob("*.ckpt")):
        checkpoint = read_checkpoint(path)
        if checkpoint is not None:
            found.append(checkpoint_identity(path, checkpoint))
    return found


def examine(run_dir: Path, evaluation: bool = True) -> tuple[str | None, str | None]:
    """(`disagreement`, `stale`) of the run in `run_dir`, in words, each None where there is none:

    - disagreement: where its files disagree about which run they belong to: the config's digest,
      metrics.json's run id, each checkpoint's run id, and the run id of the evaluation in
      `evaluation/` (a post-hoc posterior's folder answers for its metrics.json and evaluation,
      against its training run's run.json);
    - stale: its `evaluation/` (a post-hoc posterior's folder: its evaluation) evaluated a
      checkpoint of the run that is no longer among its checkpoints (the run continued after it
      was evaluated).

    `evaluation`: False leaves `evaluation/` out of both. A folder without run.json (written before
    runs named themselves) is not checked, and a run that adopted such a folder (`resume=true`
    there; run.json's first event is "adopted") accepts its earlier files that name no run."""
    run_dir = Path(run_dir)
    record, owner = _run_record_of(run_dir)
    if record is None:
        return None, None
    run_id = record["run_id"]
    # a run that continued a folder written before runs named themselves: its earlier files name no run
    adopted = any(isinstance(e, dict) and e.get("event") == "adopted" for e in record.get("history") or [])
    checkpoints = _checkpoints(owner)
    if owner == run_dir:
        config = run_dir / CONFIG_FILE
        if record.get("config_sha256") and config.is_file() and file_sha256(config) != record["config_sha256"]:
            return (
                f"{CONFIG_FILE} is not the config run {run_id[:8]} recorded (its sha256 differs from run.json's "
                "config_sha256): it was replaced or edited"
            ), None
        for identity in checkpoints:
            theirs = identity.get("run_id")
            if theirs != run_id and not (theirs is None and adopted):
                return (
                    f"{CHECKPOINT_DIR}/{Path(identity['path']).name} "
                    + (f"belongs to run {str(theirs)[:8]}" if theirs else "names no run")
                    + f", not to this folder's run {run_id[:8]} (run.json)"
                ), None
    evaluated_here = read_json(run_dir / "evaluation" / METRICS_FILE) if evaluation else None
    for name, found in (
        (METRICS_FILE, read_json(run_dir / METRICS_FILE)),
        (f"evaluation/{METRICS_FILE}", evaluated_here),
    ):
        if found is None or (name != METRICS_FILE and "run_id" not in found):
            continue  # none, or an evaluation written before evaluations named their checkpoint's run
        if found.get("run_id") != run_id and not (found.get("run_id") is None and adopted):
            theirs = found.get("run_id")
            return (
                f"{name} "
                + (f"is of run {str(theirs)[:8]}" if theirs else "names no run")
                + f", not of this folder's run {run_id[:8]} (run.json)"
            ), None
    made = (
        evaluated_here if owner == run_dir else read_json(run_dir / METRICS_FILE)
    )  # a post-hoc run's: its evaluation's
    evaluated = [i for i in (made or {}).get("evaluated") or [] if isinstance(i, dict)]
    if (
        len(evaluated) == 1
        and checkpoints
        and not any(same_checkpoint(evaluated[0], identity) for identity in checkpoints)
    ):
        where = "evaluation/" if owner == run_dir else "evaluation"
        return None, (
            f"its {where} is of {describe_checkpoint(evaluated[0])}, which is no longer among the run's "
            "checkpoints (the run went on after it was evaluated): its evaluations describe that earlier "
            "model; evaluate the run's last checkpoint again (evaluate.py says how to keep the old one)"
        )
    return None, None


def disagreement(run_dir: Path, evaluation: bool = True) -> str | None:
    """Where the files of the run in `run_dir` disagree about which run they belong to (`examine`)."""
    return examine(run_dir, evaluation)[0]
