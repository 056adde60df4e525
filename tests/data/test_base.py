"""The classification data modules (dbsn.data.base) on the real on-disk formats (written by
`tests.support.fakedata`): reading, validation split and training subset, missing and corrupt
files, batches normalised and augmented after the transfer, the configs and a Trainer; the
samplers' orders; and `data.on_device`.

data.on_device: the training set on the accelerator, batches gathered and augmented there.
The same batches as the DataLoader path (one device, structure-parallel ranks, data-parallel
shards), every epoch a permutation, the paper's augmentation drawn uniformly and equal to
torchvision's transforms given the same draws, and a run resumed mid-epoch continues the order.
On a CPU `on_device=true` puts the set in host memory: the same code path as on a GPU, minus the
copy.
"""

from __future__ import annotations

import inspect
import pickle
import types

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.utilities.data import _update_dataloader
from omegaconf import OmegaConf
from scipy.stats import chisquare
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dbsn.data import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    CorruptDatasetError,
    DatasetNotFoundError,
    DigitsDataModule,
    ImageClassificationDataModule,
    SVHNDataModule,
    TensorImageDataset,
)
from dbsn.data import base as data_base
from dbsn.data.augment import crop_offsets, flip_draws, normalize
from dbsn.data.base import CROP_PADDING, DeviceBatches, EpochShuffleSampler, SameOrderOnEveryRank, in_memory_loader
from tests.support.configs import CONF
from tests.support.fakedata import fake_images, image_keys, write_cifar10, write_cifar100, write_svhn

DATA_CONF = CONF / "data"


# dataset -> (DataModule, writer, files relative to root)
CIFAR10_FILES = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)] + ["cifar-10-batches-py/test_batch"]
DATASETS = {
    "cifar10": (CIFAR10DataModule, write_cifar10, CIFAR10_FILES),
    "cifar100": (CIFAR100DataModule, write_cifar100, ["cifar-100-python/train", "cifar-100-python/test"]),
    "svhn": (SVHNDataModule, write_svhn, ["train_32x32.mat", "test_32x32.mat"]),
}
N_TRAIN, N_TEST = 120, 30


@pytest.fixture(params=list(DATASETS))
def written(request, tmp_path):
    module_class, writer, files = DATASETS[request.param]
    writer(tmp_path, n_train=N_TRAIN, n_test=N_TEST, seed=0)
    return request.param, module_class, tmp_path, files


# ----- reading the files ----------------------------------------------------------------
def test_reads_written_files(written):
    name, module_class, root, _ = written
    dm = module_class(root=str(root), num_workers=0)
    dm.setup()
    num_classes = 100 if name == "cifar100" else 10
    assert dm.num_classes == num_classes
    for dataset, n, seed in ((dm.train_set, N_TRAIN, 0), (dm.test_set, N_TEST, 1)):
        assert dataset.images.shape == (n, 3, 32, 32) and dataset.images.dtype == torch.uint8
        assert dataset.labels.shape == (n,) and dataset.labels.dtype == torch.int64
        # Pixels and labels as written (SVHN stores the digit 0 as 10 on disk).
        images, labels = fake_images(n, num_classes, seed)
        assert torch.equal(dataset.images, torch.from_numpy(images))
        assert torch.equal(dataset.labels, torch.from_numpy(labels))
        assert 0 <= dataset.labels.min() and dataset.labels.max() < num_classes
    assert dm.val_set is None and not dm.has_val and dm.num_train == N_TRAIN


@pytest.mark.parametrize("val_size, n_val", [(20, 20), (0.25, 30)])
def test_val_split_sizes_deterministic_and_disjoint(written, val_size, n_val):
    _, module_class, root, _ = written
    dm = module_class(root=str(root), val_size=val_size, split_seed=3)
    dm.setup("fit")
    assert dm.has_val and len(dm.val_set) == n_val and dm.num_train == N_TRAIN - n_val
    assert dm.test_set is None  # fitting does not read the test set
    train, val = image_keys(dm.train_set.images), image_keys(dm.val_set.images)
    assert not train & val and len(train | val) == N_TRAIN
    again = module_class(root=str(root), val_size=val_size, split_seed=3)
    again.setup("fit")
    assert torch.equal(again.val_set.images, dm.val_set.images)
    assert torch.equal(again.val_set.labels, dm.val_set.labels)
    other = module_class(root=str(root), val_size=val_size, split_seed=4)
    other.setup("fit")
    assert image_keys(other.val_set.images) != val


