"""The OpenOOD v1.5 OOD sets (dbsn.data.ood_sets) and their configs.

Every set is written in its real on-disk layout (idx files, JPEG folders with their list files) by
`tests.support.fakedata`, small, with pixel patterns whose 32x32 version is known.
"""

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from PIL import Image

from dbsn.data import (
    DatasetNotFoundError,
    MNISTDataModule,
    Places365DataModule,
    TexturesDataModule,
    TinyImageNetDataModule,
)
from dbsn.data.base import CorruptDatasetError
from dbsn.data.ood_sets import MAX_LISTED
from tests.support.configs import compose_config
from tests.support.fakedata import (
    BLUE,
    GREEN,
    GREY,
    RED,
    dtd_images,
    solid,
    write_dtd,
    write_mnist,
    write_places365,
    write_tinyimagenet,
)


def loaded(datamodule) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of a data module's test set, through `setup("test")`."""
    datamodule.setup("test")
    return datamodule.test_set.images, datamodule.test_set.labels


def assert_colour(region: torch.Tensor, colour, tolerance: int = 8) -> None:
    """Every pixel of a uint8 (3, h, w) region within `tolerance` of `colour`, per channel."""
    target = torch.tensor(colour, dtype=torch.int16).view(3, 1, 1)
    worst = (region.to(torch.int16) - target).abs().max().item()
    assert worst <= tolerance, f"off by up to {worst} from {colour}"


# ----- MNIST ----------------------------------------------------------------------------------
def digit_images(n: int) -> np.ndarray:
    """n 28x28 grey images: black, with a bright 12x12 square in the middle whose brightness
    depends on the image (so images and their order can be told apart)."""
    images = np.zeros((n, 28, 28), dtype=np.uint8)
    for i in range(n):
        images[i, 8:20, 8:20] = 255 - 10 * i
    return images


def test_mnist_grey_digits_become_three_equal_channels_at_32(tmp_path):
    write_mnist(tmp_path, digit_images(5), np.array([7, 2, 1, 0, 4]))
    images, labels = loaded(MNISTDataModule(str(tmp_path), num_workers=0))
    assert images.dtype == torch.uint8 and images.shape == (5, 3, 32, 32)
    assert labels.dtype == torch.int64 and labels.tolist() == [7, 2, 1, 0, 4]
    assert torch.equal(images[:, 0], images[:, 1]) and torch.equal(images[:, 0], images[:, 2])  # grey -> RGB
    # 28 -> 32 scales by 8/7: the square 8..19 lands on about 9.1..22.9, the black border stays black.
    for i in range(5):
        assert (images[i, :, 11:21, 11:21] == 255 - 10 * i).all()
        assert (images[i, :, :7] == 0).all() and (images[i, :, 25:] == 0).all()
        assert (images[i, :, :, :7] == 0).all() and (images[i, :, :, 25:] == 0).all()


def test_mnist_reads_gz_archives_and_all_splits_in_order(tmp_path):
    write_mnist(tmp_path, digit_images(3), np.array([1, 2, 3]), prefix="train", gz=True)
    write_mnist(tmp_path, digit_images(5)[3:], np.array([8, 9]), prefix="t10k", gz=True)
    images, labels = loaded(MNISTDataModule(str(tmp_path), split="all", num_workers=0))
    assert labels.tolist() == [1, 2, 3, 8, 9]
    assert [int(images[i, 0, 16, 16]) for i in range(5)] == [255, 245, 235, 225, 215]
    test_only = loaded(MNISTDataModule(str(tmp_path), num_workers=0))[1]
    assert test_only.tolist() == [8, 9]


