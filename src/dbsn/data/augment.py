"""Batched image augmentation and normalisation, run on the device after the batch arrives.

The loaders hand over uint8 batches; everything here works on a whole float batch
(N, C, H, W) at once, with a different random draw for every sample and no Python loop over
samples, so augmentation costs a few kernel launches per batch on a GPU.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def to_unit_range(images: Tensor) -> Tensor:
    """uint8 images in 0..255 -> float32 images in [0, 1]."""
    return images.float().div_(255.0)


def crop_offsets(n: int, padding: int, device: torch.device | str | None = None) -> Tensor:
    """(n, 2) window corners (top, left) for `random_crop`, each uniform on 0..2·padding."""
    return torch.randint(0, 2 * padding + 1, (n, 2), device=device)


def flip_draws(n: int, device: torch.device | str | None = None) -> Tensor:
    """(n,) bools for `random_hflip`, each true with probability 1/2."""
    return torch.rand(n, device=device) < 0.5


def random_crop(x: Tensor, padding: int, offsets: Tensor | None = None) -> Tensor:
    """Pad every image with `padding` zeros on each side and cut out a random H x W window.

    This is torchvision's ``RandomCrop(size, padding)`` applied per sample, as one gather over
    the padded batch. `offsets` (N, 2) holds the (top, left) corner of each window in the
    padded image, each in 0..2·padding; it is drawn uniformly when not given.
    """
    if padding == 0:
        return x
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    padded_w = w + 2 * padding
    if offsets is None:
        offsets = crop_offsets(n, padding, x.device)
    rows = offsets[:, :1] + torch.arange(h, device=x.device)  # (N, H)
    cols = offsets[:, 1:] + torch.arange(w, device=x.device)  # (N, W)
    index = (rows[:, :, None] * padded_w + cols[:, None, :]).view(n, 1, h * w)
    crops = padded.flatten(2).gather(2, index.expand(n, c, h * w))
    return crops.view(n, c, h, w)


def random_hflip(x: Tensor, flip: Tensor | None = None) -> Tensor:
    """Mirror each image left-right with probability 1/2 (or where the (N,) bool `flip` says)."""
    if flip is None:
        flip = flip_draws(x.shape[0], x.device)
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per-channel standardisation (x - mean) / std, as torchvision's ``Normalize``."""
    mean_t = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - mean_t) / std_t
