"""The out-of-distribution sets of OpenOOD v1.5's CIFAR benchmarks that are no training set
here: MNIST, Textures (DTD), Places365 and TinyImageNet (`ood=mnist`, `ood=textures`,
`ood=places365`, `ood=tinyimagenet`; with CIFAR-10/100 and SVHN they make the near- and
far-OOD groups of `dbsn.evaluation.ood_groups`).

Each is a test-only data module with the layout of every dataset here: uint8 (N, 3, 32, 32)
images and int64 labels (the set's own classes, ignored), decoded once in `setup` and kept in
memory, normalised by the evaluation with the IN-distribution statistics. Images are brought to
32x32 with the torchvision calls of OpenOOD v1.5's `TestStandardPreProcessor` (pre_size =
img_size = 32): ``Convert('RGB')``, ``Resize(32, BILINEAR)`` of the SHORTER side on the PIL image
(antialiased), ``CenterCrop(32)``, so the uint8 pixels are OpenOOD's before its ``ToTensor()``;
non-square DTD images lose the ends of their longer side.

OpenOOD's image lists are not reproduced: each set is used whole (MNIST: its test split by
default), where OpenOOD cleans Places365 and TinyImageNet of images overlapping CIFAR classes;
`exclude` takes such a list of file names (the three sets read from image files) and `size` a
seeded subset kept in file order (every set). A set with files missing fails before reading
anything, with a `DatasetNotFoundError` naming the files it expects. The sets' sizes and files:
docs/evaluation.md ("Out-of-distribution sets").
"""

from __future__ import annotations

import gzip
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from dbsn.data.base import (
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageClassificationDataModule,
)

#: Side of the images after OpenOOD's CIFAR test transform.
IMAGE_SIZE = 32
#: At most this many missing files are listed by name in a `DatasetNotFoundError`.
MAX_LISTED = 20


# ----- OpenOOD's CIFAR test transform ------------------------------------------------------
def openood_resize(image) -> np.ndarray:
    """uint8 (3, 32, 32) array of a PIL image after OpenOOD v1.5's CIFAR test transform up to
    ``ToTensor``: ``Convert('RGB')``, ``Resize(32, BILINEAR)``, ``CenterCrop(32)``."""
    image = TF.resize(image.convert("RGB"), IMAGE_SIZE, interpolation=InterpolationMode.BILINEAR)
    image = TF.center_crop(image, IMAGE_SIZE)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def _read_image_file(path: Path) -> np.ndarray:
    try:
        with Image.open(path) as image:
            return openood_resize(image)
    except (OSError, ValueError, SyntaxError) as error:  # PIL's errors for truncated or foreign files
        raise CorruptDatasetError(
            f"{path}: cannot be decoded as an image ({type(error).__name__}: {error}); "
            "the file is corrupt or incomplete, delete it and get it again"
        ) from error


