"""CIFAR-10 and CIFAR-100 (Krizhevsky, 2009): 50,000 training and 10,000 test images, 32x32 RGB.

Read from the "python version" archives exactly as torchvision unpacks them:
``<root>/cifar-10-batches-py/{data_batch_1..5, test_batch}`` and
``<root>/cifar-100-python/{train, test}``. Each file is a pickled dict with ``b'data'``, a
uint8 (N, 3072) array holding the red, green and blue 32x32 planes of each image in turn, and
the labels as a list (``b'labels'`` for CIFAR-10, ``b'fine_labels'`` for CIFAR-100).
"""

import pickle
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from dbsn.data.base import CorruptDatasetError, ImageClassificationDataModule, check_arrays

# A CIFAR pickle holds numpy arrays, lists, ints and bytes, nothing else; refusing every other
# global keeps a tampered file from running code when it is unpickled.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("__builtin__", "bytes"),
    ("builtins", "bytes"),
}


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR file")
        return super().find_class(module, name)


def read_cifar_file(path: Path, label_key: str, num_classes: int) -> tuple[Tensor, Tensor]:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,) from one CIFAR pickle.

    Loaded with ``encoding='bytes'`` as the files were written by Python 2; keys are compared
    as text so that files written either way are read.
    """
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as error:
        raise CorruptDatasetError(
            f"{path}: cannot be unpickled ({type(error).__name__}: {error}); "
            "the file is corrupt or incomplete, delete it and get it again"
        ) from error
    if not isinstance(entry, dict):
        raise CorruptDatasetError(f"{path}: expected a pickled dict, found {type(entry).__name__}")
    entry = {key.decode("latin1") if isinstance(key, bytes) else key: value for key, value in entry.items()}
    for key in ("data", label_key):
        if key not in entry:
            raise CorruptDatasetError(f"{path}: no {key!r} entry (found {sorted(entry)})")
    data = np.asarray(entry["data"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise CorruptDatasetError(f"{path}: 'data' should be (N, 3072), got {data.shape}")
    images = data.reshape(-1, 3, 32, 32)
    labels = np.asarray(entry[label_key], dtype=np.int64)
    check_arrays(path, images, labels, num_classes)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels)


def read_cifar_files(paths: list[Path], label_key: str, num_classes: int) -> tuple[Tensor, Tensor]:
    """Read and concatenate several CIFAR pickles (the five CIFAR-10 training batches)."""
    parts = [read_cifar_file(path, label_key, num_classes) for path in paths]
    return torch.cat([images for images, _ in parts]), torch.cat([labels for _, labels in parts])


class CIFAR10DataModule(ImageClassificationDataModule):
    """CIFAR-10: 10 classes; normalisation statistics of the training set (as the DBSN code)."""

    name = "CIFAR-10"
    num_classes = 10
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)
    url: ClassVar[str] = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    folder: ClassVar[str] = "cifar-10-batches-py"
    train_files: ClassVar[tuple[str, ...]] = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_files: ClassVar[tuple[str, ...]] = ("test_batch",)
    label_key: ClassVar[str] = "labels"
    torchvision_class: ClassVar[str] = "CIFAR10"

    def required_files(self) -> list[Path]:
        return [self.root / self.folder / name for name in self.train_files + self.test_files]

    def download_hint(self) -> str:
        return f"download {self.url} and extract it in {self.root} (it unpacks to {self.folder}/)"

    def download_files(self) -> None:
        import torchvision

        dataset_class = getattr(torchvision.datasets, self.torchvision_class)
        for train in (True, False):
            dataset_class(str(self.root), train=train, download=True)

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        names = self.train_files if train else self.test_files
        paths = [self.root / self.folder / name for name in names]
        return read_cifar_files(paths, self.label_key, self.num_classes)


class CIFAR100DataModule(CIFAR10DataModule):
    """CIFAR-100: the 100 fine classes; normalisation statistics of the training set."""

    name = "CIFAR-100"
    num_classes = 100
    mean = (0.5071, 0.4867, 0.4408)
    std = (0.2675, 0.2565, 0.2761)
    url = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
    folder = "cifar-100-python"
    train_files = ("train",)
    test_files = ("test",)
    label_key = "fine_labels"
    torchvision_class = "CIFAR100"
