"""Small fake datasets written in exactly the on-disk formats of the real ones.

The training sets (CIFAR-10/100, SVHN): each class has its own mean colour and every image is
that colour plus Gaussian noise, so a tiny model can learn them. Each writer returns `root`, the
folder to pass as ``data.root``. CamVid (SegNet's release), the OpenOOD sets (MNIST's idx files,
Textures, Places365, TinyImageNet as JPEG folders with their list files), CIFAR-10-C in the
published layout, and the image folder of docs/extending.md are written here too.
"""

import gzip
import pickle
from pathlib import Path

import numpy as np
import scipy.io
import torch
from PIL import Image

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
    root,
    n_train: int = 4,
    n_val: int = 2,
    n_test: int = 2,
    size: tuple[int, int] = (36, 48),
    seed: int = 0,
    with_lists: bool = True,
) -> Path:
    """<root>/{train,trainannot,val,valannot,test,testannot}/*.png and, if `with_lists`,
    <root>/{train,val,test}.txt with SegNet's "/SegNet/CamVid/<split>/<name> /SegNet/CamVid/
    <split>annot/<name>" lines: RGB images and single-channel 8-bit label PNGs."""
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


def image_keys(images: torch.Tensor) -> set[bytes]:
    """Each image's bytes: a set to compare which images two splits hold."""
    return {image.numpy().tobytes() for image in images}


# ----- the OpenOOD v1.5 sets, each in its on-disk format ------------------------------------------
RED, GREEN, BLUE, GREY = (220, 30, 30), (30, 200, 40), (20, 40, 230), (128, 128, 128)  # pattern colours


def write_idx(path: Path, array: np.ndarray) -> None:
    """A uint8 idx file (gzip-compressed when the name ends in .gz)."""
    data = bytes((0, 0, 8, array.ndim)) + b"".join(n.to_bytes(4, "big") for n in array.shape) + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as f:
        f.write(data)


def write_mnist(root: Path, images: np.ndarray, labels: np.ndarray, prefix: str = "t10k", gz: bool = False) -> Path:
    """<root>/MNIST/raw/<prefix>-images-idx3-ubyte and <prefix>-labels-idx1-ubyte (.gz if `gz`)."""
    suffix = ".gz" if gz else ""
    write_idx(root / "MNIST" / "raw" / f"{prefix}-images-idx3-ubyte{suffix}", images.astype(np.uint8))
    write_idx(root / "MNIST" / "raw" / f"{prefix}-labels-idx1-ubyte{suffix}", labels.astype(np.uint8))
    return root


def save_jpeg(path: Path, pixels: np.ndarray) -> None:
    """(H, W, 3) or grey (H, W) uint8 pixels as a high-quality JPEG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=95)


def solid(height: int, width: int, colour) -> np.ndarray:
    return np.broadcast_to(np.array(colour, dtype=np.uint8), (height, width, 3)).copy()


def write_dtd(root: Path, images: dict[str, np.ndarray], partition: int = 1) -> Path:
    """<root>/dtd/dtd/images/<class>/<name>.jpg for `images` {"<class>/<name>.jpg": pixels} and
    labels/{train,val,test}<partition>.txt, the images dealt to the three lists in turn."""
    folder = root / "dtd" / "dtd"
    lists = {"train": [], "val": [], "test": []}
    for i, (name, pixels) in enumerate(images.items()):
        save_jpeg(folder / "images" / name, pixels)
        lists[("train", "val", "test")[i % 3]].append(name)
    (folder / "labels").mkdir(parents=True, exist_ok=True)
    for split, names in lists.items():
        (folder / "labels" / f"{split}{partition}.txt").write_text("".join(f"{n}\n" for n in names))
    return root


# ----- Textures (DTD) -------------------------------------------------------------------------
def dtd_images() -> dict[str, np.ndarray]:
    """Six images of three classes: a 80x40 (H x W) one of red, green, blue horizontal bands
    (green in the middle half), a grey one, and solid colours of other sizes."""
    bands = np.concatenate([solid(20, 40, RED), solid(40, 40, GREEN), solid(20, 40, BLUE)])
    grey = np.full((48, 48), 100, dtype=np.uint8)
    grey[:, 24:] = 200
    return {
        "banded/banded_0001.jpg": bands,
        "banded/banded_0002.jpg": solid(64, 64, BLUE),
        "grid/grid_0001.jpg": grey,
        "grid/grid_0002.jpg": solid(33, 90, RED),
        "zigzagged/zigzagged_0001.jpg": solid(300, 300, GREY),
        "zigzagged/zigzagged_0002.jpg": solid(40, 40, GREEN),
    }


def write_places365(root: Path, images: list[np.ndarray], labels: list[int]) -> Path:
    """<root>/places365_val.txt ("Places365_val_00000001.jpg <class>") and <root>/val_256/*.jpg."""
    lines = []
    for i, (pixels, label) in enumerate(zip(images, labels), start=1):
        name = f"Places365_val_{i:08d}.jpg"
        save_jpeg(root / "val_256" / name, pixels)
        lines.append(f"{name} {label}\n")
    (root / "places365_val.txt").write_text("".join(lines))
    (root / "categories_places365.txt").write_text("".join(f"/c/class_{k} {k}\n" for k in range(365)))
    return root


def write_tinyimagenet(root: Path, images: list[np.ndarray], wnids: list[str]) -> Path:
    """<root>/tiny-imagenet-200/val/images/val_<i>.JPEG and val/val_annotations.txt (tab-separated
    "val_<i>.JPEG <wnid> <x0> <y0> <x1> <y1>")."""
    val = root / "tiny-imagenet-200" / "val"
    lines = []
    for i, (pixels, wnid) in enumerate(zip(images, wnids)):
        save_jpeg(val / "images" / f"val_{i}.JPEG", pixels)
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63\n")
    (val / "val_annotations.txt").write_text("".join(lines))
    return root


# ----- CIFAR-10-C / CIFAR-100-C in the published layout ---------------------------------------
PER_SEVERITY = 7


def write_published(folder, corruptions=("gaussian_noise", "fog"), n=PER_SEVERITY, seed=0):
    """The published layout with random content (so every row, severity and channel differs) and
    labels that differ between severities too (the real ones repeat; the reader must slice them
    the same way as the images). Returns {name: HWC array} and the labels."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {name: rng.integers(0, 256, size=(5 * n, 32, 32, 3), dtype=np.uint8) for name in corruptions}
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    labels = np.arange(5 * n, dtype=np.uint8)
    np.save(folder / "labels.npy", labels)
    return arrays, labels


# ----- docs/extending.md's image folder -------------------------------------------------------
def write_image_folder(root: Path, per_class: int = 20) -> None:
    """Digits as 32x32 PNGs in the layout the page's data module reads: <split>/<class>/<n>.png."""
    from dbsn.data.digits import digits_splits

    for split, (images, labels) in zip(("train", "test"), digits_splits()):
        for c in range(10):
            chosen = np.flatnonzero(labels.numpy() == c)[:per_class]
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
            for i in chosen:
                Image.fromarray(images[i].permute(1, 2, 0).numpy()).save(root / split / f"class{c}" / f"{i}.png")


def normalised_digits(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n` training digits, normalised as `DigitsDataModule` does, and their labels."""
    from dbsn.data.digits import DigitsDataModule, digits_splits

    (images, labels), _ = digits_splits()
    mean, std = torch.tensor(DigitsDataModule.mean), torch.tensor(DigitsDataModule.std)
    return (images[:n].float() / 255 - mean[:, None, None]) / std[:, None, None], labels[:n]
