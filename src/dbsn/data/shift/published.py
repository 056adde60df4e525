"""The published layout of CIFAR-10-C and CIFAR-100-C, and the reader of files in it.

The published files (`corrupted_split` reads them): one folder, ``CIFAR-10-C/`` or
``CIFAR-100-C/``, holding ``<corruption>.npy``, uint8 (50000, 32, 32, 3) HWC RGB, whose rows
``(s-1)*10000 .. s*10000-1`` are the 10,000 test images at severity s in the test set's order,
and ``labels.npy``, the test labels repeated five times. Distributed by Zenodo only (2.9 GB
each; see `PUBLISHED`).

A generated stand-in (`dbsn.data.shift.generate`) is written in the same layout plus a `MARKER`
file, so that every result computed from it can say it came from generated data
(`is_generated`); this reader reads both.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dbsn.data.base import CorruptDatasetError, DatasetNotFoundError

#: The 15 corruptions of the benchmark, in the paper's order (the file names).
CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog",
    "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)  # fmt: skip
#: The four extra corruptions, held out in the paper for validation.
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
ALL_CORRUPTIONS = CORRUPTIONS + EXTRA_CORRUPTIONS
SEVERITIES = (1, 2, 3, 4, 5)

#: The file in a generated folder that marks it as generated (absent from the published ones).
MARKER = "GENERATED.json"

IMAGE_SIZE = 32


@dataclass(frozen=True)
class PublishedSet:
    """Where one published corrupted set comes from."""

    folder: str
    record: str  # Zenodo record

    @property
    def archive(self) -> str:
        return f"{self.folder}.tar"

    @property
    def url(self) -> str:
        return f"https://zenodo.org/records/{self.record}/files/{self.archive}"

    def how_to_get(self, root: str | Path = "<data root>") -> str:
        return (
            f"download {self.archive} (about 2.9 GB) from https://zenodo.org/records/{self.record} "
            f"and extract it under {root} (it unpacks to {self.folder}/)"
        )


#: The published sets, by the name `--data` takes.
PUBLISHED = {
    "cifar10": PublishedSet("CIFAR-10-C", "2535967"),
    "cifar100": PublishedSet("CIFAR-100-C", "3555552"),
}


def corrupted_split(folder: str | Path, corruption: str, severity: int) -> tuple[Tensor, Tensor]:
    """uint8 images (n, 3, 32, 32) and int64 labels (n,) of one corruption at one severity.

    `folder` holds the published layout (or a generated one). The file has 5n rows, n per
    severity (n = 10,000 for the published files); only the severity's rows are read (the
    arrays are memory-mapped).
    """
    labels, found = check_corrupted_files(folder, [corruption])
    _check_severity(severity)
    images = found[corruption]
    n = len(images) // len(SEVERITIES)
    rows = slice((severity - 1) * n, severity * n)
    return (
        torch.from_numpy(np.ascontiguousarray(images[rows].transpose(0, 3, 1, 2))),
        torch.from_numpy(labels[rows].astype(np.int64)),
    )


def check_corrupted_files(
    folder: str | Path, corruptions: Sequence[str] = CORRUPTIONS
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Fail before any evaluation if `folder` cannot serve these corruptions; else the
    memory-mapped labels and images by corruption, checked.

    Raises `DatasetNotFoundError` naming every missing file (``labels.npy`` and each
    ``<corruption>.npy``) with how to get them, then `CorruptDatasetError` if a file that is
    there holds the wrong arrays (only the .npy headers are read).
    """
    folder = Path(folder).expanduser().absolute()
    for name in corruptions:
        _check_corruption(name)
    expected = [folder / "labels.npy"] + [folder / f"{name}.npy" for name in dict.fromkeys(corruptions)]
    missing = [path for path in expected if not path.is_file()]
    if missing:
        listing = "\n".join(f"  {path}" for path in missing)
        raise DatasetNotFoundError(
            f"corrupted CIFAR: {len(missing)} file(s) missing in {folder}:\n{listing}\n{_how_to_get(folder)}"
        )
    labels = _label_file(expected[0])
    return labels, {path.stem: _image_file(path, len(labels)) for path in expected[1:]}


def is_generated(folder: str | Path) -> bool:
    """Whether `folder` holds a generated set (it has the `MARKER` file) rather than the published one."""
    return (Path(folder) / MARKER).is_file()


def _how_to_get(folder: Path) -> str:
    if is_generated(folder):
        return (
            "This folder holds a generated set: generate the missing corruptions into it again with "
            "python -m dbsn.data.shift --corruptions ... (frost and spatter cannot be generated; "
            "for them, use the published files)."
        )
    sets = [s for s in PUBLISHED.values() if s.folder == folder.name] or list(PUBLISHED.values())
    ways = "\n".join(f"  - {s.how_to_get(folder.parent)}" for s in sets)
    return (
        f"Get them in one of these ways:\n{ways}\n"
        "  - point the data root at the folder that already holds them\n"
        "  - generate a stand-in, labelled as generated, from the clean test set (no frost, no spatter):\n"
        "    python -m dbsn.data.shift --data cifar10 --root DATA --out FOLDER"
    )


def _load(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as error:
        raise CorruptDatasetError(
            f"{path}: cannot be read as a .npy array ({type(error).__name__}: {error}); "
            "the file is corrupt or incomplete, delete it and get it again"
        ) from error


def _image_file(path: Path, n_rows: int | None = None) -> np.ndarray:
    """The memory-mapped uint8 (5n, 32, 32, 3) array of a corruption file, checked."""
    images = _load(path)
    wrong = images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3)
    return _checked(
        path,
        images,
        f"should be uint8 (5n, 32, 32, 3) HWC, got {images.dtype} {images.shape}" if wrong else None,
        n_rows,
        f"{len(images)} rows but labels.npy has {n_rows}",
    )


def _label_file(path: Path, n_rows: int | None = None) -> np.ndarray:
    """The memory-mapped integer labels (5n,) of ``labels.npy``, checked."""
    labels = _load(path)
    wrong = labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer)
    return _checked(
        path,
        labels,
        f"should be integer labels (5n,), got {labels.dtype} {labels.shape}" if wrong else None,
        n_rows,
        f"{len(labels)} labels for {n_rows} images",
    )


def _checked(path: Path, rows: np.ndarray, problem: str | None, n_rows: int | None, mismatch: str) -> np.ndarray:
    """`rows` if its layout is right (`problem` None) and it holds a positive multiple of the
    severities' rows, `n_rows` of them where given; else the error that names the file."""
    if problem is None and (len(rows) == 0 or len(rows) % len(SEVERITIES)):
        problem = f"{len(rows)} rows is not a positive multiple of the {len(SEVERITIES)} severities"
    elif problem is None and n_rows is not None and len(rows) != n_rows:
        problem = mismatch
    if problem:
        raise CorruptDatasetError(f"{path}: {problem}; the file is corrupt or incomplete, delete it and get it again")
    return rows


def _check_corruption(name: str) -> None:
    if name not in ALL_CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; known: {', '.join(ALL_CORRUPTIONS)}")


def _check_severity(severity: int) -> None:
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
