"""SVHN, cropped digits (Netzer et al., 2011): 73,257 training and 26,032 test images, 32x32 RGB.

The paper uses the SVHN test split as out-of-distribution data for CIFAR-10 models. Read from
the MATLAB files as torchvision stores them, ``<root>/train_32x32.mat`` and
``<root>/test_32x32.mat``: ``X`` is uint8 (32, 32, 3, N) and ``y`` (N, 1) holds the digit,
with 10 standing for the digit 0 (mapped to label 0 here, as torchvision does).
"""

from pathlib import Path
from typing import ClassVar

import numpy as np
import scipy.io
import torch
from torch import Tensor

from dbsn.data.base import CorruptDatasetError, ImageClassificationDataModule, check_arrays


def read_svhn_file(path: Path) -> tuple[Tensor, Tensor]:
    """uint8 images (N, 3, 32, 32) and int64 labels 0..9 (N,) from one SVHN .mat file."""
    try:
        mat = scipy.io.loadmat(str(path), variable_names=("X", "y"))
    except Exception as error:
        raise CorruptDatasetError(
            f"{path}: cannot be read as a MATLAB file ({type(error).__name__}: {error}); "
            "the file is corrupt or incomplete, delete it and get it again"
        ) from error
    for key in ("X", "y"):
        if key not in mat:
            raise CorruptDatasetError(f"{path}: no {key!r} variable")
    x, y = mat["X"], mat["y"]
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise CorruptDatasetError(f"{path}: 'X' should be (32, 32, 3, N), got {x.shape}")
    images = x.transpose(3, 2, 0, 1)  # (H, W, C, N) -> (N, C, H, W)
    labels = y.reshape(-1).astype(np.int64)
    labels[labels == 10] = 0
    check_arrays(path, images, labels, num_classes=10)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels)


class SVHNDataModule(ImageClassificationDataModule):
    """SVHN digits 0-9; no horizontal flips by default (mirrored digits are other shapes)."""

    name = "SVHN"
    num_classes = 10
    mean = (0.4377, 0.4438, 0.4728)
    std = (0.1980, 0.2010, 0.1970)
    default_flip = False
    base_url: ClassVar[str] = "http://ufldl.stanford.edu/housenumbers"
    files: ClassVar[dict[bool, str]] = {True: "train_32x32.mat", False: "test_32x32.mat"}

    def required_files(self) -> list[Path]:
        return [self.root / name for name in self.files.values()]

    def download_hint(self) -> str:
        urls = " and ".join(f"{self.base_url}/{name}" for name in self.files.values())
        return f"download {urls} into {self.root}"

    def download_files(self) -> None:
        from torchvision.datasets import SVHN

        for split in ("train", "test"):
            SVHN(str(self.root), split=split, download=True)

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        return read_svhn_file(self.root / self.files[train])
