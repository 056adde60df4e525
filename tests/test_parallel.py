"""One training step, three ways: the T structures in one grouped forward, in chunks with their
gradients accumulated (the memory knob), and split over two ranks (structure-parallel DDP).
All three must leave the same weights, θ and BatchNorm running statistics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from configs import ROOT, TINY, compose_config
from torch.utils.data import DataLoader, TensorDataset

from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.data.base import EpochShuffleSampler, SameOrderOnEveryRank
from dbsn.methods import DBSN
from dbsn.nets import StructureNet
from dbsn.runtime.run import train


def _one_step(train_samples_per_forward: int | None, train_samples: int = 4) -> dict[str, torch.Tensor]:
    """State after one training step of a small DBSN on one fixed batch (seeded: same init,
    same structure draws)."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(net, train_samples=train_samples, dataset_size=100,
                  train_samples_per_forward=train_samples_per_forward)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(method, DataLoader(TensorDataset(x, y), batch_size=6))
    return {k: v.detach().clone() for k, v in method.state_dict().items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    checked = {"weights": 0, "theta": 0, "running": 0}
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=atol, msg=key)
        else:
            assert torch.equal(a[key], b[key]), key
        kind = "theta" if key == "structure.theta" else "running" if "running_" in key else "weights"
        checked[kind] += 1
    assert min(checked.values()) > 0, checked


def test_structures_in_chunks_give_the_grouped_step():
    grouped = _one_step(None)
    initial_bn = next(v for k, v in _fresh_state().items() if k.endswith("running_var"))
    assert not torch.equal(initial_bn, next(v for k, v in grouped.items() if k.endswith("running_var")))
    for chunk in (1, 3):  # equal chunks, and a last chunk smaller than the others
        _assert_same_state(_one_step(chunk), grouped)


def test_chunks_without_the_accumulated_batchnorm_update_would_differ(monkeypatch):
    """Guards the test above: chunks that each move the running statistics (T moves instead
    of one) leave other statistics than the grouped step."""
    import contextlib

    import dbsn.methods.base

    grouped = _one_step(None)
    monkeypatch.setattr(dbsn.methods.base, "accumulated_running_statistics",
                        lambda net, enabled=True: contextlib.nullcontext())
    with pytest.raises(AssertionError, match="running_"):
        _assert_same_state(_one_step(1), grouped)


# ---------------------------------------------------------------------- gradients, seen directly
def _gradients(chunk: int | None, theta_std: float = 1.0, dataset_size: int = 10, weights=None,
               seed: int = 7) -> dict[str, torch.Tensor]:
    """Loss, every gradient (θ's included) before any optimiser touches it, and the running
    statistics of one step, with θ spread about 1 (far from the uniform prior: the KL and its
    gradient are large) and a small N (KL / N weighs in the loss)."""
    from steputil import step_state

    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(net, train_samples=4, dataset_size=dataset_size, theta_init_std=theta_std,
                  train_samples_per_forward=chunk, **({"weights": weights} if weights is not None else {}))
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    return step_state(method, x, y, seed=seed)


def _kl_on_every_chunk(monkeypatch) -> None:
    """A wrong chunked step: every chunk adds the whole structure KL / N (counted T / chunk times)."""
    from dbsn.methods.base import Method

    original = Method.training_losses

    def training_losses(self, x, y):
        _, kl = self.local_training_structures()
        for share, last, out in original(self, x, y):
            if not last:
                out["loss"] = out["loss"] + kl.mean() / self.dataset_size
            yield share, last, out
    monkeypatch.setattr(Method, "training_losses", training_losses)


def _theta_gradient_scaled_by_t(monkeypatch) -> None:
    """A wrong chunked step: θ's gradient summed over the T structures instead of averaged."""
    from dbsn.methods.base import Method

    original = Method.accumulate_gradients

    def accumulate_gradients(self, *args, **kwargs):
        logs = original(self, *args, **kwargs)
        if self.train_samples_per_forward is not None:
            self.structure.theta.grad.mul_(self.train_samples)
        return logs
    monkeypatch.setattr(Method, "accumulate_gradients", accumulate_gradients)


