"""Datasets as Lightning DataModules: CIFAR-10/100, SVHN and the embedded digits,
out-of-distribution sets that need no download (photo patches, noise) and the other OOD sets of
OpenOOD v1.5's CIFAR benchmarks (MNIST, Textures, Places365, TinyImageNet); CamVid for
segmentation.

Loaders yield uint8 images and int64 labels; each DataModule turns them into normalised
float batches (augmented in training) on the device, in `on_after_batch_transfer`.
"""

from dbsn.data.base import (
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageClassificationDataModule,
    TensorImageDataset,
)
from dbsn.data.camvid import CamVidDataModule
from dbsn.data.cifar import CIFAR10DataModule, CIFAR100DataModule
from dbsn.data.digits import DigitsDataModule
from dbsn.data.ood import NoiseDataModule, PhotoPatchesDataModule
from dbsn.data.ood_sets import (
    MNISTDataModule,
    Places365DataModule,
    TexturesDataModule,
    TinyImageNetDataModule,
)
from dbsn.data.svhn import SVHNDataModule

__all__ = [
    "CamVidDataModule",
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "CorruptDatasetError",
    "DatasetNotFoundError",
    "DigitsDataModule",
    "ImageClassificationDataModule",
    "MNISTDataModule",
    "NoiseDataModule",
    "PhotoPatchesDataModule",
    "Places365DataModule",
    "SVHNDataModule",
    "TensorImageDataset",
    "TexturesDataModule",
    "TinyImageNetDataModule",
]