@pytest.mark.parametrize("val_size", [-1, 1.0, 120, "10", True])
def test_bad_val_size_is_rejected(tmp_path, val_size):
    write_cifar10(tmp_path, n_train=120, n_test=10)
    with pytest.raises(ValueError, match="val_size"):
        CIFAR10DataModule(root=str(tmp_path), val_size=val_size).setup("fit")


@pytest.fixture(params=[*DATASETS, "digits"])
def any_data(request, tmp_path):
    """Makes data modules of each dataset: CIFAR-10/100 and SVHN on written files (equal class
    shares), digits (unequal ones)."""
    if request.param == "digits":
        return lambda **kwargs: DigitsDataModule(num_workers=0, **kwargs)
    module_class, writer, _ = DATASETS[request.param]
    writer(tmp_path, n_train=N_TRAIN, n_test=N_TEST, seed=0)
    return lambda **kwargs: module_class(root=str(tmp_path), num_workers=0, **kwargs)


@pytest.mark.parametrize("fraction", [False, True])
def test_train_subset_is_exact_stratified_and_seeded(any_data, fraction):
    full = any_data()
    full.setup("fit")
    n = full.num_train
    size = 0.3 if fraction else n // 3
    n_keep = round(0.3 * n) if fraction else n // 3
    dm = any_data(train_subset=size, subset_seed=1)
    dm.setup("fit")
    assert dm.num_train == len(dm.train_set) == n_keep
    assert image_keys(dm.train_set.images) <= image_keys(full.train_set.images)
    # Each class keeps its share of the subset, to within one image (largest-remainder rounding).
    num_classes = full.num_classes
    shares = torch.bincount(full.train_set.labels, minlength=num_classes).double() * n_keep / n
    kept = torch.bincount(dm.train_set.labels, minlength=num_classes).double()
    assert (kept - shares).abs().max() < 1
    # The same images for the same seed; other images for another seed.
    again = any_data(train_subset=size, subset_seed=1)
    again.setup("fit")
    assert torch.equal(again.train_set.images, dm.train_set.images)
    assert torch.equal(again.train_set.labels, dm.train_set.labels)
    other = any_data(train_subset=size, subset_seed=2)
    other.setup("fit")
    assert image_keys(other.train_set.images) != image_keys(dm.train_set.images)


def test_train_subset_is_drawn_after_the_validation_split_and_leaves_val_and_test_alone(any_data):
    whole = any_data(val_size=0.2, split_seed=3)
    whole.setup()
    dm = any_data(val_size=0.2, split_seed=3, train_subset=25)
    dm.setup()
    assert dm.num_train == 25
    assert torch.equal(dm.val_set.images, whole.val_set.images) and torch.equal(
        dm.test_set.images, whole.test_set.images
    )
    train = image_keys(dm.train_set.images)
    assert train <= image_keys(whole.train_set.images) and not train & image_keys(dm.val_set.images)


@pytest.mark.parametrize("train_subset", [None, 0, 0.0])
def test_no_train_subset_keeps_every_training_image(tmp_path, train_subset):
    write_cifar10(tmp_path, n_train=120, n_test=10)
    dm = CIFAR10DataModule(root=str(tmp_path), train_subset=train_subset, val_size=20)
    dm.setup("fit")
    assert dm.num_train == 100


@pytest.mark.parametrize("train_subset", [-1, 100, 101, 1.0, 1.5, -0.5, 0.001, True, "10", float("nan")])
def test_bad_train_subset_is_refused_naming_the_option_and_the_images_available(tmp_path, train_subset):
    write_cifar10(tmp_path, n_train=120, n_test=10)
    dm = CIFAR10DataModule(root=str(tmp_path), train_subset=train_subset, val_size=20)
    with pytest.raises(ValueError) as error:
        dm.setup("fit")
    message = str(error.value)
    assert f"data.train_subset={train_subset!r}" in message and "100 training images available" in message
    assert dm.train_set is None  # refused before anything was built on it


