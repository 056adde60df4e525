"""A checkpoint's integrity: the digest its writer records, and the checks every reader makes.

A checkpoint can be damaged after it was written (a bad copy, a failing disk, a partial
download) in ways that `torch.load` does not notice: a flipped byte inside a tensor's storage
loads as a different number, and the model predicts garbage without a word. So:

- the writer (`dbsn.runtime.checkpoint.AtomicCheckpointIO`) records, inside the same atomic
  write, `checkpoint[DIGEST_KEY] = {"algorithm": "sha256", "tensors": <hex>}`: the SHA-256 of
  every tensor of the checkpoint (model, optimisers, callbacks), each with where it sits in
  the checkpoint, its dtype and shape, and its raw bytes (bf16 too), in the checkpoint's own
  order (`checkpoint_digest`);
- a reader (`read_checkpoint`) first checks the zip container's CRC-32 of every entry (which
  `torch.save` writes and `torch.load` ignores: it covers the pickled part, e.g. a learning rate
  or a config value, that holds no tensor), then loads the file and recomputes the digest. Any
  mismatch is a `CheckpointError` that names the file and says what to do.

A checkpoint without a digest (written by an earlier version) loads as before; `read_checkpoint`
says once which version wrote it. `dbsn.runtime.checkpoint.load_checkpoint` reads through it; the
post-hoc posteriors are handed checkpoints loaded that way.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from dbsn.evaluation.identity import DIGEST_KEY

__all__ = [
    "DIGEST_KEY",
    "CheckpointError",
    "checkpoint_digest",
    "container_damage",
    "digest_problem",
    "read_checkpoint",
    "with_digest",
]

ALGORITHM = "sha256"
#: where the writer's version is recorded (`dbsn.runtime.checkpoint.VERSION_KEY`)
VERSION_KEY = "dbsn_version"
#: the advice every refusal of a damaged file ends with
DAMAGED_ADVICE = (
    "copy it again from where it was written, or use another checkpoint of the run (checkpoints/epoch*.ckpt)"
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the fix in the message."""


# ---------------------------------------------------------------------- the digest
def _raw_bytes(tensor: torch.Tensor) -> list[memoryview]:
    """The tensor's elements as bytes, in row-major order (whatever its strides or device)."""
    tensor = tensor.detach()
    if tensor.is_sparse:
        tensor = tensor.coalesce()
        return _raw_bytes(tensor.indices()) + _raw_bytes(tensor.values())
    if tensor.is_quantized:
        return _raw_bytes(tensor.int_repr())
    if tensor.is_meta:
        return []  # no data: its path, dtype and shape are hashed
    tensor = tensor.resolve_conj().resolve_neg().to("cpu").contiguous()
    return [memoryview(tensor.reshape(-1).view(torch.uint8).numpy())]


def _key(key: Any) -> str:
    return key if isinstance(key, str) else f"{type(key).__name__}:{key!r}"


def _tensors(node: Any, path: str):
    """(path, tensor) of every tensor inside dicts, lists and tuples, in the container's order
    (a dict's insertion order, which pickling keeps)."""
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _tensors(value, f"{path}/{_key(key)}")
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _tensors(value, f"{path}/{index}")


