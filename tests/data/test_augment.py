"""The batched augmentation (dbsn.data.augment): random crops against torchvision's crop of the
padded image, per-sample crops and flips, per-channel normalisation.
"""

import torch
import torch.nn.functional as F
from torchvision.transforms import functional as TF

from dbsn.data.augment import normalize, random_crop, random_hflip


def test_random_crop_matches_torchvision_crop_of_padded_image():
    x = torch.rand(5, 3, 32, 32)
    offsets = torch.tensor([[0, 0], [8, 8], [3, 7], [8, 0], [1, 5]])
    out = random_crop(x, padding=4, offsets=offsets)
    padded = F.pad(x, (4, 4, 4, 4))
    for i, (top, left) in enumerate(offsets.tolist()):
        torch.testing.assert_close(out[i], TF.crop(padded[i], top, left, 32, 32), rtol=0, atol=0)


def test_crop_and_flip_are_drawn_per_sample():
    torch.manual_seed(0)
    x = torch.rand(1, 3, 32, 32).expand(64, -1, -1, -1)
    crops = random_crop(x, padding=4)
    assert len({c.numpy().tobytes() for c in crops}) > 20
    flips = random_hflip(x)
    flipped = torch.tensor([torch.equal(f, x[0].flip(-1)) for f in flips])
    kept = torch.tensor([torch.equal(f, x[0]) for f in flips])
    assert (flipped | kept).all() and 0 < flipped.sum() < 64


def test_normalize_is_per_channel():
    x = torch.ones(2, 3, 4, 4) * torch.tensor([0.2, 0.5, 0.8]).view(1, 3, 1, 1)
    out = normalize(x, (0.2, 0.4, 0.6), (0.1, 0.2, 0.4))
    torch.testing.assert_close(out[:, :, 0, 0], torch.tensor([[0.0, 0.5, 0.5]] * 2))
