"""data.on_device: the training set on the accelerator, batches gathered and augmented there.

The same batches as the DataLoader path (one device, structure-parallel ranks, data-parallel
shards), every epoch a permutation, the paper's augmentation drawn uniformly and equal to
torchvision's transforms given the same draws, and a run resumed mid-epoch continues the order.
On a CPU `on_device=true` puts the set in host memory: the same code path as on a GPU, minus the
copy.
"""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from fakedata import write_cifar10
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.utilities.data import _update_dataloader
from scipy.stats import chisquare
from torch import nn

from dbsn.data import CIFAR10DataModule
from dbsn.data.augment import crop_offsets, flip_draws
from dbsn.data.base import CROP_PADDING, DeviceBatches, in_memory_loader


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_cifar10(root, n_train=100, n_test=10)
    return root


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
        dm.trainer = types.SimpleNamespace(world_size=2, strategy=types.SimpleNamespace(
            root_device=torch.device("cpu"), distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}))
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
        dm.trainer = types.SimpleNamespace(world_size=2, strategy=types.SimpleNamespace(
            root_device=torch.device("cpu"), distributed_sampler_kwargs=kwargs))
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
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, **kwargs)
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
    assert torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches": 2}]
    rest = _fit(data(), tmp_path / "rest", max_epochs=3, ckpt_path=checkpoint)
    assert first + rest == whole
    assert first[6:] != whole[:2]  # epochs differ, so the check sees a restart of the epoch
