"""scikit-learn's handwritten digits, shaped like CIFAR: the embedded dataset that needs no download.

1,797 grey 8x8 images with values 0..16 (UCI optical digits), ten classes. To feed the same
networks as CIFAR they are scaled to 0..255, upsampled x4 to 32x32 with bilinear interpolation
(smooth strokes rather than 4x4 blocks, closer to natural 32x32 images; ``align_corners=False``)
and repeated over three channels. A fixed stratified 25% of the images (450, seed 0) is the
test set, never trained on; the remaining 1,347 are the training set, from which `val_size`
carves a validation split as for the other datasets.
"""

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dbsn.data.base import ImageClassificationDataModule

#: Fraction of the digits held out as the test set, and the seed of that split.
TEST_FRACTION = 0.25
TEST_SEED = 0


@cache
def digits_splits() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """((train images, labels), (test images, labels)): uint8 (N, 3, 32, 32), int64 (N,)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) * (255.0 / 16.0)
    large = F.interpolate(pixels, scale_factor=4, mode="bilinear", align_corners=False)
    images = large.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = torch.as_tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=TEST_FRACTION, random_state=TEST_SEED, stratify=digits.target
    )
    train_idx, test_idx = torch.as_tensor(np.sort(train_idx)), torch.as_tensor(np.sort(test_idx))
    return (images[train_idx], labels[train_idx]), (images[test_idx], labels[test_idx])


class DigitsDataModule(ImageClassificationDataModule):
    """The 8x8 digits as 3x32x32 images; `root` and `download` are accepted and unused.

    `mean` and `std` are the pixel statistics of the 1,347 training images in [0, 1]
    (validation images included, as the CIFAR statistics cover the whole training set);
    ``tests/data/test_digits.py`` recomputes them. No horizontal flips by default: digits are not
    mirror-symmetric. The training-time random crop (padding 4) stays on.
    """

    name = "digits"
    num_classes = 10
    mean = (0.3052, 0.3052, 0.3052)
    std = (0.3236, 0.3236, 0.3236)
    default_flip = False

    def __init__(self, root: str = "./data", **kwargs) -> None:
        super().__init__(root, **kwargs)

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        train_split, test_split = digits_splits()
        return train_split if train else test_split