def test_mnist_seeded_subset_keeps_file_order(tmp_path):
    write_mnist(tmp_path, digit_images(10), np.arange(10))
    first = loaded(MNISTDataModule(str(tmp_path), size=4, seed=3, num_workers=0))[1]
    again = loaded(MNISTDataModule(str(tmp_path), size=4, seed=3, num_workers=0))[1]
    other = loaded(MNISTDataModule(str(tmp_path), size=4, seed=4, num_workers=0))[1]
    assert len(first) == 4 and first.tolist() == sorted(first.tolist()) and torch.equal(first, again)
    assert not torch.equal(first, other)
    with pytest.raises(ValueError, match="size=11 but MNIST has 10"):
        loaded(MNISTDataModule(str(tmp_path), size=11, num_workers=0))


def test_mnist_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(DatasetNotFoundError) as error:
        MNISTDataModule(str(tmp_path)).setup("test")
    message = str(error.value)
    raw = tmp_path / "MNIST" / "raw"
    assert str(raw / "t10k-images-idx3-ubyte") in message and str(raw / "t10k-labels-idx1-ubyte") in message
    assert "ood.mnist.download=true" in message and "t10k-images-idx3-ubyte.gz" in message
    write_mnist(tmp_path, digit_images(2), np.array([0, 1]))
    (raw / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"\x01")
    with pytest.raises(CorruptDatasetError, match="t10k-labels-idx1-ubyte: holds 1 bytes of data for a"):
        MNISTDataModule(str(tmp_path)).setup("test")


def test_sets_are_test_only(tmp_path):
    write_mnist(tmp_path, digit_images(2), np.array([0, 1]))
    with pytest.raises(ValueError, match="no training split"):
        MNISTDataModule(str(tmp_path)).setup("fit")


def test_textures_all_images_shorter_side_to_32_then_centre_crop(tmp_path):
    write_dtd(tmp_path, dtd_images())
    dm = TexturesDataModule(str(tmp_path), num_workers=0)
    images, labels = loaded(dm)
    # "all" = train1 + val1 + test1: written round-robin, read list by list.
    order = [
        "banded/banded_0001.jpg",
        "grid/grid_0002.jpg",
        "banded/banded_0002.jpg",
        "zigzagged/zigzagged_0001.jpg",
        "grid/grid_0001.jpg",
        "zigzagged/zigzagged_0002.jpg",
    ]
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.tolist() == [{"banded": 0, "grid": 1, "zigzagged": 2}[name.split("/")[0]] for name in order]
    # 40x80 bands: width to 32, height to 64 (red 0-15, green 16-47, blue 48-63); the centre crop
    # keeps rows 16-47: green. Squashing to 32x32 instead would keep red at the top, blue at the bottom.
    assert_colour(images[0][:, 1:31], GREEN)
    # 90x33 red: height to 32, the centre crop cuts the sides; solid colours stay solid.
    assert_colour(images[1], RED)
    assert_colour(images[2], BLUE)
    assert_colour(images[3], GREY)
    # A grey JPEG: three equal channels, its dark left and bright right halves kept.
    assert torch.equal(images[4][0], images[4][1]) and torch.equal(images[4][0], images[4][2])
    assert_colour(images[4][:, :, :14], (100, 100, 100))
    assert_colour(images[4][:, :, 18:], (200, 200, 200))


def test_textures_pixels_are_exactly_openoods_test_transform(tmp_path):
    """The same uint8 pixels as OpenOOD v1.5's CIFAR `TestStandardPreProcessor` before Normalize
    (openood/evaluation_api/preprocessor.py), on a non-square noisy image."""
    import torchvision.transforms as tvs_trans

    rng = np.random.default_rng(0)
    write_dtd(tmp_path, {"noisy/noisy_0001.jpg": rng.integers(0, 256, (57, 83, 3), dtype=np.uint8)})
    openood = tvs_trans.Compose(
        [
            tvs_trans.Resize(32, interpolation=tvs_trans.InterpolationMode.BILINEAR),
            tvs_trans.CenterCrop(32),
            tvs_trans.ToTensor(),
        ]
    )
    with Image.open(tmp_path / "dtd/dtd/images/noisy/noisy_0001.jpg") as image:
        expected = openood(image.convert("RGB"))
    images, _ = loaded(TexturesDataModule(str(tmp_path), num_workers=0))
    assert torch.equal(images[0].float() / 255, expected)