def test_num_train_needs_setup():
    with pytest.raises(RuntimeError, match="setup"):
        CIFAR10DataModule(root="nowhere").num_train


# ----- missing and corrupt files --------------------------------------------------------
@pytest.mark.parametrize("name", list(DATASETS))
def test_missing_root_lists_every_expected_file(tmp_path, name):
    module_class, _, files = DATASETS[name]
    root = tmp_path / "absent"
    with pytest.raises(DatasetNotFoundError) as error:
        module_class(root=str(root)).setup("test")
    message = str(error.value)
    assert isinstance(error.value, FileNotFoundError)
    for file in files:
        assert str((root / file).absolute()) in message
    assert "data.download=true" in message and "http" in message


def test_missing_single_file_is_named(written):
    _, module_class, root, files = written
    (root / files[-1]).unlink()
    with pytest.raises(DatasetNotFoundError) as error:
        module_class(root=str(root)).setup("fit")  # the test file is checked before training
    message = str(error.value)
    assert str(root / files[-1]) in message and "1 file(s) missing" in message
    assert all(str(root / file) not in message for file in files[:-1])
    assert "download" in message


def test_truncated_file_is_named(written):
    _, module_class, root, files = written
    path = root / files[0]
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CorruptDatasetError, match=str(path)):
        module_class(root=str(root)).setup("fit")


# ----- batches on the device ------------------------------------------------------------
def fake_trainer(dm: ImageClassificationDataModule, training: bool) -> None:
    dm.trainer = types.SimpleNamespace(training=training)


ALL_MODULES = [CIFAR10DataModule, CIFAR100DataModule, SVHNDataModule, DigitsDataModule]


@pytest.mark.parametrize("module_class", ALL_MODULES)
def test_constant_image_is_normalised_with_dataset_statistics(module_class):
    dm = module_class(root="unused")
    value = torch.tensor([10, 128, 250], dtype=torch.uint8)
    images = value.view(1, 3, 1, 1).expand(2, 3, 32, 32)
    for training in (False, True):  # a constant image is unchanged by crops (inside) and flips
        fake_trainer(dm, training)
        x, labels = dm.on_after_batch_transfer((images, torch.tensor([1, 2])), 0)
        expected = (value.float() / 255 - torch.tensor(dm.mean)) / torch.tensor(dm.std)
        assert x.dtype == torch.float32 and torch.equal(labels, torch.tensor([1, 2]))
        torch.testing.assert_close(x[:, :, 8:24, 8:24].mean(dim=(0, 2, 3)), expected)
        torch.testing.assert_close(x[:, :, 8:24, 8:24].std(dim=(0, 2, 3)), torch.zeros(3), atol=1e-6, rtol=0)


