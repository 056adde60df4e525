"""Post-hoc SWAG (dbsn.posthoc.swag): the moments and the sampler against the stored iterates, the
collector over a Lightning run, and members with their own BatchNorm statistics.
"""

from __future__ import annotations

import math
from copy import deepcopy

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dbsn.data.digits import DigitsDataModule
from dbsn.methods import MAP, WeightOptimizer
from dbsn.methods.dbsn import BatchNormRecalibration
from dbsn.posthoc.swag import SWAGCollector, SWAGMethod, SWAGMoments, load_swag_state, swag_parameters
from tests.support.invariants import assert_fixed_members
from tests.support.netutil import tiny_structure_net


def test_swag_moments_are_those_of_the_stored_iterates():
    rng = np.random.default_rng(0)
    iterates = rng.normal(size=(6, 7)) * rng.uniform(0.1, 2, size=7) + rng.normal(size=7)
    moments = SWAGMoments(7, max_rank=4)
    running_means = []
    for i, w in enumerate(iterates):
        moments.update(torch.tensor(w, dtype=torch.float32))
        running_means.append(iterates[: i + 1].astype(np.float32).astype(np.float64).mean(0))
    w = iterates.astype(np.float32).astype(np.float64)  # what the network holds
    mean = w.mean(0)
    np.testing.assert_allclose(moments.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        moments.variance().numpy(), np.maximum((w**2).mean(0) - mean**2, 1e-30), rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(moments.variance().numpy(), w.var(0), rtol=1e-9, atol=1e-12)
    # D: the last K = 4 deviations from the running mean after each update, oldest first
    expected_d = np.stack([w[i] - running_means[i] for i in range(2, 6)])
    assert moments.rank == 4 and int(moments.count) == 6
    np.testing.assert_allclose(moments.deviation_matrix().numpy(), expected_d, rtol=1e-6, atol=1e-6)


def test_swag_sampler_has_the_swag_mean_and_covariance():
    rng = np.random.default_rng(1)
    iterates = rng.normal(size=(5, 4)) * np.array([0.1, 1.0, 0.5, 2.0]) + np.array([1.0, -1.0, 0.0, 3.0])
    moments = SWAGMoments(4, max_rank=3)
    for w in iterates:
        moments.update(torch.tensor(w))
    mean = iterates.mean(0)
    running = [iterates[: i + 1].mean(0) for i in range(5)]
    D = np.stack([iterates[i] - running[i] for i in range(2, 5)])  # K = 3 rows
    covariance = 0.5 * (np.diag(iterates.var(0)) + D.T @ D / (3 - 1))
    np.testing.assert_allclose(moments.covariance().numpy(), covariance, rtol=1e-6, atol=1e-9)

    n = 40000
    draws = moments.sample(torch.Generator().manual_seed(0), n=n).numpy()
    sd = np.sqrt(np.diag(covariance))
    assert np.all(np.abs(draws.mean(0) - mean) < 5 * sd / math.sqrt(n))
    se = np.sqrt(np.outer(sd, sd) ** 2 + covariance**2) / math.sqrt(n)
    assert np.all(np.abs(np.cov(draws.T) - covariance) < 5 * se)
    same = moments.sample(torch.Generator().manual_seed(0), n=n).numpy()  # a seed fixes the draws
    np.testing.assert_array_equal(same, draws)


class _Recorder(pl.Callback):
    """Stores the network's flattened weights at the end of every training epoch."""

    def __init__(self):
        self.iterates = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.iterates.append(torch.cat([p.detach().flatten() for p in pl_module.net.parameters()]).double().clone())


def test_swag_collector_over_a_lightning_run_and_its_checkpoint(tmp_path):
    torch.manual_seed(0)
    method = MAP(tiny_structure_net(num_classes=3), dataset_size=8, optim=WeightOptimizer(lr=0.05))  # learned θ
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
    recorder, collector = _Recorder(), SWAGCollector(start=0.5, max_rank=20)  # ⌊0.5 · 4⌋ = epoch 2
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder, collector, checkpoints],
    )
    trainer.fit(method, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))

    assert collector.epochs == [2, 3]
    w = torch.stack(recorder.iterates[2:]).numpy()
    assert np.abs(w[1] - w[0]).max() > 1e-4  # training moved the weights
    m = collector.moments
    np.testing.assert_allclose(m.mean.numpy(), w.mean(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(m.variance().numpy(), np.maximum(w.var(0), 1e-30), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(m.deviation_matrix().numpy(), np.stack([w[0] - w[0], w[1] - w.mean(0)]), atol=1e-6)
    # the network's parameters only: no BatchNorm buffers, no θ
    names = [name for name, _ in method.net.named_parameters()]
    assert collector.names == names and not any("running" in n or "theta" in n for n in collector.names)
    assert m.mean.numel() == sum(p.numel() for p in method.net.parameters())
    assert method.theta.numel() > 0 and all(p is not method.theta for _, p in swag_parameters(method))
    # the last checkpoint holds both snapshots
    state = load_swag_state(torch.load(tmp_path / "last.ckpt", weights_only=False))
    assert state["epochs"] == [2, 3]
    torch.testing.assert_close(state["moments"]["mean"], m.mean)
    torch.testing.assert_close(state["moments"]["deviations"], m.deviations)


def test_swag_collection_starts_where_asked_and_only_on_point_estimates():
    from dbsn.methods import DBSN

    assert SWAGCollector(start=0.75).first_epoch(300) == 225 and SWAGCollector(start=0.5).first_epoch(5) == 2
    assert SWAGCollector(start=7).first_epoch(300) == 7
    for bad in (1.0, -1, True, "0.5"):
        with pytest.raises(ValueError, match="start"):
            SWAGCollector(start=bad)
    with pytest.raises(ValueError, match="collect"):
        SWAGCollector(collect="batch")
    with pytest.raises(ValueError, match="point-estimate"):
        swag_parameters(DBSN(tiny_structure_net(), dataset_size=10))
    moments = SWAGMoments(3)
    moments.update(torch.zeros(3))
    with pytest.raises(ValueError, match="at least 2"):
        moments.sample()


def _swag_of(method: MAP, spreads=(0.0, 0.05, -0.03, 0.08)) -> dict:
    """A collector state from hand-made snapshots around the network's weights."""
    collector = SWAGCollector(start=0, max_rank=5)
    g = torch.Generator().manual_seed(2)
    originals = [p.detach().clone() for p in method.net.parameters()]
    for spread in spreads:
        with torch.no_grad():
            for p, p0 in zip(method.net.parameters(), originals):
                p.copy_(p0 + spread * torch.randn(p.shape, generator=g))
        collector.collect_from(method)
    with torch.no_grad():
        for p, p0 in zip(method.net.parameters(), originals):
            p.copy_(p0)
    return collector.state_dict()


def test_swag_members_have_their_own_batchnorm_statistics():
    """Member s = the network with weights w_s whose BatchNorm layers were reset and run, with
    momentum=None, over the calibration batches in training mode (SWAG's bn_update)."""
    torch.manual_seed(0)
    method = MAP(tiny_structure_net(num_classes=4), learn_structure=False, dataset_size=10).eval()
    swag = SWAGMethod(
        method, _swag_of(method), n_samples=4, bn_recalibration=BatchNormRecalibration(enabled=True)
    ).eval()
    g = torch.Generator().manual_seed(3)
    calibration = [torch.randn(12, 3, 8, 8, generator=g), torch.randn(12, 3, 8, 8, generator=g) + 0.5]
    swag.use_calibration_images(calibration)
    x = torch.randn(6, 3, 8, 8, generator=g)
    before = [p.detach().clone() for p in method.net.parameters()]
    members = assert_fixed_members(swag, x, count=4, classes=4, first=2, n=2, differ=1e-3)
    assert all(torch.equal(a, p) for a, p in zip(before, method.net.parameters()))  # members are functional

    for s in (0, 3):
        reference = deepcopy(method.net)
        weights = swag.member_weights(s)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(weights[f"net.{name}"])
            for m in reference.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.reset_running_stats()
                    m.momentum = None
            reference.train()
            for batch in calibration:
                reference(batch, method.alpha().unsqueeze(0), replicate=True)
            reference.eval()
            expected = reference(x, method.alpha().unsqueeze(0), replicate=True).log_softmax(-1)
        torch.testing.assert_close(members[s], expected, rtol=1e-4, atol=1e-4)


def test_swag_method_takes_its_batchnorm_images_from_the_training_split():
    torch.manual_seed(0)
    method = MAP(tiny_structure_net(), learn_structure=False, dataset_size=10).eval()
    swag = SWAGMethod(
        method,
        _swag_of(method),
        n_samples=2,
        bn_recalibration=BatchNormRecalibration(enabled=True, images=24, batch_size=16),
    ).eval()
    dm = DigitsDataModule(num_workers=0, train_subset=100, val_size=20)
    with pytest.raises(ValueError, match="prepare_prediction"):
        swag.predict_members(torch.zeros(1, 3, 32, 32))
    swag.prepare_prediction(dm)
    assert [len(b) for b in swag._calibration] == [16, 8]
    torch.testing.assert_close(torch.cat(swag._calibration), dm.preprocess(dm.training_images(24, seed=0)))
    with torch.no_grad():
        assert swag.predict_members(dm.preprocess(dm.val_set.images[:3])).shape == (2, 3, 10)
    with pytest.raises(ValueError, match="do not belong"):
        SWAGMethod(MAP(tiny_structure_net(num_classes=4), learn_structure=False, dataset_size=10), _swag_of(method), 2)
