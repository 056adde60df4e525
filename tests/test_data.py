"""DataModules read the real on-disk formats (written by `fakedata`), split, augment and load."""

import inspect
import pickle
import types
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import scipy.io
import torch
import torch.nn.functional as F
from fakedata import fake_images, write_cifar10, write_cifar100, write_svhn
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torchvision.transforms import functional as TF

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
from dbsn.data.augment import normalize, random_crop, random_hflip

CONF_DIR = Path(__file__).parents[1] / "conf" / "data"

# dataset -> (DataModule, writer, files relative to root)
CIFAR10_FILES = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)] + ["cifar-10-batches-py/test_batch"]
DATASETS = {
    "cifar10": (CIFAR10DataModule, write_cifar10, CIFAR10_FILES),
    "cifar100": (CIFAR100DataModule, write_cifar100, ["cifar-100-python/train", "cifar-100-python/test"]),
    "svhn": (SVHNDataModule, write_svhn, ["train_32x32.mat", "test_32x32.mat"]),
}
N_TRAIN, N_TEST = 120, 30


def image_keys(images: torch.Tensor) -> set[bytes]:
    return {image.numpy().tobytes() for image in images}


@pytest.fixture(params=list(DATASETS))
def written(request, tmp_path):
    module_class, writer, files = DATASETS[request.param]
    writer(tmp_path, n_train=N_TRAIN, n_test=N_TEST, seed=0)
    return request.param, module_class, tmp_path, files


# ----- augmentation ---------------------------------------------------------------------
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


def test_svhn_maps_label_10_to_0(tmp_path):
    write_svhn(tmp_path, n_train=40, n_test=20)
    on_disk = scipy.io.loadmat(tmp_path / "test_32x32.mat")["y"].ravel()
    assert set(on_disk) == set(range(1, 11))
    dm = SVHNDataModule(root=str(tmp_path))
    dm.setup("test")
    expected = np.where(on_disk == 10, 0, on_disk).astype(np.int64)
    assert torch.equal(dm.test_set.labels, torch.from_numpy(expected))


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
    assert torch.equal(dm.val_set.images, whole.val_set.images) and torch.equal(dm.test_set.images, whole.test_set.images)
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


def test_wrong_cifar_shapes_are_rejected(tmp_path):
    write_cifar10(tmp_path, n_train=50, n_test=10)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((10, 1024), np.uint8), b"labels": [0] * 10}, f, protocol=2)
    with pytest.raises(CorruptDatasetError, match=rf"{path}.*\(N, 3072\)"):
        CIFAR10DataModule(root=str(tmp_path)).setup("fit")
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((10, 3072), np.uint8), b"labels": [0] * 9}, f, protocol=2)
    with pytest.raises(CorruptDatasetError, match=str(path)):
        CIFAR10DataModule(root=str(tmp_path)).setup("fit")


def test_pickle_with_foreign_objects_is_refused(tmp_path):
    write_cifar10(tmp_path, n_train=50, n_test=10)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    with open(path, "wb") as f:
        pickle.dump({b"data": types.SimpleNamespace()}, f, protocol=2)
    with pytest.raises(CorruptDatasetError, match="unexpected object types.SimpleNamespace"):
        CIFAR10DataModule(root=str(tmp_path)).setup("test")


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


# ----- digits ---------------------------------------------------------------------------
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


# ----- configs and a Trainer ------------------------------------------------------------
@pytest.mark.parametrize("name", ["cifar10", "cifar100", "svhn", "digits"])
def test_config_instantiates_with_every_constructor_key(tmp_path, name):
    data = OmegaConf.load(CONF_DIR / f"{name}.yaml")
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
