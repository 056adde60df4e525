"""SVHN's .mat files (dbsn.data.svhn): the digit 0, stored as label 10, reads as 0."""

import numpy as np
import scipy.io
import torch

from dbsn.data import SVHNDataModule
from tests.support.fakedata import write_svhn


def test_svhn_maps_label_10_to_0(tmp_path):
    write_svhn(tmp_path, n_train=40, n_test=20)
    on_disk = scipy.io.loadmat(tmp_path / "test_32x32.mat")["y"].ravel()
    assert set(on_disk) == set(range(1, 11))
    dm = SVHNDataModule(root=str(tmp_path))
    dm.setup("test")
    expected = np.where(on_disk == 10, 0, on_disk).astype(np.int64)
    assert torch.equal(dm.test_set.labels, torch.from_numpy(expected))
