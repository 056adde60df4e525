"""Where an evaluation may write, and which checkpoint it evaluated.

An evaluation writes into a new (or empty) folder, its own Hydra folder, or a folder it wrote
before for the same checkpoint(s) and the same kind of evaluation (the run's own predictive, or
the same post-hoc posterior); everything else is refused in one line before anything runs
(`check_folder`). "The same checkpoint" is decided by identity, not by path: every evaluation
records in its metrics.json what it evaluated (`identify`: each checkpoint's run id, epoch,
global step and tensor digest; `dbsn.evaluation.identity`). So `<run>/evaluation` after the run
was resumed and wrote a new last.ckpt is refused (it holds the evaluation of an earlier
checkpoint, which the researcher may want to keep), and so is another run's evaluation folder.
The checkpoints' own run folder is checked too (`check_run_files`): a run whose files disagree
about which run they belong to is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dbsn.evaluation.identity import (
    checkpoint_identity,
    describe_checkpoint,
    disagreement,
    read_checkpoint,
    read_json,
    same_checkpoint,
    stored_digest,
)
from dbsn.evaluation.runs import CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE, RUN_FILE
from dbsn.runtime.checkpoint import CheckpointError, load_checkpoint
from dbsn.runtime.config import ConfigError

__all__ = ["check_folder", "check_run_files", "evaluated_digest", "evaluation_folder", "evaluation_record", "identify"]


def evaluated_digest(checkpoint: dict) -> dict:
    """The checkpoint's tensor digest, {"algorithm", "tensors"}: the one its writer stored in it,
    else `dbsn.runtime.checkpoint.checkpoint_digest` where this version has it, else a sha256 of
    its state_dict's tensors (names, dtypes, shapes and bytes) computed here."""
    found = stored_digest(checkpoint)
    if found is not None:
        return found
    try:
        from dbsn.runtime.checkpoint import checkpoint_digest
    except ImportError:
        return {"algorithm": "sha256-state_dict", "tensors": _state_dict_digest(checkpoint.get("state_dict") or {})}
    return {"algorithm": "sha256", "tensors": checkpoint_digest(checkpoint)}


def _state_dict_digest(state: dict) -> str:
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def identify(paths: list[Path]) -> list[dict]:
    """Each checkpoint's identity (`dbsn.evaluation.identity.checkpoint_identity`, with its digest),
    read without loading its tensors; a checkpoint that cannot be read is refused as
    `load_checkpoint` refuses it."""
    identities = []
    for path in paths:
        checkpoint = read_checkpoint(path)
        if checkpoint is None:
            checkpoint = load_checkpoint(path)  # raises CheckpointError saying why (or reads an old format)
        identities.append(checkpoint_identity(path, checkpoint, evaluated_digest(checkpoint)))
    return identities


def evaluation_record(identities: list[dict]) -> dict:
    """What an evaluation's metrics.json records about what it evaluated: `evaluated` (every
    checkpoint's identity), and for one checkpoint, or several of one run, that run's `run_id`
    (None: several runs, or checkpoints that name none) and, for one, its `digest`."""
    run_ids = {i.get("run_id") for i in identities}
    return {
        "run_id": run_ids.pop() if len(run_ids) == 1 else None,
        "evaluated": identities,
        **({"digest": identities[0]["digest"]} if len(identities) == 1 else {}),
    }


def check_run_files(paths: list[Path]) -> None:
    """Refuse a checkpoint whose run folder's files disagree about which run they are
    (`dbsn.evaluation.identity.disagreement`); a checkpoint outside a run folder, or in one
    written before runs named themselves, is not checked."""
    for path in paths:
        run_dir = Path(path).parent.parent
        if Path(path).parent.name != CHECKPOINT_DIR or not (run_dir / RUN_FILE).is_file():
            continue
        reason = disagreement(run_dir, evaluation=False)  # its evaluation folder is `check_folder`'s
        if reason is not None:
            raise CheckpointError(
                f"ckpt_path={path}: the run folder {run_dir} holds files of more than one run: {reason}. "
                "Evaluate a run whose files are all its own (move the other run's file out of the "
                "folder, or train again into a new one)."
            )


def _paths_of(record: dict) -> list[str]:
    return sorted(str(Path(p).resolve()) for p in record.get("checkpoints") or [])


def _same_checkpoints(record: dict, identities: list[dict] | None) -> bool:
    """Whether the evaluation recorded in `record` evaluated the checkpoints `identities` (any
    order); an evaluation that recorded no identities is compared by its checkpoints' paths."""
    if identities is None:
        return True
    theirs = record.get("evaluated")
    if not isinstance(theirs, list):  # written before evaluations named their checkpoints: by path, unchecked
        return _paths_of(record) == sorted(str(Path(i["path"]).resolve()) for i in identities)
    left = list(theirs)
    for identity in identities:
        match = next(
            (i for i, other in enumerate(left) if isinstance(other, dict) and same_checkpoint(identity, other)), None
        )
        if match is None:
            return False
        left.pop(match)
    return not left