def test_chunked_gradients_equal_the_grouped_ones():
    """Gradients compared directly (not after Adam's sign-like first step), with a KL that
    matters: every weight gradient, θ's gradient and the running statistics."""
    from steputil import assert_same

    grouped = _gradients(None)
    assert grouped["grad/structure.theta"].abs().max() > 1e-3
    for chunk in (1, 3):
        kinds = assert_same(grouped, _gradients(chunk), rtol=1e-5, atol=1e-7)
        assert kinds["theta gradient"] == 1 and kinds["weight gradients"] > 20 and kinds["running statistics"] > 10


@pytest.mark.parametrize("mutation", [_kl_on_every_chunk, _theta_gradient_scaled_by_t])
def test_the_gradient_comparison_sees_a_wrong_kl_weight_and_a_wrong_theta_scale(monkeypatch, mutation):
    """The comparison above fails for a chunked step that counts the KL on every chunk or scales
    θ's gradient by T. Comparing states after one step would not: Adam's first step is
    lr · sign(g), the same for g and T·g; and at θ ≈ 0 (DARTS' 1e-3 init) with N = 50,000 the KL
    term is ~1e-5 of the loss. Hence gradients, θ spread about 1 and N = 10."""
    from steputil import assert_same

    grouped = _gradients(None)
    mutation(monkeypatch)
    wrong = _gradients(2)
    with pytest.raises(AssertionError):
        assert_same(grouped, wrong, rtol=1e-5, atol=1e-7)
    theta = "grad/structure.theta"
    assert not torch.allclose(wrong[theta], grouped[theta], rtol=1e-2, atol=1e-4)  # far outside the tolerance
    if mutation is _theta_gradient_scaled_by_t:  # what Adam's first step would have seen: nothing
        assert torch.equal(torch.sign(wrong[theta]), torch.sign(grouped[theta]))


def test_chunked_fbn_is_the_grouped_step_without_weight_noise():
    """FBN in chunks draws weight noise per chunk, the grouped step one draw for all T
    structures: two valid estimators of the same gradient, not the same numbers. What holds
    exactly: with the noise off (posterior means) the chunked step is the grouped one, weight
    KL and its gradient (the means' and the scales') included."""
    from steputil import assert_same

    from dbsn.bayes import set_sampling
    from dbsn.methods import GaussianWeights

    def fbn_step(chunk, noise: bool):
        import dbsn.methods.weights as weights_module

        original = weights_module.GaussianWeights.prepare

        def prepare(self, net):
            return set_sampling(original(self, net), noise)
        weights_module.GaussianWeights.prepare = prepare
        try:
            return _gradients(chunk, weights=GaussianWeights(init_rho=-3.0))
        finally:
            weights_module.GaussianWeights.prepare = original

    grouped = fbn_step(None, noise=False)
    assert any("rho" in k for k in grouped)
    kinds = assert_same(grouped, fbn_step(2, noise=False), rtol=1e-5, atol=1e-7)
    assert kinds["theta gradient"] == 1
    noisy_grouped, noisy_chunked = fbn_step(None, noise=True), fbn_step(2, noise=True)
    with pytest.raises(AssertionError):  # with noise, each chunk draws its own weights
        assert_same(noisy_grouped, noisy_chunked, rtol=1e-5, atol=1e-7)


def _fresh_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    return DBSN(net, train_samples=4, dataset_size=100).state_dict()


def test_same_order_on_every_rank_is_the_single_device_order():
    data = list(range(37))
    single, shared = EpochShuffleSampler(data, seed=5), SameOrderOnEveryRank(data, seed=5)
    for epoch in (0, 3):
        single.set_epoch(epoch)
        shared.set_epoch(epoch)
        assert list(shared) == list(single) and sorted(shared) == data
    assert isinstance(shared, torch.utils.data.DistributedSampler)  # Lightning keeps it as it is