def test_augmentation_only_while_training():
    dm = CIFAR10DataModule(root="unused")
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    plain = normalize(images.float() / 255, dm.mean, dm.std)
    for trainer in (None, types.SimpleNamespace(training=False)):
        dm.trainer = trainer
        torch.testing.assert_close(dm.on_after_batch_transfer((images, torch.zeros(16)), 0)[0], plain)
    fake_trainer(dm, training=True)
    torch.manual_seed(0)
    augmented = dm.on_after_batch_transfer((images, torch.zeros(16)), 0)[0]
    assert augmented.shape == plain.shape and not torch.allclose(augmented, plain)
    dm_off = CIFAR10DataModule(root="unused", augment=False)
    fake_trainer(dm_off, training=True)
    torch.testing.assert_close(dm_off.on_after_batch_transfer((images, torch.zeros(16)), 0)[0], plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_preprocessing_does_not_synchronise_cuda():
    dm = CIFAR10DataModule(root="unused")
    fake_trainer(dm, training=True)
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, device="cuda")
    dm.on_after_batch_transfer((images, images[:, 0, 0, 0]), 0)  # builds the cached statistics
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, _ = dm.on_after_batch_transfer((images, images[:, 0, 0, 0]), 0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.device.type == "cuda" and x.dtype == torch.float32


@pytest.mark.parametrize("module_class, flips", zip(ALL_MODULES, [True, True, False, False]))
def test_flip_defaults(monkeypatch, module_class, flips):
    calls = []
    monkeypatch.setattr(data_base, "random_hflip", lambda x, flip=None: calls.append(1) or x)
    dm = module_class(root="unused")
    fake_trainer(dm, training=True)
    dm.on_after_batch_transfer((torch.zeros(4, 3, 32, 32, dtype=torch.uint8), torch.zeros(4)), 0)
    assert dm.flip is flips and bool(calls) is flips
    assert module_class(root="unused", flip=not flips).flip is (not flips)


def test_loader_gathers_whole_batches(tmp_path, monkeypatch):
    write_cifar10(tmp_path, n_train=100, n_test=10)
    dm = CIFAR10DataModule(root=str(tmp_path), batch_size=32, num_workers=0)
    dm.setup("fit")
    monkeypatch.setattr(TensorImageDataset, "__getitem__", lambda *a: pytest.fail("per-sample indexing"))
    batches = list(dm.train_dataloader())
    assert len(batches) == 3  # drop_last
    images, labels = batches[0]
    assert images.shape == (32, 3, 32, 32) and images.dtype == torch.uint8 and labels.dtype == torch.int64
    seen = torch.cat([b[1] for b in batches])
    assert len(seen) == 96 and not torch.equal(seen, dm.train_set.labels[:96])  # shuffled
    assert pickle.loads(pickle.dumps(dm.train_dataloader().collate_fn)) is not None


# ----- configs and a Trainer ------------------------------------------------------------
@pytest.mark.parametrize("name", ["cifar10", "cifar100", "svhn", "digits"])
def test_config_instantiates_with_every_constructor_key(tmp_path, name):
    data = OmegaConf.load(DATA_CONF / f"{name}.yaml")
    cfg = OmegaConf.merge({"paths": {"data_dir": str(tmp_path)}}, {"data": data})
    dm = instantiate(cfg.data)
    assert isinstance(dm, ImageClassificationDataModule) and dm.root == tmp_path
    params = set(inspect.signature(ImageClassificationDataModule.__init__).parameters) - {"self"}
    assert set(cfg.data) - {"_target_"} == params


class TinyClassifier(L.LightningModule):
    def __init__(self, num_classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes)
        )
        self.val_batches = 0
        self.test_batches = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert x.dtype == torch.float32
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def test_step(self, batch, batch_idx):
        self.test_batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("val_size", [0, 40])
def test_trainer_runs_with_and_without_validation(tmp_path, val_size):
    write_cifar10(tmp_path, n_train=200, n_test=20)
    dm = CIFAR10DataModule(root=str(tmp_path), batch_size=16, val_size=val_size, num_workers=1)
    model = TinyClassifier(dm.num_classes)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        val_check_interval=2,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    assert model.val_batches == (2 if val_size else 0)  # one validation run after step 2
    trainer.test(model, datamodule=dm, verbose=False)
    assert model.test_batches == 2  # 20 test images, eval batches of 16, last one kept


# ----- samplers ------------------------------------------------------------------------


def test_same_order_on_every_rank_is_the_single_device_order():
    data = list(range(37))
    single, shared = EpochShuffleSampler(data, seed=5), SameOrderOnEveryRank(data, seed=5)
    for epoch in (0, 3):
        single.set_epoch(epoch)
        shared.set_epoch(epoch)
        assert list(shared) == list(single) and sorted(shared) == data
    assert isinstance(shared, torch.utils.data.DistributedSampler)  # Lightning keeps it as it is


def test_epoch_shuffle_depends_only_on_seed_and_epoch():
    data = TensorDataset(torch.arange(50))
    sampler = EpochShuffleSampler(data, seed=7)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert all(sorted(o) == list(range(50)) for o in orders)  # permutations
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch
    fresh = EpochShuffleSampler(data, seed=7)
    fresh.set_epoch(2)
    assert list(fresh) == orders[2]  # a fresh sampler (a resumed run) at epoch 2: the same order
    assert list(fresh) == orders[2]  # iterating again does not advance anything
    other = EpochShuffleSampler(data, seed=8)
    other.set_epoch(2)
    assert list(other) != orders[2]

    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = DataLoader(data, batch_size=10, sampler=sampler, generator=torch.Generator().manual_seed(1))
    batches = [b[0].tolist() for b in loader]
    assert sum(batches, []) == orders[2]
    assert torch.equal(torch.get_rng_state(), before)  # the global random state is left alone
    assert EpochShuffleSampler(data).seed == 0  # defaults to the run's seed (torch.initial_seed())