def checkpoint_digest(checkpoint: dict[str, Any]) -> str:
    """SHA-256 (hex) of every tensor of `checkpoint` but the digest's own entry: for each, in the
    checkpoint's order, its path of keys, dtype and shape, then its raw bytes."""
    digest = hashlib.sha256()
    for key, value in checkpoint.items():
        if key == DIGEST_KEY:
            continue
        for path, tensor in _tensors(value, _key(key)):
            digest.update(f"{path}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
            for chunk in _raw_bytes(tensor):
                digest.update(chunk)
    return digest.hexdigest()


def with_digest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint` (a shallow copy) with its digest recorded under `DIGEST_KEY`."""
    return {
        **{k: v for k, v in checkpoint.items() if k != DIGEST_KEY},
        DIGEST_KEY: {"algorithm": ALGORITHM, "tensors": checkpoint_digest(checkpoint)},
    }


def digest_problem(checkpoint: dict[str, Any]) -> str | None:
    """What is wrong with the recorded digest of a loaded checkpoint (None: it matches, or none
    was recorded)."""
    recorded = checkpoint.get(DIGEST_KEY)
    if recorded is None:
        return None
    if (
        not isinstance(recorded, dict)
        or recorded.get("algorithm") != ALGORITHM
        or not isinstance(recorded.get("tensors"), str)
    ):
        return f"its recorded digest is unreadable ({recorded!r:.80})"
    found = checkpoint_digest(checkpoint)
    if found != recorded["tensors"]:
        return "its tensors do not match the digest (sha256) its writer recorded"
    return None


# ---------------------------------------------------------------------- the container
def container_damage(path: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint's zip container (`torch.save`'s format): an entry whose
    bytes fail the CRC-32 its writer recorded, or a file that is not a whole zip (truncated).
    None: every entry is intact, or the file is not a zip (PyTorch's legacy format, unchecked).
    Entries written without a CRC (`torch.serialization.set_crc32_options(False)`) are not checked."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return None  # not a zip: the legacy format, or not a checkpoint at all (torch.load says)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        return f"it is not a whole zip file ({err}): truncated or overwritten"
    with archive, open(path, "rb") as raw:
        for info in archive.infolist():
            if info.CRC == 0 and info.file_size > 0:
                continue  # written without a CRC
            try:
                crc = (
                    _stored_crc(raw, info) if info.compress_type == zipfile.ZIP_STORED else _inflated_crc(archive, info)
                )
            except (zipfile.BadZipFile, OSError, ValueError, zlib.error, EOFError) as err:
                return f"its entry {info.filename} cannot be read ({err}): truncated or overwritten"
            if crc != info.CRC:
                return f"its entry {info.filename} fails its CRC-32 check (the bytes changed after it was written)"
    return None


def _stored_crc(raw, info: zipfile.ZipInfo, chunk: int = 1 << 24) -> int:
    """CRC-32 of an uncompressed entry, read straight from the file (torch.save stores entries)."""
    raw.seek(info.header_offset)
    header = raw.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    raw.seek(info.header_offset + 30 + name_length + extra_length)
    crc, left = 0, info.compress_size
    while left > 0:
        data = raw.read(min(chunk, left))
        if not data:
            raise EOFError("the entry ends early")
        crc, left = zlib.crc32(data, crc), left - len(data)
    return crc


def _inflated_crc(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """CRC-32 of a compressed entry's content (zipfile checks it when the entry ends: a mismatch
    raises BadZipFile)."""
    crc = 0
    with archive.open(info) as entry:
        while data := entry.read(1 << 24):
            crc = zlib.crc32(data, crc)
    return crc


# ---------------------------------------------------------------------- reading
_UNCHECKED_SAID: set[str] = set()


def read_checkpoint(path: str | os.PathLike) -> Any:
    """`torch.load(path)` on the CPU after its container's CRCs are checked, then its digest: a
    damaged, truncated or unreadable file is a `CheckpointError` naming the file and what to do.
    A checkpoint without a digest loads, with one line (once per file) on which version wrote it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint not found: {path}. train.py writes checkpoints to <run dir>/checkpoints/ "
            "(last.ckpt is the most recent)."
        )
    damage = container_damage(path)
    if damage is not None:
        raise CheckpointError(f"Checkpoint {path} is corrupt: {damage}. Do not use it: {DAMAGED_ADVICE}.")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for a bad file; all mean the same here
        raise CheckpointError(
            f"Could not read checkpoint {path} ({type(err).__name__}: {err}). The file is corrupt, truncated or not a "
            f"PyTorch checkpoint: {DAMAGED_ADVICE}; train.py writes its checkpoints atomically."
        ) from err
    if not isinstance(checkpoint, dict):
        return checkpoint
    problem = digest_problem(checkpoint)
    if problem is not None:
        raise CheckpointError(f"Checkpoint {path} is corrupt: {problem}. Do not use it: {DAMAGED_ADVICE}.")
    if DIGEST_KEY not in checkpoint and str(path) not in _UNCHECKED_SAID:
        _UNCHECKED_SAID.add(str(path))
        version = checkpoint.get(VERSION_KEY)
        writer = f"dbsn {version}" if version else "a version of dbsn that did not record its version"
        print(
            f"Note: {path} was written by {writer}, before checkpoints carried a digest of their tensors: "
            "loaded without checking its content.",
            file=sys.stderr,
            flush=True,
        )
    return checkpoint