def test_textures_split_and_missing_files(tmp_path):
    with pytest.raises(DatasetNotFoundError) as error:
        TexturesDataModule(str(tmp_path)).setup("test")
    for split in ("train", "val", "test"):
        assert str(tmp_path / "dtd" / "dtd" / "labels" / f"{split}1.txt") in str(error.value)
    write_dtd(tmp_path, dtd_images())
    assert len(loaded(TexturesDataModule(str(tmp_path), split="val", num_workers=0))[1]) == 2
    missing = tmp_path / "dtd/dtd/images/grid/grid_0001.jpg"
    missing.unlink()
    with pytest.raises(DatasetNotFoundError, match="1 file") as error:
        TexturesDataModule(str(tmp_path)).setup("test")
    assert str(missing) in str(error.value) and "ood.textures.download=true" in str(error.value)


def test_corrupt_image_is_named(tmp_path):
    write_dtd(tmp_path, dtd_images())
    broken = tmp_path / "dtd/dtd/images/grid/grid_0002.jpg"
    broken.write_bytes(broken.read_bytes()[:40])
    with pytest.raises(CorruptDatasetError, match="grid_0002.jpg: cannot be decoded"):
        TexturesDataModule(str(tmp_path), num_workers=0).setup("test")


# ----- Places365 ------------------------------------------------------------------------------
def quadrants(size: int) -> np.ndarray:
    """A square image: red, green / blue, grey quadrants."""
    half = size // 2
    top = np.concatenate([solid(half, half, RED), solid(half, half, GREEN)], axis=1)
    bottom = np.concatenate([solid(half, half, BLUE), solid(half, half, GREY)], axis=1)
    return np.concatenate([top, bottom])


def test_places365_val_256_images_to_32(tmp_path):
    write_places365(tmp_path, [quadrants(256), solid(256, 256, BLUE), quadrants(256)[::-1].copy()], [5, 364, 0])
    images, labels = loaded(Places365DataModule(str(tmp_path), num_workers=0))
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.tolist() == [5, 364, 0]
    # 256 -> 32: each quadrant is 16x16; away from the edges between them, its colour.
    assert_colour(images[0][:, :14, :14], RED)
    assert_colour(images[0][:, :14, 18:], GREEN)
    assert_colour(images[0][:, 18:, :14], BLUE)
    assert_colour(images[0][:, 18:, 18:], GREY)
    assert_colour(images[1], BLUE)
    assert_colour(images[2][:, :14, :14], BLUE)  # flipped upside down


def test_places365_subset_and_exclusion(tmp_path):
    colours = [(10 * i, 255 - 10 * i, 100) for i in range(8)]
    write_places365(tmp_path, [solid(256, 256, c) for c in colours], list(range(8)))
    full, _ = loaded(Places365DataModule(str(tmp_path), num_workers=0))
    dm = Places365DataModule(str(tmp_path), size=3, seed=1, num_workers=0)
    images, labels = loaded(dm)
    assert len(labels) == 3 and labels.tolist() == sorted(labels.tolist())
    assert torch.equal(images, full[labels])  # the subset is those images of the whole set
    exclude = tmp_path / "exclude.txt"
    exclude.write_text("# overlapping\nPlaces365_val_00000002.jpg\nval_256/Places365_val_00000005.jpg 4\n\n")
    (tmp_path / "val_256" / "Places365_val_00000005.jpg").unlink()  # excluded images need not exist
    dm = Places365DataModule(str(tmp_path), exclude=str(exclude), num_workers=0)
    assert loaded(dm)[1].tolist() == [0, 2, 3, 5, 6, 7] and dm.excluded == 2