# ----- data.on_device ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cifar_root(cifar10_files):
    return cifar10_files(n_train=100, n_test=10, seed=0)


def _module(root, **kwargs) -> CIFAR10DataModule:
    dm = CIFAR10DataModule(root=str(root), batch_size=16, num_workers=0, **kwargs)
    dm.setup("fit")
    return dm


def _indexed(dm: CIFAR10DataModule) -> None:
    """Label i on training image i: a batch's labels say which images it holds."""
    dm.train_set.labels = torch.arange(len(dm.train_set))


def _epoch(loader, epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [labels.tolist() for _, labels in loader]


def test_on_device_yields_the_dataloaders_batches(cifar_root):
    dm = _module(cifar_root, on_device=True)
    _indexed(dm)
    device_loader = dm.train_dataloader()
    assert isinstance(device_loader, DeviceBatches)
    reference = in_memory_loader(dm, dm.train_set, train=True)
    for epoch in range(3):
        batches = _epoch(device_loader, epoch)
        assert batches == _epoch(reference, epoch)
        assert len(batches) == len(reference) == 100 // 16  # drop_last, as the DataLoader
    images, labels = next(iter(device_loader))
    assert torch.equal(images, dm.train_set.images[labels])  # the images that go with the labels


def test_every_epoch_is_a_permutation(cifar_root):
    dm = _module(cifar_root, on_device=True, drop_last=False)
    _indexed(dm)
    loader = dm.train_dataloader()
    orders = []
    for epoch in range(4):
        order = [i for batch in _epoch(loader, epoch) for i in batch]
        assert sorted(order) == list(range(100))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 4  # a new order every epoch


def test_structure_parallel_ranks_see_the_same_batches(cifar_root):
    dm = _module(cifar_root, on_device=True)
    _indexed(dm)
    dm.same_batches_on_every_rank = True
    reference = in_memory_loader(dm, dm.train_set, train=True)  # SameOrderOnEveryRank
    ranks = []
    for rank in range(2):
        dm.trainer = types.SimpleNamespace(
            world_size=2,
            strategy=types.SimpleNamespace(
                root_device=torch.device("cpu"), distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}
            ),
        )
        ranks.append(_epoch(dm.train_dataloader(), 1))
    assert ranks[0] == ranks[1] == _epoch(reference, 1)


def test_data_parallel_ranks_see_lightnings_disjoint_shards(cifar_root, monkeypatch):
    """Each rank iterates the `DistributedSampler` Lightning would put in the DataLoader (same
    seed, same shard): together the ranks see every image once per epoch."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    dm = _module(cifar_root, on_device=True, drop_last=False)
    _indexed(dm)
    shards = []
    for rank in range(2):
        kwargs = {"num_replicas": 2, "rank": rank}
        dm.trainer = types.SimpleNamespace(
            world_size=2,
            strategy=types.SimpleNamespace(root_device=torch.device("cpu"), distributed_sampler_kwargs=kwargs),
        )
        loader = in_memory_loader(dm, dm.train_set, train=True)
        lightning_loader = _update_dataloader(loader, _get_distributed_sampler(loader, True, 0, **kwargs))
        shard = _epoch(dm.train_dataloader(), 2)
        assert shard == _epoch(lightning_loader, 2)
        shards.append([i for batch in shard for i in batch])
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == list(range(100))


# ---------------------------------------------------------------------- augmentation
def _coordinate_images(n: int) -> torch.Tensor:
    """Channel 0 holds the row (1..32), channel 1 the column (1..32): a crop's offset and a
    flip can be read back from the augmented image."""
    rows = torch.arange(1, 33).view(32, 1).expand(32, 32)
    image = torch.stack([rows, rows.t(), torch.zeros(32, 32, dtype=torch.long)]).to(torch.uint8)
    return image.expand(n, 3, 32, 32).contiguous()


def _read_back(dm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top, left, flipped) of each augmented coordinate image."""
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    v = ((x * std + mean) * 255).round().long()
    row, col, right = v[:, 0, 16, 16], v[:, 1, 16, 16], v[:, 1, 16, 17]
    flipped = right < col
    # output pixel (16, 16) is padded pixel (16 + top, 16 + left), original row 12 + top (1-based 13 + top)
    top = row - 13
    left = torch.where(flipped, col - 12, col - 13)  # after a flip, pixel 16 shows the crop's column 15
    return top, left, flipped


