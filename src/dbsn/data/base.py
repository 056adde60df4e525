"""The image-classification DataModule that every dataset here shares.

Images stay in memory as uint8 tensors (N, 3, 32, 32) with int64 labels. A loader does one
gather per batch and yields ``(uint8 images, labels)``; all float work (scaling to [0, 1],
random crop and flip in training, per-channel normalisation) runs in
`on_after_batch_transfer`, on the device, batched. Subclasses only say where their files are
and how to read them.

With `on_device` the uint8 training set itself lives on the accelerator (CIFAR-10: 150 MB)
and `DeviceBatches` gathers each batch there: no worker processes, no host-to-device copy per
step. Its batches are the DataLoader's, index for index: it iterates the same samplers.
"""

import os
import warnings
from pathlib import Path
from typing import ClassVar

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from dbsn.data.augment import crop_offsets, flip_draws, normalize, random_crop, random_hflip, to_unit_range

# `val_dataloader` returns [] when there is no validation split: that is how Lightning is told
# to skip validation, so its warning about a zero-length `list` is expected. (A zero-length
# DataLoader still warns.)
warnings.filterwarnings("ignore", message="Total length of `list` across ranks is zero", category=UserWarning)

#: Zero padding of the training-time random crop (the paper's "random crop 32, padding 4").
CROP_PADDING = 4


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not where the DataModule expects them."""


class CorruptDatasetError(ValueError):
    """A dataset file exists but cannot be read or holds the wrong arrays."""


class TensorImageDataset(Dataset):
    """uint8 images (N, C, H, W) and int64 labels (N,) held in memory.

    `__getitems__` lets a DataLoader fetch a whole batch with one index operation; use it with
    `collate_batch`, which passes that batch through unchanged.
    """

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], self.labels[index]


def collate_batch(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Identity collate: `TensorImageDataset.__getitems__` already returns the stacked batch."""
    return batch