def test_places365_missing_files_are_named_and_listed_briefly(tmp_path):
    with pytest.raises(DatasetNotFoundError) as error:
        Places365DataModule(str(tmp_path)).setup("test")
    assert str(tmp_path / "places365_val.txt") in str(error.value)
    assert "val_256.tar" in str(error.value) and "ood.places365.download=true" in str(error.value)
    n = MAX_LISTED + 7
    (tmp_path / "places365_val.txt").write_text("".join(f"Places365_val_{i:08d}.jpg 0\n" for i in range(1, n + 1)))
    with pytest.raises(DatasetNotFoundError, match=f"{n} file") as error:
        Places365DataModule(str(tmp_path)).setup("test")
    message = str(error.value)
    assert str(tmp_path / "val_256" / "Places365_val_00000001.jpg") in message
    assert f"Places365_val_{n:08d}.jpg" not in message and "... and 7 more" in message
    with pytest.raises(DatasetNotFoundError, match="nope.txt"):
        Places365DataModule(str(tmp_path), exclude=str(tmp_path / "nope.txt")).setup("test")


# ----- TinyImageNet ---------------------------------------------------------------------------
def test_tinyimagenet_val_64_to_32(tmp_path):
    halves = np.concatenate([solid(64, 32, RED), solid(64, 32, BLUE)], axis=1)
    write_tinyimagenet(tmp_path, [halves, solid(64, 64, GREEN), halves], ["n09999999", "n01443537", "n01443537"])
    dm = TinyImageNetDataModule(str(tmp_path), num_workers=0)
    images, labels = loaded(dm)
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.tolist() == [1, 0, 0]  # index among the sorted wnids
    assert_colour(images[0][:, :, :15], RED)
    assert_colour(images[0][:, :, 17:], BLUE)
    assert_colour(images[1], GREEN)
    batch, batch_labels = next(iter(dm.test_dataloader()))  # what the OOD evaluation iterates
    assert batch.dtype == torch.uint8 and torch.equal(batch, images) and torch.equal(batch_labels, labels)
    first = dm.test_set
    dm.setup("test")
    assert dm.test_set is first  # decoded once


def test_tinyimagenet_exclusion_list(tmp_path):
    write_tinyimagenet(tmp_path, [solid(64, 64, (20 * i, 0, 0)) for i in range(5)], ["n0"] * 5)
    exclude = tmp_path / "overlap.txt"
    exclude.write_text("val_1.JPEG\ntin/val/images/val_3.JPEG -1\n")
    dm = TinyImageNetDataModule(str(tmp_path), exclude=str(exclude), num_workers=0)
    images, _ = loaded(dm)
    assert dm.excluded == 2 and [int(images[i, 0, 16, 16]) for i in range(3)] == pytest.approx([0, 40, 80], abs=3)


def test_tinyimagenet_missing_files_and_no_downloader(tmp_path):
    dm = TinyImageNetDataModule(str(tmp_path))
    with pytest.raises(DatasetNotFoundError) as error:
        dm.setup("test")
    message = str(error.value)
    assert str(tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt") in message
    assert "http://cs231n.stanford.edu/tiny-imagenet-200.zip" in message and "download=true" not in message
    with pytest.raises(NotImplementedError, match="tiny-imagenet-200.zip"):
        TinyImageNetDataModule(str(tmp_path), download=True).prepare_data()


# ----- configs --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("mnist", MNISTDataModule),
        ("textures", TexturesDataModule),
        ("places365", Places365DataModule),
        ("tinyimagenet", TinyImageNetDataModule),
    ],
)
def test_each_set_composes_by_name(tmp_path, name, cls):
    cfg = compose_config("evaluate", ["ckpt_path=x", f"ood={name}", f"paths.data_dir={tmp_path}"], tmp_path)
    assert list(cfg.ood) == [name]
    dm = instantiate(cfg.ood[name])
    assert type(dm) is cls and dm.root == tmp_path and dm.config_name == name and dm.size is None