def _joint_counts(top, left, flipped) -> torch.Tensor:
    side = 2 * CROP_PADDING + 1
    cell = (top * side + left) * 2 + flipped.long()
    return torch.bincount(cell, minlength=side * side * 2)


def test_crop_offsets_and_flips_are_uniform(cifar_root):
    """Chi-square test of the joint (top, left, flip) of 40,000 training augmentations over its
    9 x 9 x 2 outcomes; the same test rejects a crop that never reaches the last offset."""
    dm = _module(cifar_root, on_device=True)
    dm.trainer = types.SimpleNamespace(training=True)
    torch.manual_seed(0)
    x, _ = dm.on_after_batch_transfer((_coordinate_images(40_000), torch.zeros(40_000)), 0)
    top, left, flipped = _read_back(dm, x)
    assert top.min() == left.min() == 0 and top.max() == left.max() == 2 * CROP_PADDING
    counts = _joint_counts(top, left, flipped)
    assert chisquare(counts.numpy()).pvalue > 1e-3, counts
    biased = _joint_counts(top.clamp(max=2 * CROP_PADDING - 1), left, flipped)
    assert chisquare(biased.numpy()).pvalue < 1e-6


def test_a_batch_equals_torchvisions_transforms_given_the_same_draws(cifar_root):
    """The batched crop + flip + normalisation against torchvision's per-image `pad`, `crop`,
    `horizontal_flip`, `to_dtype` and `normalize` with the offsets and flips drawn from the same
    seed."""
    dm = _module(cifar_root, on_device=True)
    dm.trainer = types.SimpleNamespace(training=True)
    images = dm.train_set.images[:32]
    torch.manual_seed(3)
    offsets, flips = crop_offsets(32, CROP_PADDING), flip_draws(32)
    torch.manual_seed(3)
    batch, _ = dm.on_after_batch_transfer((images, torch.zeros(32)), 0)
    assert flips.any() and not flips.all() and len(set(map(tuple, offsets.tolist()))) > 10
    for i in range(32):
        reference = TF.crop(TF.pad(images[i], [CROP_PADDING], fill=0), int(offsets[i, 0]), int(offsets[i, 1]), 32, 32)
        if flips[i]:
            reference = TF.horizontal_flip(reference)
        reference = TF.normalize(TF.to_dtype(reference, torch.float32, scale=True), list(dm.mean), list(dm.std))
        torch.testing.assert_close(batch[i], reference, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- resume
class _Recorder(pl.LightningModule):
    """A linear model that records the images (by label) of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3 * 32 * 32, 2)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, labels = batch
        self.seen.append(labels.tolist())
        return self.layer(x.flatten(1)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _fit(dm, tmp_path, **kwargs) -> list[list[int]]:
    model = _Recorder()
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


def test_a_run_resumed_mid_epoch_continues_the_same_order(cifar_root, tmp_path):
    """A run stopped after 8 steps (epoch 1, batch 2 of 6) and resumed from that step's
    checkpoint trains on exactly the batches of the uninterrupted run, in its order."""

    def data():
        torch.manual_seed(0)  # the samplers' seed
        dm = CIFAR10DataModule(root=str(cifar_root), batch_size=16, num_workers=0, on_device=True)
        dm.setup("fit")
        _indexed(dm)
        return dm

    whole = _fit(data(), tmp_path / "whole", max_epochs=3)
    assert len(whole) == 18
    stop = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    first = _fit(data(), tmp_path / "first", max_epochs=3, max_steps=8, callbacks=[stop])
    checkpoint = tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    assert torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 1, "batches": 2}
    ]
    rest = _fit(data(), tmp_path / "rest", max_epochs=3, ckpt_path=checkpoint)
    assert first + rest == whole
    assert first[6:] != whole[:2]  # epochs differ, so the check sees a restart of the epoch