def read_image_files(paths: list[Path]) -> Tensor:
    """uint8 (N, 3, 32, 32) images of the given files, each decoded and resized by
    `openood_resize`, in order. Decoded by a pool of up to 8 threads, one per CPU: PIL releases
    the GIL while it decodes and resizes, and a set like Places365 holds tens of thousands of JPEGs."""
    out = np.empty((len(paths), 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i, image in enumerate(pool.map(_read_image_file, paths)):
            out[i] = image
    return torch.from_numpy(out)


# ----- base --------------------------------------------------------------------------------
class OODSetDataModule(ImageClassificationDataModule):
    """A test-only OOD set read from files, optionally a seeded subset of it.

    Args:
        root: the folder the set's files are under (see each set for its layout).
        size: keep a random subset of this many images (in file order), drawn with `seed`;
            None = all of them.
        seed: seed of the permutation that picks the subset.
        **kwargs: as `ImageClassificationDataModule` (only the test loader is ever used).
    """

    #: The set's file in conf/ood/ (and its key under `ood`), for the error messages.
    config_name: ClassVar[str]
    mean = (0.5, 0.5, 0.5)  # unused: OOD images are normalised with the in-distribution statistics
    std = (0.25, 0.25, 0.25)

    def __init__(self, root: str = "./data", size: int | None = None, seed: int = 0, **kwargs) -> None:
        super().__init__(root, **kwargs)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"ood.{self.config_name}.size must be a count >= 1 or null (all), got {size!r}")
        self.size, self.seed = size, seed

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        if train:
            raise ValueError(f"{self.name} is an out-of-distribution test set; it has no training split")
        return self.read_test_set()

    def read_test_set(self) -> tuple[Tensor, Tensor]:
        """uint8 images (N, 3, 32, 32) and int64 labels (N,) of the (subset of the) set."""
        raise NotImplementedError

    def subset_of(self, n: int) -> Tensor:
        """Sorted positions of the images `size` keeps out of `n` (all of them for None)."""
        if self.size is None:
            return torch.arange(n)
        if self.size > n:
            raise ValueError(f"ood.{self.config_name}.size={self.size} but {self.name} has {n} images here")
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=generator)[: self.size].sort().values

    def check_files(self) -> None:
        """Raise `DatasetNotFoundError` naming the expected files that are missing (the first
        `MAX_LISTED` of them, and how many more)."""
        missing = [path for path in self.required_files() if not path.is_file()]
        if not missing:
            return
        listing = "\n".join(f"  {path}" for path in missing[:MAX_LISTED])
        if len(missing) > MAX_LISTED:
            listing += f"\n  ... and {len(missing) - MAX_LISTED} more"
        download = (
            f"  - ood.{self.config_name}.download=true (torchvision downloads them; needs internet)\n"
            if self.can_download
            else ""
        )
        raise DatasetNotFoundError(
            f"{self.name}: {len(missing)} file(s) missing under {self.root}:\n{listing}\n"
            f"Get them in one of these ways:\n{download}"
            f"  - by hand: {self.download_hint()}\n"
            f"  - point ood.{self.config_name}.root at the folder that already holds them"
        )

    @property
    def can_download(self) -> bool:
        """Whether `download_files` can fetch the set (torchvision has a downloader for it)."""
        return type(self).download_files is not OODSetDataModule.download_files

    def download_files(self) -> None:
        raise NotImplementedError(f"{self.name}: torchvision has no downloader for it; {self.download_hint()}")


