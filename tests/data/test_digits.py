"""The embedded digits (dbsn.data.digits): shapes, the fixed test split and the class statistics."""

import torch

from dbsn.data import DigitsDataModule
from tests.support.fakedata import image_keys


def test_digits_shapes_fixed_disjoint_test_split_and_statistics():
    dm = DigitsDataModule(val_size=0.1)
    dm.setup()
    assert dm.num_classes == 10 and dm.train_set.images.shape[1:] == (3, 32, 32)
    assert len(dm.train_set) + len(dm.val_set) == 1347 and len(dm.test_set) == 450
    assert torch.bincount(dm.test_set.labels).tolist() == [45, 46, 44, 46, 45, 46, 45, 45, 43, 45]
    assert torch.equal(dm.test_set.images[:, 0], dm.test_set.images[:, 2])  # grey in 3 channels
    test = image_keys(dm.test_set.images)
    assert not test & (image_keys(dm.train_set.images) | image_keys(dm.val_set.images))
    other = DigitsDataModule(val_size=0.3, split_seed=5)  # other val split, same test split
    other.setup()
    assert torch.equal(other.test_set.images, dm.test_set.images)
    # The class statistics are those of the 1,347 training images (val included).
    pool = torch.cat([dm.train_set.images, dm.val_set.images]).float() / 255
    torch.testing.assert_close(pool.mean(dim=(0, 2, 3)), torch.tensor(dm.mean), atol=1e-4, rtol=0)
    torch.testing.assert_close(pool.std(dim=(0, 2, 3)), torch.tensor(dm.std), atol=1e-4, rtol=0)
