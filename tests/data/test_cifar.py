"""CIFAR-10/100 files (dbsn.data.cifar): pickles of the wrong shape or with foreign objects are refused.
(Reading, splitting and loading, common to every classification data module: test_base.py.)
"""

import pickle
import types

import numpy as np
import pytest

from dbsn.data import CIFAR10DataModule, CorruptDatasetError
from tests.support.fakedata import write_cifar10


def test_wrong_cifar_shapes_are_rejected(tmp_path):
    write_cifar10(tmp_path, n_train=50, n_test=10)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((10, 1024), np.uint8), b"labels": [0] * 10}, f, protocol=2)
    with pytest.raises(CorruptDatasetError, match=rf"{path}.*\(N, 3072\)"):
        CIFAR10DataModule(root=str(tmp_path)).setup("fit")
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((10, 3072), np.uint8), b"labels": [0] * 9}, f, protocol=2)
    with pytest.raises(CorruptDatasetError, match=str(path)):
        CIFAR10DataModule(root=str(tmp_path)).setup("fit")


def test_pickle_with_foreign_objects_is_refused(tmp_path):
    write_cifar10(tmp_path, n_train=50, n_test=10)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    with open(path, "wb") as f:
        pickle.dump({b"data": types.SimpleNamespace()}, f, protocol=2)
    with pytest.raises(CorruptDatasetError, match="unexpected object types.SimpleNamespace"):
        CIFAR10DataModule(root=str(tmp_path)).setup("test")