def _other_checkpoint(out: Path, record: dict, identities: list[dict], shown: str) -> str:
    """The refusal of a folder that holds the evaluation of other checkpoint(s)."""
    theirs = [i for i in record.get("evaluated") or [] if isinstance(i, dict)]
    found = ", ".join(describe_checkpoint(i) for i in theirs) or ", ".join(record.get("checkpoints") or []) or "?"
    ours = ", ".join(describe_checkpoint(i) for i in identities)
    same_run = (
        len(theirs) == len(identities) == 1
        and theirs[0].get("run_id")
        and theirs[0].get("run_id") == identities[0].get("run_id")
    )
    if same_run:
        epoch = theirs[0].get("epoch")
        keep = out.with_name(f"{out.name}-epoch{epoch}" if epoch is not None else f"{out.name}-old")
        steps = (theirs[0].get("global_step"), identities[0].get("global_step"))
        which = "an earlier" if None not in steps and steps[0] < steps[1] else "another"
        return (
            f"{shown} holds the evaluation of {which} checkpoint of this run, {found}, not of {ours}: "
            f"keep it by moving it (e.g. mv {out} {keep}) or delete it, then evaluate again; or write this "
            f"evaluation elsewhere (output_dir=<a new folder>)."
        )
    return (
        f"{shown} holds the evaluation of another checkpoint, {found}, not of {ours}: an evaluation "
        f"never mixes two models' results in one folder; choose a new folder (output_dir=<a new folder>)."
    )


def check_folder(
    out: Path,
    own: Path | None = None,
    posterior=None,
    identities: list[dict] | None = None,
    where: str | None = "output_dir",
) -> Path:
    """`out`, if this evaluation may write there: this command's own (Hydra) folder, a new or empty
    folder, or one an earlier evaluation of the same kind (the run's own predictive, or the same
    post-hoc posterior) made for the same checkpoints (`identities`; None: not checked): its files
    are replaced. A training run's folder, a folder of other files, and another evaluation's folder
    are refused before anything runs; `where` names the setting that chose the folder (None: the
    default, `<run>/evaluation`)."""
    out = Path(out)
    shown = f"{where}={out}" if where else str(out)
    if own is not None and out.resolve() == Path(own).resolve():
        return out
    if (out / CONFIG_FILE).is_file() or (out / CHECKPOINT_DIR).is_dir():
        raise ConfigError(
            f"{shown} is a training run's folder: an evaluation never writes over a run's "
            f"files; leave output_dir unset (<run>/evaluation) or choose a new folder."
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{shown} is a file: an evaluation writes into a folder; choose a new one.")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    record = read_json(out / METRICS_FILE)
    if record is None or "checkpoints" not in record:
        raise ConfigError(
            f"{shown} holds files that no evaluation wrote: an evaluation never writes over "
            "them; choose a new or empty folder."
        )
    if record.get("posthoc") != (posterior.name if posterior else None):
        found = f"posthoc={record['posthoc']}" if record.get("posthoc") else "the run's own predictive"
        raise ConfigError(
            f"{shown} holds another evaluation's results ({found}): choose a new folder for "
            f"{f'posthoc={posterior.name}' if posterior else 'the run’s own predictive'}."
        )
    if not _same_checkpoints(record, identities):
        raise ConfigError(_other_checkpoint(out, record, identities, shown))
    return out


def evaluation_folder(
    cfg: DictConfig, paths: list[Path], posterior, hydra_dir: Path, identities: list[dict] | None = None
) -> Path:
    """Where one model's results go: `output_dir` when given; for one checkpoint inside a run
    folder, `<run>/evaluation` (with a posterior: `<run>/posthoc/<name>/evaluation`); else this
    command's own folder. Checked by `check_folder` against the checkpoints' `identities`."""
    if cfg.get("output_dir"):
        return check_folder(Path(cfg.output_dir), hydra_dir, posterior, identities)
    run_dir = paths[0].parent.parent
    if len(paths) == 1 and (run_dir / CONFIG_FILE).is_file():
        out = run_dir / "posthoc" / posterior.name / "evaluation" if posterior else run_dir / "evaluation"
        return check_folder(out, posterior=posterior, identities=identities, where=None)
    return check_folder(hydra_dir, hydra_dir, posterior, identities)


def evaluation_settings(cfg: DictConfig, posterior) -> dict:
    """The evaluation's own settings that change its numbers, beside the checkpoint's config:
    `test_tau` and `bn_recalibration` where given, and the post-hoc posterior's config (S itself
    is metrics.json's `n_samples`). The report tells evaluations apart by them."""
    settings = {}
    if cfg.get("test_tau") is not None:
        settings["test_tau"] = float(cfg.test_tau)
    bn = {k: v for k, v in (cfg.get("bn_recalibration") or {}).items() if v is not None}
    if bn:
        settings["bn_recalibration"] = OmegaConf.to_container(OmegaConf.create(bn), resolve=True)
    if posterior is not None and isinstance(cfg.get("posthoc"), DictConfig):
        settings["posthoc"] = OmegaConf.to_container(cfg.posthoc, resolve=True)
    return settings