class ImageFileOODSetDataModule(OODSetDataModule):
    """An OOD set of image files named by list files, optionally with some images left out.

    Args:
        exclude: a text file naming images to leave out, one a line: the first
            whitespace-separated token of each line, compared by file name (so a bare name, a
            path, or an image-list line "path label" all work); blank lines and lines starting
            with '#' are skipped. Applied before `size`.
        **kwargs: as `OODSetDataModule`.
    """

    def __init__(self, root: str = "./data", exclude: str | None = None, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.exclude = Path(exclude).expanduser().absolute() if exclude else None
        self.excluded = 0  # images left out by `exclude`, known after `entries()`
        self._entries: list[tuple[Path, int]] | None = None

    def list_files(self) -> list[Path]:
        """The files that name the set's images (read before any image)."""
        raise NotImplementedError

    def all_entries(self) -> list[tuple[Path, int]]:
        """(image path, label) of every image of the set, in file order, from `list_files`."""
        raise NotImplementedError

    def entries(self) -> list[tuple[Path, int]]:
        """The images that are read: `all_entries` less `exclude`, then the `size` subset."""
        if self._entries is None:
            entries = self.all_entries()
            if self.exclude is not None:
                names = excluded_names(self.exclude)
                kept = [entry for entry in entries if entry[0].name not in names]
                self.excluded = len(entries) - len(kept)
                entries = kept
            self._entries = [entries[i] for i in self.subset_of(len(entries)).tolist()]
        return self._entries

    def required_files(self) -> list[Path]:
        """The list files (and the exclusion file); once they are all there, also every image
        they name that is read."""
        lists = self.list_files() + ([self.exclude] if self.exclude is not None else [])
        if not all(path.is_file() for path in lists):
            return lists
        return lists + [path for path, _ in self.entries()]

    def read_test_set(self) -> tuple[Tensor, Tensor]:
        entries = self.entries()
        images = read_image_files([path for path, _ in entries])
        return images, torch.tensor([label for _, label in entries], dtype=torch.long)


def excluded_names(path: Path) -> set[str]:
    """File names listed in an exclusion file (see `ImageFileOODSetDataModule`)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(line.split()[0].replace("\\", "/").rsplit("/", 1)[-1])
    return names


def _read_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


# ----- MNIST --------------------------------------------------------------------------------
def read_idx(path: Path, ndim: int) -> np.ndarray:
    """The uint8 array of an idx file (LeCun's MNIST format; gzip-compressed when the name ends
    in .gz): magic 0x00 0x00 0x08 ndim, then ndim big-endian int32 sizes, then the data."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as error:
        raise CorruptDatasetError(f"{path}: cannot be read ({type(error).__name__}: {error})") from error
    header = 4 + 4 * ndim
    if len(data) < header or data[:4] != bytes((0, 0, 8, ndim)):
        raise CorruptDatasetError(
            f"{path}: not a uint8 idx file of {ndim} dimension(s) (magic {data[:4].hex() or 'missing'}, "
            f"expected 000008{ndim:02x}); the file is corrupt, delete it and get it again"
        )
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) - header != int(np.prod(shape)):
        raise CorruptDatasetError(
            f"{path}: holds {len(data) - header} bytes of data for a {shape} array; "
            "the file is corrupt or incomplete, delete it and get it again"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def grey_to_openood(images: np.ndarray) -> Tensor:
    """uint8 (N, 3, 32, 32) of uint8 grey images (N, H, W), each through `openood_resize`."""
    out = np.empty((len(images), 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
    for i, image in enumerate(images):
        out[i] = openood_resize(Image.fromarray(image))  # 2-D uint8: mode "L"
    return torch.from_numpy(out)


class MNISTDataModule(OODSetDataModule):
    """MNIST digits (28x28 grey) as an OOD set, read from torchvision's raw layout
    ``<root>/MNIST/raw/{t10k,train}-{images-idx3,labels-idx1}-ubyte`` (or the same names with
    ``.gz``: the downloaded archives). Grey -> three equal channels, 28 -> 32 bilinear.

    Args:
        split: "test" (10,000 images, the default), "train" (60,000) or "all" (both, 70,000).
        **kwargs: as `OODSetDataModule`.
    """

    name = "MNIST"
    config_name = "mnist"
    num_classes = 10
    prefixes: ClassVar[dict[str, tuple[str, ...]]] = {"test": ("t10k",), "train": ("train",), "all": ("train", "t10k")}
    url: ClassVar[str] = "https://ossci-datasets.s3.amazonaws.com/mnist"

    def __init__(self, root: str = "./data", split: str = "test", **kwargs) -> None:
        super().__init__(root, **kwargs)
        if split not in self.prefixes:
            raise ValueError(f"ood.mnist.split must be one of {list(self.prefixes)}, got {split!r}")
        self.split = split

    @property
    def raw_folder(self) -> Path:
        return self.root / "MNIST" / "raw"

    def idx_file(self, name: str) -> Path:
        """The file `name`, or its .gz archive when only that is there."""
        plain, packed = self.raw_folder / name, self.raw_folder / f"{name}.gz"
        return packed if not plain.is_file() and packed.is_file() else plain

    def file_pairs(self) -> list[tuple[Path, Path]]:
        return [
            (self.idx_file(f"{p}-images-idx3-ubyte"), self.idx_file(f"{p}-labels-idx1-ubyte"))
            for p in self.prefixes[self.split]
        ]

    def required_files(self) -> list[Path]:
        return [path for pair in self.file_pairs() for path in pair]

    def download_hint(self) -> str:
        names = [f"{p}-{kind}-ubyte.gz" for p in self.prefixes[self.split] for kind in ("images-idx3", "labels-idx1")]
        return (
            f"download {', '.join(f'{self.url}/{n}' for n in names)} into {self.raw_folder} "
            "(the .gz files are read as they are)"
        )

    def download_files(self) -> None:
        from torchvision.datasets import MNIST

        MNIST(str(self.root), train=False, download=True)  # fetches all four files

    def read_test_set(self) -> tuple[Tensor, Tensor]:
        images, labels = [], []
        for image_path, label_path in self.file_pairs():
            x, y = read_idx(image_path, 3), read_idx(label_path, 1)
            if len(x) != len(y):
                raise CorruptDatasetError(f"{image_path} holds {len(x)} images but {label_path} {len(y)} labels")
            images.append(x)
            labels.append(y)
        x, y = np.concatenate(images), np.concatenate(labels)
        keep = self.subset_of(len(y)).numpy()
        return grey_to_openood(x[keep]), torch.from_numpy(y[keep].astype(np.int64))


# ----- Textures (DTD) -------------------------------------------------------------------------
class TexturesDataModule(ImageFileOODSetDataModule):
    """The Describable Textures Dataset (Cimpoi et al., 2014) as an OOD set, in torchvision's
    `DTD` layout: ``<root>/dtd/dtd/images/<class>/<name>.jpg`` and the split lists
    ``<root>/dtd/dtd/labels/{train,val,test}<partition>.txt`` (lines ``<class>/<name>.jpg``).
    47 classes of 120 images, 300x300 to 640x640 and not all square: the shorter side goes to
    32, the longer is centre-cropped. Labels: the class's index in the sorted class names.

    Args:
        split: "all" (the default: train + val + test of the partition, all 5,640 images, as
            OpenOOD), or one of "train", "val", "test" (1,880 images each).
        partition: which of DTD's ten splits, 1..10 (any gives the same 5,640 for "all").
        **kwargs: as `ImageFileOODSetDataModule`.
    """

    name = "Textures"
    config_name = "textures"
    num_classes = 47
    splits: ClassVar[dict[str, tuple[str, ...]]] = {
        "all": ("train", "val", "test"),
        "train": ("train",),
        "val": ("val",),
        "test": ("test",),
    }
    url: ClassVar[str] = "https://www.robots.ox.ac.uk/~vgg/data/dtd/download/dtd-r1.0.1.tar.gz"

    def __init__(self, root: str = "./data", split: str = "all", partition: int = 1, **kwargs) -> None:
        super().__init__(root, **kwargs)
        if split not in self.splits:
            raise ValueError(f"ood.textures.split must be one of {list(self.splits)}, got {split!r}")
        if isinstance(partition, bool) or not isinstance(partition, int) or not 1 <= partition <= 10:
            raise ValueError(f"ood.textures.partition must be 1..10, got {partition!r}")
        self.split, self.partition = split, partition

    @property
    def data_folder(self) -> Path:
        return self.root / "dtd" / "dtd"

    def list_files(self) -> list[Path]:
        return [self.data_folder / "labels" / f"{s}{self.partition}.txt" for s in self.splits[self.split]]

    def all_entries(self) -> list[tuple[Path, int]]:
        lines = list(dict.fromkeys(line for path in self.list_files() for line in _read_lines(path)))
        classes = sorted({line.split("/")[0] for line in lines})
        index = {cls: i for i, cls in enumerate(classes)}
        return [(self.data_folder / "images" / line, index[line.split("/")[0]]) for line in lines]

    def download_hint(self) -> str:
        return f"download {self.url} and extract it in {self.root / 'dtd'} (it unpacks to dtd/)"

    def download_files(self) -> None:
        from torchvision.datasets import DTD

        DTD(str(self.root), download=True)


# ----- Places365 --------------------------------------------------------------------------
class Places365DataModule(ImageFileOODSetDataModule):
    """The Places365 validation split (Zhou et al., 2017; 365 scene classes x 100 images) as an
    OOD set, in torchvision's `Places365(split="val", small=True)` layout: the list
    ``<root>/places365_val.txt`` (lines ``Places365_val_00000001.jpg <class index>``) and the
    256x256 images in ``<root>/val_256/``. Labels: the class indices of the list.

    OpenOOD uses its own cleaned subset; by default all 36,500 images are used here, `size`
    draws a seeded subset (e.g. for a quicker run), `exclude` leaves named images out.
    """

    name = "Places365"
    config_name = "places365"
    num_classes = 365
    list_name: ClassVar[str] = "places365_val.txt"
    base_url: ClassVar[str] = "http://data.csail.mit.edu/places/places365"

    def list_files(self) -> list[Path]:
        return [self.root / self.list_name]

    def all_entries(self) -> list[tuple[Path, int]]:
        entries = []
        for line in _read_lines(self.root / self.list_name):
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise CorruptDatasetError(
                    f"{self.root / self.list_name}: expected '<image> <class index>', got {line!r}"
                )
            entries.append((self.root / "val_256" / parts[0].lstrip("/"), int(parts[1])))
        return entries

    def download_hint(self) -> str:
        return (
            f"download {self.base_url}/filelist_places365-standard.tar and {self.base_url}/val_256.tar "
            f"and extract both in {self.root} (places365_val.txt and val_256/)"
        )

    def download_files(self) -> None:
        from torchvision.datasets import Places365

        Places365(str(self.root), split="val", small=True, download=True)


# ----- TinyImageNet -------------------------------------------------------------------------
class TinyImageNetDataModule(ImageFileOODSetDataModule):
    """TinyImageNet's validation split (200 ImageNet classes x 50 images, 64x64) as an OOD set,
    in the layout of its zip: ``<root>/tiny-imagenet-200/val/val_annotations.txt`` (tab-separated
    lines ``val_0.JPEG  <wnid>  <box>``) and ``<root>/tiny-imagenet-200/val/images/*.JPEG``.
    64 -> 32 bilinear (antialiased). Labels: the wnid's index among the sorted wnids.

    Used as it is: OpenOOD v1.5 removes the TinyImageNet images that overlap CIFAR classes;
    pass such a list of file names as `exclude` to do the same.
    """

    name = "TinyImageNet"
    config_name = "tinyimagenet"
    num_classes = 200
    url: ClassVar[str] = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"

    @property
    def val_folder(self) -> Path:
        return self.root / "tiny-imagenet-200" / "val"

    def list_files(self) -> list[Path]:
        return [self.val_folder / "val_annotations.txt"]

    def all_entries(self) -> list[tuple[Path, int]]:
        path = self.val_folder / "val_annotations.txt"
        rows = [line.split() for line in _read_lines(path)]
        if any(len(row) < 2 for row in rows):
            raise CorruptDatasetError(f"{path}: expected '<image> <wnid> ...' on every line")
        index = {wnid: i for i, wnid in enumerate(sorted({row[1] for row in rows}))}
        return [(self.val_folder / "images" / row[0], index[row[1]]) for row in rows]

    def download_hint(self) -> str:
        return f"download {self.url} and unzip it in {self.root} (it unpacks to tiny-imagenet-200/)"


__all__ = [
    "ImageFileOODSetDataModule",
    "MNISTDataModule",
    "OODSetDataModule",
    "Places365DataModule",
    "TexturesDataModule",
    "TinyImageNetDataModule",
    "openood_resize",
    "read_idx",
    "read_image_files",
]
