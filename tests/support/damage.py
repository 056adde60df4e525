"""Damage a checkpoint the way a bad copy or a failing disk would, for the fault-injection tests.

`torch.save` writes a zip of stored (uncompressed) entries: `<archive>/data.pkl`, the pickled
structure, and `<archive>/data/<key>`, one per tensor storage, each with the CRC-32 its writer
computed (which `torch.load` does not check). These helpers find where a tensor's bytes or a value
of the pickle lie in the file, flip one byte there, and can make the zip's CRC agree with the
damage, so that only a check of the content itself can tell.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

import torch


def entry_span(path: Path, name: str) -> tuple[int, int]:
    """(offset in the file, size) of the bytes of the zip entry `name`."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    data = Path(path).read_bytes()
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    return info.header_offset + 30 + name_length + extra_length, info.file_size


def storage_entry(path: Path, tensor: torch.Tensor) -> str:
    """The zip entry that holds `tensor`'s storage (a whole, contiguous storage: found by content)."""
    content = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        found = [
            i.filename for i in archive.infolist() if "/data/" in i.filename and archive.read(i.filename) == content
        ]
    assert len(found) == 1, f"{len(found)} storages hold that tensor"
    return found[0]


def pickle_entry(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        return next(i.filename for i in archive.infolist() if i.filename.endswith("/data.pkl"))


def flip_byte(path: Path, offset: int, out: Path, agreeing_crc: bool = False) -> Path:
    """A copy of `path` at `out` with the byte at `offset` inverted; with `agreeing_crc`, the CRC-32 of
    the entry holding it (in its local header and in the central directory) recomputed to match."""
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0xFF
    if agreeing_crc:
        with zipfile.ZipFile(path) as archive:
            infos, directory = archive.infolist(), archive.start_dir
        for info in infos:
            start, size = entry_span(path, info.filename)
            if start <= offset < start + size:
                crc = struct.pack("<I", zlib.crc32(bytes(data[start : start + size])))
                data[info.header_offset + 14 : info.header_offset + 18] = crc
                position = directory
                while data[position : position + 4] == b"PK\x01\x02":
                    lengths = struct.unpack("<HHH", data[position + 28 : position + 34])
                    if bytes(data[position + 46 : position + 46 + lengths[0]]).decode() == info.filename:
                        data[position + 16 : position + 20] = crc
                    position += 46 + sum(lengths)
    Path(out).write_bytes(bytes(data))
    return Path(out)
