"""Small fake datasets written in exactly the on-disk formats of the real ones.

Each class has its own mean colour and every image is that colour plus Gaussian noise, so a
tiny model can learn them. Each writer returns `root`, the folder to pass as ``data.root``.
"""

import pickle
from pathlib import Path

import numpy as np
import scipy.io
import torch


# Five examples, three classes. Per row: prediction, confidence, right or wrong.
CRAFTED_PROBS = torch.tensor(
    [
        [0.70, 0.20, 0.10],  # y=0: predicts 0, conf 0.7, right
        [0.20, 0.50, 0.30],  # y=2: predicts 1, conf 0.5, wrong
        [0.10, 0.10, 0.80],  # y=2: predicts 2, conf 0.8, right
        [0.60, 0.30, 0.10],  # y=1: predicts 0, conf 0.6, wrong
        [0.05, 0.90, 0.05],  # y=1: predicts 1, conf 0.9, right
    ],
    dtype=torch.float64,
)
CRAFTED_TARGET = torch.tensor([0, 2, 2, 1, 1])

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def fake_images(n: int, num_classes: int, seed: int, noise: float = 40.0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (n, 3, 32, 32) of class-dependent colour plus noise, and int64 labels."""
    rng = np.random.default_rng(seed)
    colours = np.random.default_rng(12345).uniform(40, 215, size=(num_classes, 3))  # same for every split
    labels = np.arange(n) % num_classes
    rng.shuffle(labels)
    images = colours[labels][:, :, None, None] + rng.normal(0, noise, size=(n, 3, 32, 32))
    return np.clip(images.round(), 0, 255).astype(np.uint8), labels.astype(np.int64)


def _dump(path: Path, entry: dict) -> None:
    # Protocol 2 as the originals (Python 2 cPickle): bytes keys, data a uint8 (N, 3072) array.
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)


def _cifar_entry(images: np.ndarray, batch_label: str, start: int) -> dict:
    return {
        b"batch_label": batch_label.encode(),
        b"data": images.reshape(len(images), 3 * 32 * 32),
        b"filenames": [f"fake_{start + i:05d}.png".encode() for i in range(len(images))],
    }


def write_cifar10(root, n_train: int = 200, n_test: int = 50, seed: int = 0) -> Path:
    """<root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}; the training
    images are split over the five batch files like the real data."""
    root = Path(root)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = fake_images(n_train, 10, seed)
    start = 0
    for i, part in enumerate(np.array_split(np.arange(n_train), 5), start=1):
        entry = _cifar_entry(images[part], f"training batch {i} of 5", start)
        entry[b"labels"] = labels[part].tolist()
        _dump(folder / f"data_batch_{i}", entry)
        start += len(part)
    images, labels = fake_images(n_test, 10, seed + 1)
    entry = _cifar_entry(images, "testing batch 1 of 1", 0)
    entry[b"labels"] = labels.tolist()
    _dump(folder / "test_batch", entry)
    meta = {
        b"label_names": [name.encode() for name in CIFAR10_NAMES],
        b"num_cases_per_batch": 10000,
        b"num_vis": 3072,
    }
    _dump(folder / "batches.meta", meta)
    return root


def write_cifar100(root, n_train: int = 300, n_test: int = 100, seed: int = 0) -> Path:
    """<root>/cifar-100-python/{train, test, meta} with fine and coarse labels (coarse = fine // 5
    here; the real grouping differs)."""
    root = Path(root)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1)):
        images, labels = fake_images(n, 100, split_seed)
        entry = _cifar_entry(images, f"{'training' if name == 'train' else 'testing'} batch 1 of 1", 0)
        entry[b"fine_labels"] = labels.tolist()
        entry[b"coarse_labels"] = (labels // 5).tolist()
        _dump(folder / name, entry)
    meta = {
        b"fine_label_names": [f"fine_{i:02d}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse_{i:02d}".encode() for i in range(20)],
    }
    _dump(folder / "meta", meta)
    return root


def write_svhn(root, n_train: int = 200, n_test: int = 50, seed: int = 0) -> Path:
    """<root>/{train,test}_32x32.mat: X uint8 (32, 32, 3, N), y uint8 (N, 1) with 10 for the digit 0."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name, n, split_seed in (("train", n_train, seed), ("test", n_test, seed + 1)):
        images, labels = fake_images(n, 10, split_seed)
        digits = np.where(labels == 0, 10, labels).astype(np.uint8).reshape(n, 1)
        scipy.io.savemat(root / f"{name}_32x32.mat", {"X": images.transpose(2, 3, 1, 0), "y": digits})
    return root


# ----- CamVid (SegNet release) ----------------------------------------------------------
CAMVID_PREFIXES = {"train": "0001TP", "val": "0016E5", "test": "Seq05VD"}


def fake_camvid_split(split: str, n: int, size: tuple[int, int] = (36, 48), seed: int = 0):
    """File names, uint8 RGB images (n, 3, H, W) and uint8 labels (n, H, W) in 0..11 (11 = void)
    of one fake CamVid split; `write_camvid` writes exactly these."""
    rng = np.random.default_rng([seed, ["train", "val", "test"].index(split)])
    names = [f"{CAMVID_PREFIXES[split]}_{6690 + 30 * i:06d}.png" for i in range(n)]
    images = rng.integers(0, 256, size=(n, 3, *size), dtype=np.uint8)
    labels = rng.integers(0, 12, size=(n, *size), dtype=np.uint8)
    labels[:, 0, 0] = 11  # every label map has some void
    return names, images, labels


def write_camvid(
    root, n_train: int = 4, n_val: int = 2, n_test: int = 2, size: tuple[int, int] = (36, 48),
    seed: int = 0, with_lists: bool = True,
) -> Path:
    """<root>/{train,trainannot,val,valannot,test,testannot}/*.png and, if `with_lists`,
    <root>/{train,val,test}.txt with SegNet's "/SegNet/CamVid/<split>/<name> /SegNet/CamVid/
    <split>annot/<name>" lines: RGB images and single-channel 8-bit label PNGs."""
    from PIL import Image

    root = Path(root)
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        names, images, labels = fake_camvid_split(split, n, size, seed)
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / f"{split}annot").mkdir(parents=True, exist_ok=True)
        for name, image, label in zip(names, images, labels):
            Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0))).save(root / split / name)
            Image.fromarray(label).save(root / f"{split}annot" / name)
        if with_lists:
            lines = [f"/SegNet/CamVid/{split}/{name} /SegNet/CamVid/{split}annot/{name}\n" for name in names]
            (root / f"{split}.txt").write_text("".join(lines))
    return root
