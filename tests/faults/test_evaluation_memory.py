"""An evaluation's memory does not grow with S, the number of Monte Carlo members
(dbsn.methods.predictive.EnsembleStream, dbsn.metrics.ablation.default_sizes).

The test pass of a tiny DBSN on 8 test images (100 classes) runs at S = 200, then at S = 10,000,
the members in chunks of 200 in both. What the second must keep beyond the first is known: the
MC-sample ablation's few extra sizes (a metric set each, and one prefix ensemble of 8 x 100 floats
per batch). The memory a pass keeps is read from malloc (glibc's `mallinfo2`: the bytes in use,
tensors included) before every chunk of members and after every batch, relative to the start of
the pass: it may exceed the small pass's by that, plus the slack of Python's own objects. One
(S, b, C) tensor of the members would be 30 MB; an ablation of every S kept 141 MB (measured).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dbsn.evaluation.test_pass import prediction_results, run_test_pass
from dbsn.methods import DBSN, Prediction
from dbsn.metrics.ablation import default_sizes
from dbsn.nets import StructureNet

CLASSES, IMAGES, CHUNK = 100, 8, 200
SMALL, LARGE = 200, 10_000
SLACK_MB = 2.0  # Python's objects of a pass (measured: under 1 MB between passes of any S)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use():
    """A function giving the bytes malloc has handed out and not got back (heap and mmap'd), or None
    where malloc cannot say (not glibc, or glibc before 2.33)."""
    try:
        mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


IN_USE = _malloc_in_use()


class Tensors(pl.LightningDataModule):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__()
        self.x, self.y = x, y

    def test_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=IMAGES)


class _Sample(pl.Callback):
    def __init__(self, samples: list[int]) -> None:
        self.samples = samples

    def on_test_batch_end(self, *args, **kwargs) -> None:
        self.samples.append(IN_USE())


def _kept_mb(net: StructureNet, data: Tensors, n_samples: int) -> tuple[float, list[dict]]:
    """(the most memory one test pass at S = `n_samples` kept between its chunks and batches, MB;
    its MC-sample ablation's rows)."""
    method = DBSN(net, prediction=Prediction(n_samples=n_samples, samples_per_forward=CHUNK), dataset_size=100)
    samples: list[int] = []
    forward = method.stochastic_forward

    def sampled(x, n, first):  # before each chunk of members: what the chunks before left behind
        samples.append(IN_USE())
        return forward(x, n, first)

    method.stochastic_forward = sampled
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Sample(samples)],
    )
    gc.collect()
    start = IN_USE()
    metrics, recorded = run_test_pass(trainer, method, data)
    samples.append(IN_USE())
    prediction_results(method, recorded, metrics, "tiny")  # the pass's tables and figures
    assert len(samples) >= n_samples // CHUNK
    return (max(samples) - start) / 2**20, recorded.ablation_rows


@pytest.mark.skipif(IN_USE is None, reason="needs glibc's mallinfo2 (glibc 2.33 or later)")
def test_a_test_pass_at_ten_thousand_members_keeps_what_it_must_and_no_more():
    torch.manual_seed(0)
    net = StructureNet(num_classes=CLASSES, num_nodes=2, cells_per_stage=1, num_stages=1, growth=4, stem_channels=4)
    data = Tensors(torch.randn(IMAGES, 3, 8, 8), torch.randint(0, CLASSES, (IMAGES,)))
    _kept_mb(net, data, SMALL)  # the first pass makes what every pass shares (Lightning's, the network's)
    small, small_rows = _kept_mb(net, data, SMALL)
    large, large_rows = _kept_mb(net, data, LARGE)

    assert [r["n_samples"] for r in large_rows] == default_sizes(LARGE) and large_rows[-1]["n_samples"] == LARGE
    extra_sizes = len(default_sizes(LARGE)) - len(default_sizes(SMALL))
    # per extra size: a prefix ensemble (IMAGES x CLASSES floats) and a metric set's states (under 100 kB)
    must_keep_mb = extra_sizes * (IMAGES * CLASSES * 4 + 100_000) / 2**20
    one_member_tensor_mb = LARGE * IMAGES * CLASSES * 4 / 2**20
    assert must_keep_mb + SLACK_MB < one_member_tensor_mb / 10  # the bound can tell
    assert large <= small + must_keep_mb + SLACK_MB, (small, large)