def test_structure_parallel_refuses_t_not_divisible_by_devices(tmp_path):
    cfg = compose_config("train", ["data=digits", *TINY, "model.train_samples=3", "trainer.devices=2",
                                   "trainer.strategy=ddp"], tmp_path)
    with pytest.raises(ValueError, match=r"T = 3 structures of a step over 2 devices.*model.parallel=data"):
        train(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def _ddp_runs(tmp_path, train_samples: int, chunk: str, steps: int, wrong_kl: bool = False) -> dict:
    """One device and two structure-parallel ranks (`train.py trainer.devices=...` in a
    subprocess): each run's final state and the gradients of its first step, with θ spread about 1
    and N = 10 (the KL and its gradient weigh in)."""
    common = ["data=digits", *TINY, f"model.train_samples={train_samples}", "model.parallel=structure",
              "data.batch_size=16", "trainer.max_epochs=1", f"trainer.limit_train_batches={steps}", "test=false",
              "callbacks.structure_posterior=null", "model.theta_init_std=1.0", "model.dataset_size=10",
              "model.optim.grad_clip_norm=null"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    runs = {}
    for devices in (1, 2):
        run_dir = tmp_path / f"devices{devices}"
        extra = ["trainer.strategy=ddp", f"model.train_samples_per_forward={chunk}"] if devices > 1 else []
        if wrong_kl and devices > 1:
            extra.append("+callbacks.wrong._target_=grad_probe.KLOnEveryRank")
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *common, f"trainer.devices={devices}", *extra,
             "+callbacks.grads._target_=grad_probe.SaveFirstGradients", f"+callbacks.grads.folder={run_dir / 'grads'}",
             f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        runs[devices] = {"state": load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"],
                         "grads": {int(p.stem[4:]): torch.load(p) for p in (run_dir / "grads").glob("rank*.pt")}}
    return runs


def _assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 2e-6) -> None:
    assert a.keys() == b.keys() and "structure.theta" in a and len(a) > 20
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=atol, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("train_samples, chunk, steps", [(2, "null", 2), (4, "1", 1)])
def test_structure_parallel_steps_on_two_ranks_equal_one_device(tmp_path, train_samples, chunk, steps):
    """python train.py ... trainer.devices=2 (structure-parallel: T / 2 structures per rank,
    and with T = 4 one structure after the other on each rank) against the grouped step on one
    device: the first step's gradients (weights and θ, after the all-reduce) are the one
    device's on both ranks, and the steps leave the same weights, θ and running statistics."""
    runs = _ddp_runs(tmp_path, train_samples, chunk, steps)
    single, ranks = runs[1]["grads"][0], runs[2]["grads"]
    assert sorted(ranks) == [0, 1]
    assert single["structure.theta"].abs().max() > 1e-3
    for rank in (0, 1):
        _assert_same_gradients(single, ranks[rank])
    assert int(runs[2]["state"]["examples_seen"]) == steps * 16  # a shared batch counts once
    # float32 round-off of the all-reduce's summation order: a few 1e-6 after two steps at lr 0.1
    # (data-parallel ranks, or a wrong share of the structures, differ by ~1e-2)
    _assert_same_state(runs[2]["state"], runs[1]["state"], atol=2e-5)


@pytest.mark.slow
def test_the_rank_comparison_sees_a_kl_counted_on_every_rank(tmp_path):
    """Guards the test above: ranks that each count the KL world-size times give another θ
    gradient (the weight gradients, which the KL does not touch, stay equal)."""
    runs = _ddp_runs(tmp_path, 2, "null", 1, wrong_kl=True)
    single, rank0 = runs[1]["grads"][0], runs[2]["grads"][0]
    with pytest.raises(AssertionError, match="structure.theta"):
        _assert_same_gradients(single, rank0)
    weights = [k for k in single if k != "structure.theta"]
    for key in weights:
        torch.testing.assert_close(rank0[key], single[key], rtol=1e-4, atol=2e-6, msg=key)
