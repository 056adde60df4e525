"""Out-of-distribution sets that need no download, for models of the embedded digits data.

The paper's OOD set is the SVHN test split (for CIFAR models: `ood=svhn`). A model of the
embedded digits needs OOD images that are on every machine too:

- `PhotoPatchesDataModule` (`ood=photos`): 32x32 patches of natural photographs, cut from the
  two colour photos that ship with scikit-learn (`sklearn.datasets.load_sample_images`: a
  Chinese temple and a flower, 427x640), downscaled x4 first so a patch holds structure,
  not one flat colour;
- `NoiseDataModule` (`ood=noise`): uniform noise images.

Both are test-only data modules with the same uint8 (N, 3, 32, 32) layout as every dataset
here; the labels are meaningless zeros. Their images are normalised with the
*in-distribution* statistics by the evaluation (see `dbsn.evaluation.ood.OODDetection`).
"""

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from dbsn.data.base import ImageClassificationDataModule

#: Downscaling of the photos before cutting patches.
PHOTO_SCALE = 4


@cache
def photo_patches(n: int, seed: int) -> Tensor:
    """n uint8 patches (n, 3, 32, 32) cut at random places of the downscaled sample photos."""
    from sklearn.datasets import load_sample_images

    photos = [torch.tensor(img).permute(2, 0, 1).unsqueeze(0).float() for img in load_sample_images().images]
    small = [F.interpolate(p, scale_factor=1 / PHOTO_SCALE, mode="area") for p in photos]
    small = [p[0].round().clamp(0, 255).to(torch.uint8) for p in small]
    generator = torch.Generator().manual_seed(seed)
    patches = torch.empty(n, 3, 32, 32, dtype=torch.uint8)  # written in place: n x 3 KB, no float copies
    for i in range(n):
        photo = small[i % len(small)]
        top = int(torch.randint(0, photo.shape[1] - 32 + 1, (), generator=generator))
        left = int(torch.randint(0, photo.shape[2] - 32 + 1, (), generator=generator))
        patches[i] = photo[:, top : top + 32, left : left + 32]
    return patches


#: Bytes an OOD image takes in an evaluation: its uint8 pixels and a float32 copy.
BYTES_PER_IMAGE = 3 * 32 * 32 * (1 + 4)


def available_memory() -> int | None:
    """The memory the kernel can give this process now (Linux's MemAvailable), in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


class _TestOnlyDataModule(ImageClassificationDataModule):
    num_classes = 0
    mean = (0.5, 0.5, 0.5)  # unused: OOD images are normalised with the in-distribution statistics
    std = (0.25, 0.25, 0.25)

    def __init__(self, root: str = "./data", size: int = 1000, seed: int = 0, **kwargs) -> None:
        super().__init__(root, **kwargs)
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        memory = available_memory()
        if memory is not None and size * BYTES_PER_IMAGE > memory:
            raise ValueError(
                f"size={size:,} needs about {_gb(size * BYTES_PER_IMAGE)} of memory for its images "
                f"({BYTES_PER_IMAGE // 1024} KB each as pixels and a float copy), and "
                f"{_gb(memory)} is available: choose a size up to {memory // BYTES_PER_IMAGE:,}"
            )
        self.size, self.seed = size, seed

    def images(self) -> Tensor:
        raise NotImplementedError

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        if train:
            raise ValueError(f"{self.name} is an out-of-distribution test set; it has no training split")
        return self.images(), torch.zeros(self.size, dtype=torch.long)


class PhotoPatchesDataModule(_TestOnlyDataModule):
    """`size` 32x32 natural-photo patches (half from each sample photo), seeded by `seed`."""

    name = "photo patches"

    def images(self) -> Tensor:
        return photo_patches(self.size, self.seed)


class NoiseDataModule(_TestOnlyDataModule):
    """`size` images of independent uniform noise in 0..255, seeded by `seed`."""

    name = "uniform noise"

    def images(self) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 256, (self.size, 3, 32, 32), generator=generator, dtype=torch.uint8)
