"""`python -m dbsn.data.shift` (dbsn.data.shift.cli): a generated set from the CIFAR test set."""

import json

import numpy as np
import torch

from dbsn.data import shift
from tests.support.fakedata import write_cifar10


def test_command_line_generates_from_the_cifar_test_set(tmp_path):
    from dbsn.data.cifar import CIFAR10DataModule

    root = write_cifar10(tmp_path / "data", n_train=10, n_test=12)
    out = tmp_path / "CIFAR-10-C-generated"
    shift.main(["--data", "cifar10", "--root", str(root), "--out", str(out), "--corruptions", "contrast", "snow"])
    test_images, test_labels = CIFAR10DataModule(root=str(root)).read_split(train=False)
    assert shift.is_generated(out)
    assert sorted(p.name for p in out.glob("*.npy")) == ["contrast.npy", "labels.npy", "snow.npy"]
    images, labels = shift.corrupted_split(out, "contrast", 2)
    assert torch.equal(labels, test_labels)
    assert np.array_equal(images.numpy(), shift.corrupt(test_images, "contrast", 2, np.random.default_rng()))
    assert "CIFAR-10 test set" in json.loads((out / shift.MARKER).read_text())["source"]