class EpochShuffleSampler(RandomSampler):
    """A random permutation per epoch that depends only on (seed, epoch): Lightning calls
    `set_epoch` before every epoch, so a run resumed from a checkpoint sees the same order as an
    uninterrupted one, whenever its loader iterator happens to be created. The seed defaults to
    `torch.initial_seed()` (the run's `seed`, set by `seed_everything`). A `RandomSampler`, so
    under DDP Lightning swaps it for its `DistributedSampler`, which is seeded the same way."""

    def __init__(self, data_source, seed: int | None = None) -> None:
        super().__init__(data_source)
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        yield from epoch_permutation(len(self.data_source), self.seed, self.epoch)


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The training order of an epoch: a permutation of range(n) fixed by (seed, epoch)."""
    generator = torch.Generator().manual_seed((seed + 1_000_003 * epoch) % 2**63)
    return torch.randperm(n, generator=generator).tolist()


class SameOrderOnEveryRank(DistributedSampler):
    """The `EpochShuffleSampler` order, on every rank alike: every rank iterates the whole
    training set in the same order (structure-parallel training, where the ranks share each
    batch and split its structures). A `DistributedSampler` of one replica, so that Lightning
    keeps it instead of splitting the data between the ranks."""

    def __init__(self, data_source, seed: int | None = None) -> None:
        seed = torch.initial_seed() if seed is None else int(seed)
        super().__init__(data_source, num_replicas=1, rank=0, shuffle=True, seed=seed)

    def __iter__(self):
        yield from epoch_permutation(len(self.dataset), self.seed, self.epoch)


def in_memory_loader(datamodule, dataset: Dataset, train: bool) -> DataLoader:
    """A loader over an in-memory dataset with `__getitems__` (one gather per batch), with the
    data module's batch sizes, workers, `drop_last` and `pin_memory` settings; shuffled in
    training by an `EpochShuffleSampler` (same order on resume), or, when the runtime has set
    `datamodule.same_batches_on_every_rank`, by `SameOrderOnEveryRank`."""
    replicated = train and getattr(datamodule, "same_batches_on_every_rank", False)
    return DataLoader(
        dataset,
        batch_size=datamodule.batch_size if train else datamodule.eval_batch_size,
        sampler=(SameOrderOnEveryRank if replicated else EpochShuffleSampler)(dataset) if train else None,
        generator=torch.Generator().manual_seed(torch.initial_seed()),  # worker seeds: not from the global RNG
        drop_last=train and datamodule.drop_last,
        num_workers=datamodule.num_workers,
        persistent_workers=datamodule.num_workers > 0,
        pin_memory=datamodule.pin_memory and torch.cuda.is_available(),
        collate_fn=collate_batch,
    )


class DeviceBatches:
    """The training loader of `on_device`: batches gathered by index from a training set held
    on the device, in the order of `sampler`.

    `sampler` is what the DataLoader path iterates, so the batches are the same ones: the
    `EpochShuffleSampler` order on one device, `SameOrderOnEveryRank` for structure-parallel
    ranks, and for data-parallel ranks the `DistributedSampler` that Lightning would put in a
    DataLoader (same seed, disjoint shards). Lightning calls `sampler.set_epoch` before every
    epoch.

    Mid-epoch resume. Lightning saves `state_dict()` in every checkpoint and hands it back
    before the resumed epoch starts; the epoch then continues after the batches that had been
    trained on. Lightning fetches a batch ahead of the one it trains on, so what counts is not
    what this loader has yielded but what training consumed: the data module calls `consumed()`
    for every training batch it preprocesses.
    """

    def __init__(self, images: Tensor, labels: Tensor, sampler, batch_size: int, drop_last: bool) -> None:
        self.images, self.labels = images, labels
        self.sampler = sampler
        self.batch_size, self.drop_last = batch_size, drop_last
        self._done = 0  # batches of the current epoch that training consumed
        self._resume: dict | None = None

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        epoch = getattr(self.sampler, "epoch", 0)
        start = 0
        if self._resume is not None and self._resume["epoch"] == epoch:
            start = self._resume["batches"]
        self._resume, self._done = None, start
        order = torch.as_tensor(list(iter(self.sampler)), dtype=torch.long, device=self.images.device)
        for b in range(start, len(self)):
            index = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.images[index], self.labels[index]

    def consumed(self) -> None:
        """One more training batch of this epoch went into a training step."""
        self._done += 1

    def state_dict(self) -> dict:
        return {"epoch": getattr(self.sampler, "epoch", 0), "batches": self._done}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)


def check_arrays(path: Path, images: np.ndarray, labels: np.ndarray, num_classes: int) -> None:
    """Raise `CorruptDatasetError` naming `path` unless it held uint8 (N, 3, 32, 32) images with
    N labels in 0..num_classes-1."""
    problem = None
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (3, 32, 32):
        problem = f"images should be uint8 (N, 3, 32, 32), got {images.dtype} {images.shape}"
    elif labels.shape != (images.shape[0],):
        problem = f"{images.shape[0]} images but labels of shape {labels.shape}"
    elif labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        problem = f"labels outside 0..{num_classes - 1} (min {labels.min()}, max {labels.max()})"
    if problem:
        raise CorruptDatasetError(f"{path}: {problem}; the file is corrupt or incomplete, delete it and get it again")


class ImageClassificationDataModule(L.LightningDataModule):
    """Train / optional validation / test loaders for a 32x32 RGB classification dataset.

    Args:
        root: folder holding the dataset files (layout as torchvision's dataset classes).
        batch_size: training batch size (the paper: 64).
        eval_batch_size: validation and test batch size; None = `batch_size`.
        num_workers: DataLoader worker processes (kept alive between epochs).
        val_size: images carved out of the training set for validation: 0 = none (the
            validation loader is empty and Lightning skips validation), an int = a count, a
            float in (0, 1) = a fraction. The test set is never used for anything but testing.
        split_seed: seed of the permutation that picks the validation images.
        train_subset: train on a seeded, class-stratified subset of the training images left
            after the validation carve-out (e.g. a quick run on part of CIFAR): None or 0 =
            all of them, an int = a count, a float in (0, 1) = a fraction. The validation and
            test sets are untouched; `num_train` is the subset's size.
        subset_seed: seed of the per-class permutations that pick the subset.
        download: let `prepare_data` fetch the dataset with torchvision (needs internet).
        augment: random crop (padding 4) and, if `flip`, horizontal flip in training.
        flip: horizontal flips in training; None = the dataset's default (`default_flip`).
        drop_last: drop the last incomplete training batch (the research code does).
        pin_memory: pinned host memory for faster copies (only used when CUDA is present).
        on_device: keep the uint8 training set on the accelerator and gather batches there
            (`DeviceBatches`: the same batches, no workers, no copy per step). "auto" = when
            training on a GPU; true also on a CPU (no worker processes); false = the DataLoader.
    """

    name: ClassVar[str]
    num_classes: ClassVar[int]
    mean: ClassVar[tuple[float, float, float]]
    std: ClassVar[tuple[float, float, float]]
    default_flip: ClassVar[bool] = True

    def __init__(
        self,
        root: str,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 2,
        val_size: int | float = 0,
        split_seed: int = 0,
        train_subset: int | float | None = None,
        subset_seed: int = 0,
        download: bool = False,
        augment: bool = True,
        flip: bool | None = None,
        drop_last: bool = True,
        pin_memory: bool = True,
        on_device: bool | str = "auto",
    ) -> None:
        super().__init__()
        if isinstance(on_device, str) and on_device != "auto":
            raise ValueError(f"data.on_device must be true, false or 'auto', got {on_device!r}")
        self.save_hyperparameters()
        self.root = Path(root).expanduser().absolute()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.val_size = val_size
        self.split_seed = split_seed
        self.train_subset = train_subset
        self.subset_seed = subset_seed
        self.download = download
        self.augment = augment
        self.flip = self.default_flip if flip is None else flip
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.on_device = on_device
        self.train_set: TensorImageDataset | None = None
        self.val_set: TensorImageDataset | None = None
        self.test_set: TensorImageDataset | None = None
        self._device_stats: tuple[Tensor, Tensor] | None = None
        self._device_train: tuple[Tensor, Tensor] | None = None  # the training set on the device
        self._train_loader = None

    # ----- what a dataset supplies ------------------------------------------------------
    def required_files(self) -> list[Path]:
        """Absolute paths of every file `setup` reads (checked before reading anything)."""
        return []

    def download_hint(self) -> str:
        """How to get the files by hand (URL and where to put them)."""
        return ""

    def download_files(self) -> None:
        """Fetch the files (torchvision does the download and the md5 checks)."""
        raise NotImplementedError(f"{type(self).__name__} cannot download its data")

    def read_split(self, train: bool) -> tuple[Tensor, Tensor]:
        """uint8 images (N, 3, 32, 32) and int64 labels (N,) of the training or test set."""
        raise NotImplementedError

    # ----- Lightning hooks --------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download when asked to; the only place that touches the network."""
        if self.download:
            self.download_files()

    def setup(self, stage: str | None = None) -> None:
        """Check that all files exist, then read the splits this stage needs (once)."""
        self.check_files()
        if stage in (None, "fit", "validate") and self.train_set is None:
            images, labels = self.read_split(train=True)
            train_idx, val_idx = self.split_indices(len(labels))
            train_idx = train_idx[self.subset_indices(labels[train_idx])]
            self.train_set = TensorImageDataset(images[train_idx], labels[train_idx])
            if len(val_idx):
                self.val_set = TensorImageDataset(images[val_idx], labels[val_idx])
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = TensorImageDataset(*self.read_split(train=False))

    def check_files(self) -> None:
        """Raise `DatasetNotFoundError` listing every expected file that is missing."""
        missing = [path for path in self.required_files() if not path.is_file()]
        if not missing:
            return
        raise DatasetNotFoundError(
            f"{self.name}: {len(missing)} file(s) missing under {self.root}: {', '.join(map(str, missing))}. "
            "Get them with data.download=true (torchvision downloads and checks them; needs internet), "
            f"by hand ({self.download_hint()}), or point data.root at the folder that already holds them."
        )

    def split_indices(self, n: int) -> tuple[Tensor, Tensor]:
        """Sorted training and validation indices from a permutation seeded by `split_seed`."""
        n_val = self.num_val_for(n)
        generator = torch.Generator().manual_seed(self.split_seed)
        perm = torch.randperm(n, generator=generator)
        return perm[n_val:].sort().values, perm[:n_val].sort().values

    def num_val_for(self, n: int) -> int:
        """Number of validation images `val_size` asks for out of `n` training images."""
        size = self.val_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
            raise ValueError(f"val_size must be a count >= 0 or a fraction in (0, 1), got {size!r}")
        if isinstance(size, float):
            if size >= 1:
                raise ValueError(f"a fractional val_size must be below 1, got {size}")
            size = round(size * n)
        if size >= n:
            raise ValueError(f"val_size {self.val_size} leaves no training images out of {n}")
        return int(size)

    def subset_indices(self, labels: Tensor) -> Tensor:
        """Sorted positions, among training images with these `labels`, of the ones that
        `train_subset` keeps (all of them by default). Each class keeps a count proportional to
        its share, the counts rounded by largest remainder so that they add up to the subset's
        size exactly, and picks its images by a permutation seeded by `subset_seed`."""
        n = len(labels)
        n_keep = self.num_subset_for(n)
        if n_keep == n:
            return torch.arange(n)
        classes, counts = labels.unique(return_counts=True)
        keep, remainders = (counts * n_keep).div(n, rounding_mode="floor"), (counts * n_keep) % n
        short = n_keep - int(keep.sum())  # one more image each for the largest remainders
        keep[torch.argsort(remainders, descending=True, stable=True)[:short]] += 1
        generator = torch.Generator().manual_seed(self.subset_seed)
        kept = []
        for cls, k in zip(classes.tolist(), keep.tolist()):
            members = (labels == cls).nonzero().squeeze(1)
            kept.append(members[torch.randperm(len(members), generator=generator)[:k]])
        return torch.cat(kept).sort().values

    def num_subset_for(self, n: int) -> int:
        """Number of training images `train_subset` keeps out of the `n` left after the
        validation split (`n` for None or 0)."""
        size = self.train_subset
        if size is None or (type(size) in (int, float) and size == 0):
            return n
        if type(size) not in (int, float) or not 0 <= size < (1 if isinstance(size, float) else n):
            raise ValueError(
                f"data.train_subset={size!r}: expected a count in 1..{n - 1} or a fraction in (0, 1) "
                f"of the {n} training images available (after any validation split); 0 or null = all"
            )
        count = round(size * n) if isinstance(size, float) else size
        if count == 0:
            raise ValueError(
                f"data.train_subset={size!r} keeps no image: {size} of the {n} training images available rounds to 0"
            )
        return count

    @property
    def has_val(self) -> bool:
        """Whether a validation split is carved from the training set."""
        return self.val_size != 0

    @property
    def num_train(self) -> int:
        """Images in the training split after the validation carve-out and `train_subset`
        (N in KL / N)."""
        if self.train_set is None:
            raise RuntimeError("num_train is known after setup('fit')")
        return len(self.train_set)

    def training_images(self, n: int, seed: int = 0) -> Tensor:
        """`n` uint8 images of the training split (all of them if it has fewer), picked by a
        permutation seeded by `seed`; e.g. to compute per-structure BatchNorm statistics."""
        if self.train_set is None:
            self.setup("fit")
        perm = torch.randperm(len(self.train_set), generator=torch.Generator().manual_seed(seed))
        return self.train_set.images[perm[:n].sort().values]

    def _loader(self, dataset: TensorImageDataset, train: bool) -> DataLoader:
        return in_memory_loader(self, dataset, train)

    def train_dataloader(self) -> DataLoader | DeviceBatches:
        device = self._training_device()
        if device is None:
            self._train_loader = self._loader(self.train_set, train=True)
            return self._train_loader
        if self._device_train is None or self._device_train[0].device != device:
            self._device_train = (self.train_set.images.to(device), self.train_set.labels.to(device))
        self._train_loader = DeviceBatches(
            *self._device_train, self._training_sampler(), self.batch_size, self.drop_last
        )
        return self._train_loader

    def _training_device(self) -> torch.device | None:
        """Where `on_device` puts the training set: the trainer's device, or None (DataLoader)."""
        trainer = self.trainer
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        wanted = device.type == "cuda" if self.on_device == "auto" else bool(self.on_device)
        return device if wanted else None

    def _training_sampler(self):
        """The order of the training batches, as the DataLoader path has it (see `DeviceBatches`)."""
        if getattr(self, "same_batches_on_every_rank", False):
            return SameOrderOnEveryRank(self.train_set)
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            kwargs = trainer.strategy.distributed_sampler_kwargs or {}
            return DistributedSampler(self.train_set, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", 0)), **kwargs)
        return EpochShuffleSampler(self.train_set)

    def val_dataloader(self) -> DataLoader | list:
        """The validation loader, or [] without a validation split (Lightning then skips it)."""
        return self._loader(self.val_set, train=False) if self.val_set is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor], dataloader_idx: int) -> tuple[Tensor, Tensor]:
        """uint8 -> normalised float on the device; augmented only while the trainer trains."""
        images, labels = batch
        training = self.trainer is not None and self.trainer.training
        if training and isinstance(self._train_loader, DeviceBatches):
            self._train_loader.consumed()
        return self.preprocess(images, train=training), labels

    def preprocess(self, images: Tensor, train: bool = False) -> Tensor:
        """uint8 (N, 3, H, W) -> [0, 1] -> (train: crop + flip) -> normalised with this
        dataset's statistics. Also usable on other data, e.g. OOD images normalised with the
        in-distribution statistics."""
        x = to_unit_range(images)
        if train and self.augment:
            x = random_crop(x, CROP_PADDING, crop_offsets(x.shape[0], CROP_PADDING, x.device))
            if self.flip:
                x = random_hflip(x, flip_draws(x.shape[0], x.device))
        return normalize(x, *self.statistics_on(x.device))

    def statistics_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """`mean` and `std` as tensors on `device`, built once: copying them from host memory
        for every batch would make the host wait for the device at each step."""
        if self._device_stats is None or self._device_stats[0].device != device:
            self._device_stats = tuple(torch.tensor(stat, device=device) for stat in (self.mean, self.std))
        return self._device_stats
