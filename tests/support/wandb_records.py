"""Read the records of an offline W&B run (`run-<id>.wandb`) without a server.

The file is a LevelDB-style log (7-byte file header, 32 KiB blocks, chunks of
crc32 | length | type) of `wandb_internal_pb2.Record` protobufs; newer wandb clients keep
the summary only there until `wandb sync`, so tests read it directly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, LAST = 1, 4


def read_records(path: Path) -> list:
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(raw):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer too small for a chunk header
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + HEADER])
        pos += HEADER
        pending += raw[pos : pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def logged_values(path: Path) -> dict[str, object]:
    """Last value of every history key ('a/b' for nested keys)."""
    values = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                values[key] = json.loads(item.value_json)
    return values


def config_keys(path: Path) -> set[str]:
    return {
        item.key or "/".join(item.nested_key)
        for record in read_records(path)
        if record.WhichOneof("record_type") == "config"
        for item in record.config.update
    }


def history(path: Path) -> list[dict[str, object]]:
    """Every history row of the run, in order ('a/b' for nested keys)."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def run_record(path: Path):
    """The run's own record: id, group, job type, name."""
    return next(r.run for r in read_records(path) if r.WhichOneof("record_type") == "run")


def config(path: Path) -> dict[str, object]:
    """The run's config, each key's last value."""
    return {
        item.key or "/".join(item.nested_key): json.loads(item.value_json)
        for record in read_records(path)
        if record.WhichOneof("record_type") == "config"
        for item in record.config.update
    }


def metric_definitions(path: Path) -> dict[str, object]:
    """`define_metric` records by metric name (or glob)."""
    return {
        (r.metric.name or r.metric.glob_name): r.metric
        for r in read_records(path)
        if r.WhichOneof("record_type") == "metric"
    }


def summary(path: Path) -> dict[str, object]:
    """The run's summary as W&B keeps it: each key's last value ('a/b' for nested keys)."""
    values = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values


def table(path: Path, key: str) -> dict:
    """A table the run logged under `key` (columns, data), read from the run's files."""
    relative = logged_values(path)[f"{key}/path"]
    return json.loads((Path(path).parent / "files" / relative).read_text())
