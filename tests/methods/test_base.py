"""What every method inherits from `dbsn.methods.base.Method`: the training step with its T
structures grouped, in chunks and over structure-parallel ranks; the memory layout and
compilation of `Execution`; the per-rank random streams; the optimisers and lr schedules; the
prediction of deterministic methods; and every method through train() and evaluate().

One training step, three ways: the T structures in one grouped forward, in chunks with their
gradients accumulated (the memory knob), and split over two ranks (structure-parallel DDP).
All three must leave the same weights, θ and BatchNorm running statistics.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dbsn.methods import DBSN, MAP, Compilation, Execution, GaussianWeights, MCDropoutWeights, Prediction
from dbsn.methods.tasks import Segmentation
from dbsn.nets import DBSNSegNet, FCDenseNet, StructureNet
from dbsn.nets.ops import memory_format
from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.runtime.run import evaluate, train
from dbsn.structure.schedules import BetaSchedule, TauSchedule
from tests.support.configs import ROOT, TINY, compose_config, configured_optimizers, small_model, tiny_for
from tests.support.marks import needs_cpp_compiler
from tests.support.scripts import SUPPORT_ON_PATH, run_python
from tests.support.steputil import assert_same, prediction, step_state


def _one_step(train_samples_per_forward: int | None, train_samples: int = 4) -> dict[str, torch.Tensor]:
    """State after one training step of a small DBSN on one fixed batch (seeded: same init,
    same structure draws)."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(
        net, train_samples=train_samples, dataset_size=100, train_samples_per_forward=train_samples_per_forward
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
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

    import dbsn.methods.training

    grouped = _one_step(None)
    monkeypatch.setattr(
        dbsn.methods.training,
        "accumulated_running_statistics",
        lambda net, enabled=True, **settings: contextlib.nullcontext(),
    )
    with pytest.raises(AssertionError, match="running_"):
        _assert_same_state(_one_step(1), grouped)


# ---------------------------------------------------------------------- gradients, seen directly
def _gradients(
    chunk: int | None, theta_std: float = 1.0, dataset_size: int = 10, weights=None, seed: int = 7
) -> dict[str, torch.Tensor]:
    """Loss, every gradient (θ's included) before any optimiser touches it, and the running
    statistics of one step, with θ spread about 1 (far from the uniform prior: the KL and its
    gradient are large) and a small N (KL / N weighs in the loss)."""
    from tests.support.steputil import step_state

    torch.manual_seed(1)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(
        net,
        train_samples=4,
        dataset_size=dataset_size,
        theta_init_std=theta_std,
        train_samples_per_forward=chunk,
        **({"weights": weights} if weights is not None else {}),
    )
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
    from tests.support.steputil import assert_same

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
    from tests.support.steputil import assert_same

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
    from dbsn.bayes import set_sampling
    from dbsn.methods import GaussianWeights
    from tests.support.steputil import assert_same

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


def test_structure_parallel_refuses_t_not_divisible_by_devices(tmp_path):
    cfg = compose_config(
        "train", ["data=digits", *TINY, "model.train_samples=3", "trainer.devices=2", "trainer.strategy=ddp"], tmp_path
    )
    with pytest.raises(ValueError, match=r"T = 3 structures of a step over 2 devices.*model.parallel=data"):
        train(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def _ddp_runs(tmp_path, train_samples: int, chunk: str, steps: int, wrong_kl: bool = False) -> dict:
    """One device and two structure-parallel ranks (`train.py trainer.devices=...` in a
    subprocess): each run's final state and the gradients of its first step, with θ spread about 1
    and N = 10 (the KL and its gradient weigh in)."""
    common = [
        "data=digits",
        *TINY,
        f"model.train_samples={train_samples}",
        "model.parallel=structure",
        "data.batch_size=16",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={steps}",
        "test=false",
        "callbacks.structure_posterior=null",
        "model.theta_init_std=1.0",
        "model.dataset_size=10",
        "model.optim.grad_clip_norm=null",
        # contiguous: oneDNN's channels-last kernels (the CPU default) sum a G = 4 and a G = 2
        # grouped batch in other orders, beyond this comparison's 2e-6; the layout has its own test
        "model.execution.channels_last=false",
    ]
    runs = {}
    for devices in (1, 2):
        run_dir = tmp_path / f"devices{devices}"
        extra = ["trainer.strategy=ddp", f"model.train_samples_per_forward={chunk}"] if devices > 1 else []
        if wrong_kl and devices > 1:
            extra.append("+callbacks.wrong._target_=tests.support.grad_probe.KLOnEveryRank")
        run_python(
            ROOT / "train.py",
            *common,
            f"trainer.devices={devices}",
            *extra,
            "+callbacks.grads._target_=tests.support.grad_probe.SaveFirstGradients",
            f"+callbacks.grads.folder={run_dir / 'grads'}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
            env=SUPPORT_ON_PATH,
        )
        runs[devices] = {
            "state": load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"],
            "grads": {int(p.stem[4:]): torch.load(p) for p in (run_dir / "grads").glob("rank*.pt")},
        }
    return runs


def _assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 2e-6) -> None:
    assert a.keys() == b.keys() and "structure.theta" in a and len(a) > 20
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


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
    for rank in (0, 1):  # chunked: the fused cell sums the stem's gradient in another order (a few 1e-6)
        _assert_same_gradients(single, ranks[rank], atol=2e-6 if chunk == "null" else 1e-5)
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


# ---------------------------------------------------------------------- per-rank random streams


def _method_on_rank(rank: int, world_size: int = 2, parallel: str = "data") -> DBSN:
    torch.manual_seed(123)  # seed_everything: the same on every rank
    net = StructureNet(num_classes=3, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = DBSN(net, dataset_size=10, parallel=parallel)
    datamodule = SimpleNamespace(same_batches_on_every_rank=parallel == "structure")  # as train.py sets it
    method._trainer = SimpleNamespace(world_size=world_size, global_rank=rank, datamodule=datamodule)
    method.on_fit_start()
    return method


def test_each_ddp_rank_draws_its_own_structures():
    draws = {rank: _method_on_rank(rank).structure.sample(4, 1.0, 1.0) for rank in (0, 1)}
    assert not torch.allclose(draws[0], draws[1])
    again = _method_on_rank(1).structure.sample(4, 1.0, 1.0)
    assert torch.equal(again, draws[1])  # reproducible per rank
    # the initial weights are the same on every rank (DDP also broadcasts rank 0's)
    a, b = _method_on_rank(0), _method_on_rank(1)
    assert torch.equal(a.structure.theta, b.structure.theta)


def test_structure_parallel_ranks_draw_the_same_structures():
    """...and take different blocks of them (the whole step: the structure-parallel tests above)."""
    draws = {rank: _method_on_rank(rank, parallel="structure").structure.sample(4, 1.0, 1.0) for rank in (0, 1)}
    assert torch.equal(draws[0], draws[1])


# ---------------------------------------------------------------------- channels-last
# model.execution.channels_last=true: the same numbers as the contiguous layout, and every convolution
# really sees channels-last input (no silent conversion back to NCHW inside the network).
#
# Compared: one training step's loss, every gradient (θ's included) and the BatchNorm running
# statistics, with T structures grouped and in chunks, and the Bayes ensemble's members. Methods
# with point weights: stochastic weights draw their noise in memory order, so the same seed gives
# other (equally valid) noise in another layout.

LAYOUT_NET = dict(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)


def _pair(make):
    """The same method (same initial weights and θ) built twice: contiguous and channels-last."""
    torch.manual_seed(3)
    plain = make(False)
    torch.manual_seed(3)
    last = make(True)
    last.load_state_dict(plain.state_dict())
    return plain, last


def _non_channels_last_conv_inputs(method, run) -> list[str]:
    """Names of the convolutions that received an input not laid out channels-last."""
    seen: list[str] = []
    hooks = [
        m.register_forward_pre_hook(
            lambda m, args, name=name: (
                seen.append(name)
                if memory_format(args[0]) != torch.channels_last and min(args[0].shape[-2:]) > 1
                else None
            )
        )
        for name, m in method.net.named_modules()
        if isinstance(m, nn.Conv2d)
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


CLASSIFIERS = {
    "dbsn_grouped": lambda cl: DBSN(
        StructureNet(**LAYOUT_NET),
        train_samples=3,
        prediction=Prediction(n_samples=4, samples_per_forward=3),
        dataset_size=50,
        theta_init_std=1.0,
        execution=Execution(channels_last=cl),
    ),
    "dbsn_chunked": lambda cl: DBSN(
        StructureNet(**LAYOUT_NET),
        train_samples=3,
        prediction=Prediction(n_samples=4, samples_per_forward=3),
        dataset_size=50,
        theta_init_std=1.0,
        train_samples_per_forward=2,
        execution=Execution(channels_last=cl),
    ),
    "map": lambda cl: MAP(
        StructureNet(**LAYOUT_NET),
        learn_structure=True,
        theta_init_std=1.0,
        dataset_size=50,
        execution=Execution(channels_last=cl),
    ),
    "map_fixed": lambda cl: MAP(
        StructureNet(**LAYOUT_NET), learn_structure=False, dataset_size=50, execution=Execution(channels_last=cl)
    ),
}


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_channels_last_step_and_prediction_equal_the_contiguous_layout(name):
    plain, last = _pair(CLASSIFIERS[name])
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    reference = step_state(plain, x, y)
    kinds = assert_same(reference, step_state(last, x, y), rtol=1e-4, atol=1e-5)
    assert kinds["weight gradients"] > 20 and kinds["running statistics"] > 10
    assert kinds["theta gradient"] == (0 if name == "map_fixed" else 1)
    torch.testing.assert_close(prediction(last, x, 4), prediction(plain, x, 4), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["dbsn_grouped", "dbsn_chunked"])
def test_every_convolution_runs_channels_last(name):
    _, last = _pair(CLASSIFIERS[name])
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    assert _non_channels_last_conv_inputs(last, lambda: step_state(last, x, y)) == []
    assert _non_channels_last_conv_inputs(last, lambda: prediction(last, x, 4)) == []
    plain, _ = _pair(CLASSIFIERS[name])  # the check sees a contiguous network
    assert len(_non_channels_last_conv_inputs(plain, lambda: step_state(plain, x, y))) > 20


SEGMENTERS = {
    "fcdensenet": lambda cl: MAP(
        FCDenseNet(num_classes=5, first_channels=8, growth=4, layers_per_block=2, num_down=2),
        learn_structure=False,
        dataset_size=20,
        task=Segmentation(ignore_index=4),
        execution=Execution(channels_last=cl),
    ),
    "dbsn_seg": lambda cl: DBSN(
        DBSNSegNet(num_classes=5, first_channels=8, growth=4, num_down=2, num_nodes=3),
        train_samples=2,
        prediction=Prediction(n_samples=2, samples_per_forward=2),
        dataset_size=20,
        theta_init_std=1.0,
        task=Segmentation(ignore_index=4),
        execution=Execution(channels_last=cl),
    ),
}


@pytest.mark.parametrize("name", list(SEGMENTERS))
def test_segmentation_networks_equal_in_channels_last(name):
    plain, last = _pair(SEGMENTERS[name])
    for method in (plain, last):  # no dropout noise: deterministic forwards in both layouts
        for m in method.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 20, 24), torch.randint(0, 5, (2, 20, 24))
    kinds = assert_same(step_state(plain, x, y), step_state(last, x, y), rtol=1e-4, atol=1e-5)
    assert kinds["weight gradients"] > 20
    assert _non_channels_last_conv_inputs(last, lambda: step_state(last, x, y)) == []


# ---------------------------------------------------------------------- torch.compile
# model.execution.compile.enabled=true: the compiled network gives the eager numbers, and a run under way
# does not recompile.
#
# Equality: one training step (loss, every weight gradient, θ's gradient, the BatchNorm running
# statistics) of DBSN with T = 4 grouped and in chunks, MAP-fixed α and BBB, and the members of
# the S-member Bayes ensemble. Inductor (the backend that generates kernels, the one users run)
# compiles the grouped DBSN case; the chunked step, MAP-fixed α and BBB go through the same graph
# capture (dynamo, AOT autograd, functionalised BatchNorm updates) with the aot_eager backend,
# which skips only code generation: inductor's C++ compile costs about a minute per graph on a
# 2-core machine.
# Random numbers drawn inside a compiled graph (BBB's weight noise) come from inductor's own
# generator unless `fallback_random` is set, so the BBB case sets it.
#
# Recompiles: dynamo's counters after step 3 and after step 20 of a Lightning run whose τ (per
# example) and β (per epoch) decay are the same. α is the graph's tensor input; τ and β only
# shape α, outside the network.

COMPILE_NET = dict(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)


def _dbsn(compile, chunk=None):
    return DBSN(
        StructureNet(**COMPILE_NET),
        train_samples=4,
        prediction=Prediction(n_samples=6, samples_per_forward=3),
        dataset_size=40,
        theta_init_std=1.0,
        train_samples_per_forward=chunk,
        execution=Execution(compile=compile),
    )


COMPILE_CASES = {  # name: (constructor, backend)
    "dbsn_t4_grouped": (lambda c: _dbsn(c), "aot_eager"),
    "dbsn_t4_chunked": (lambda c: _dbsn(c, chunk=2), "aot_eager"),
    "map_fixed": (
        lambda c: MAP(
            StructureNet(**COMPILE_NET), learn_structure=False, dataset_size=40, execution=Execution(compile=c)
        ),
        "inductor",
    ),  # the one case with code generation (C++ on a CPU): the smallest graph
    "bbb": (
        lambda c: MAP(
            StructureNet(**COMPILE_NET),
            learn_structure=True,
            theta_init_std=1.0,
            dataset_size=40,
            weights=GaussianWeights(init_rho=-3.0),
            prediction=Prediction(n_samples=3),
            execution=Execution(compile=c),
        ),
        "aot_eager",
    ),
}


def _compiled_pair(name):
    make, backend = COMPILE_CASES[name]
    torch.manual_seed(3)
    eager = make(Compilation())
    torch.manual_seed(3)
    compiled = make(Compilation(enabled=True, backend=backend))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


@needs_cpp_compiler
@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiled_step_and_prediction_equal_eager(name):
    torch._dynamo.reset()
    eager, compiled = _compiled_pair(name)
    torch.manual_seed(0)
    # 32 x 32: a size at which a chunk's compiled backward has donated buffers (no retain_graph)
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    with torch._inductor.config.patch(fallback_random=True):
        for step in range(2):  # the second step runs the cached graphs, from moved running statistics
            kinds = assert_same(
                step_state(eager, x, y, seed=step), step_state(compiled, x, y, seed=step), rtol=1e-4, atol=1e-5
            )
        assert kinds["weight gradients"] > 20 and kinds["running statistics"] > 10
        assert kinds["theta gradient"] == (0 if name == "map_fixed" else 1)
        if name in ("dbsn_t4_grouped", "bbb"):  # S members in chunks, in eval mode under inference_mode
            torch.testing.assert_close(
                prediction(compiled, x, eager.n_samples), prediction(eager, x, eager.n_samples), rtol=1e-4, atol=1e-5
            )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile


class _CompileCounts(pl.Callback):
    """dynamo's counters after each training step, and τ, β there."""

    def __init__(self) -> None:
        self.after_step: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        counters = torch._dynamo.utils.counters
        self.after_step.append(
            {
                "graphs": counters["stats"]["unique_graphs"],
                "frames": counters["frames"]["total"],
                "recompiles": sum(counters["recompiles"].values()),
                "tau": module.tau,
                "beta": float(module.beta),
            }
        )


@needs_cpp_compiler
@pytest.mark.slow
def test_no_recompilation_while_tau_and_beta_decay():
    torch._dynamo.reset()
    torch.manual_seed(0)
    method = DBSN(
        StructureNet(**COMPILE_NET),
        train_samples=2,
        dataset_size=32,
        tau=TauSchedule(decay=0.05),
        beta=BetaSchedule(decay_per_epoch=0.1),
        execution=Execution(compile=Compilation(enabled=True, backend="aot_eager")),
    )
    data = TensorDataset(torch.randn(32, 3, 16, 16), torch.randint(0, 5, (32,)))
    counts = _CompileCounts()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counts],
    )
    trainer.fit(method, DataLoader(data, batch_size=8, shuffle=True, drop_last=True))
    assert len(counts.after_step) == 20
    third, last = counts.after_step[2], counts.after_step[-1]
    assert third["graphs"] > 0
    assert {k: third[k] for k in ("graphs", "frames", "recompiles")} == {
        k: last[k] for k in ("graphs", "frames", "recompiles")
    }
    assert last["tau"] < third["tau"] and last["beta"] < third["beta"]  # the schedules did move


# ---------------------------------------------------------------------- optimisers and lr schedules


@pytest.mark.parametrize(
    "model, extra",
    [
        ("bbb", []),
        ("fbn", []),
        ("map", []),
        ("mc_dropout", []),
        ("deep_ensemble", ["model/member=bbb", "model.size=2"]),
    ],
)
def test_sgd_decays_every_weight_but_the_gaussian_scales(model, extra, tmp_path):
    """Weight decay on ρ (1e-4) would outweigh the KL's gradient ~25,000-fold and set σ: ρ is
    in a group without decay; μ and point weights keep the configured decay; one group each."""
    cfg = compose_config("train", small_model(model, *extra), tmp_path)
    decay = (cfg.model.member if model == "deep_ensemble" else cfg.model).optim.weight_decay
    method, optimizers, schedules = configured_optimizers(cfg.model)
    assert len(schedules) == (2 if model == "deep_ensemble" else 1)  # one SGD per network, as before
    group_of = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                assert id(p) not in group_of, "a parameter in two param groups"
                group_of[id(p)] = group
    named = [(n, p) for n, p in method.named_parameters() if p.requires_grad]
    assert {id(p) for _, p in named} == set(group_of)
    rho = [n for n, _ in named if n.endswith("_rho")]
    assert bool(rho) == (model in ("bbb", "fbn", "deep_ensemble"))
    assert bool(rho) == any(n.endswith("_mu") for n, _ in named)
    for name, p in named:
        if name.endswith("_rho"):
            assert group_of[id(p)]["weight_decay"] == 0, name
        elif not name.endswith("theta"):  # θ: Adam, without decay
            assert group_of[id(p)]["weight_decay"] == decay, name
    for opt in optimizers[: len(schedules)]:  # clipping and the lr schedule act per optimiser
        assert isinstance(opt, torch.optim.SGD) and len(opt.param_groups) == (2 if rho else 1)


def test_linear_lr_schedule_is_constant_then_decays_linearly_to_zero():
    import torch

    from dbsn.methods.base import WeightOptimizer

    opt, schedule = WeightOptimizer(lr=0.01, schedule="linear", decay_start=350 / 850).build(
        [torch.nn.Parameter(torch.zeros(1))], max_epochs=850
    )
    lrs = []
    for _ in range(850):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs[:351] == [0.01] * 351  # CamVid: constant for 350 epochs
    # then linear: lr(e) = 0.01 (850 - e) / 500, last epoch 0.01 / 500, zero after training
    assert lrs[600] == pytest.approx(0.005) and lrs[849] == pytest.approx(0.01 / 500)
    assert all(a > b for a, b in zip(lrs[350:], lrs[351:]))
    with pytest.raises(ValueError, match="schedule"):
        WeightOptimizer(schedule="cosine")


# ---------------------------------------------------------------------- prediction


def test_deterministic_methods_predict_with_one_pass():
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = MAP(net, learn_structure=True, prediction=Prediction(n_samples=100), dataset_size=10).eval()
    calls = []
    original = method.stochastic_forward
    method.stochastic_forward = lambda x, n, first=0: calls.append(n) or original(x, n, first)
    with torch.no_grad():
        method.predict_log_probs(torch.randn(2, 3, 16, 16))
    assert calls == [1]


# ---------------------------------------------------------------------- every method through train() and evaluate()

METHODS = ["dbsn", "fbn", "map", "map_fixed", "mc_dropout", "bbb"]


@pytest.fixture(scope="module")
def cifar_root(cifar10_files):
    return cifar10_files(n_train=128, n_test=32, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_trains_and_evaluates(method, cifar_root, tmp_path):
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    overrides = [
        f"model={method}",
        "data=cifar10",
        f"data.root={cifar_root}",
        "data.batch_size=32",
        "data.num_workers=0",
        *tiny_for(method),
        "trainer.max_epochs=2",
    ]
    metrics = train(compose_config("train", overrides, run_dir), run_dir)
    assert set(metrics) >= {"test/error", "test/nll", "test/brier", "test/ece"}

    cfg = compose_config(
        "evaluate",
        [
            f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false",
        ],
        eval_dir,
    )
    again = evaluate(cfg, eval_dir)  # rebuilt from the checkpoint alone
    record = json.loads((run_dir / "evaluation" / "metrics.json").read_text())  # next to the run
    assert record["metrics"] == again
    # the same numbers again, stochastic methods too: the evaluation is seeded (statistics.seed),
    # as the training run's test pass was (another seed draws other members: tests/evaluation)
    assert again["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-5)


class _StepLRs(pl.Callback):
    """The weights' lr each optimiser step used, and the lr the optimiser holds at each epoch's end."""

    def __init__(self) -> None:
        self.used, self.after_epoch = [], []

    def on_fit_start(self, trainer, module) -> None:
        sgd = module._optimizers()[0]
        step = sgd.step

        def recording_step(*args, **kwargs):
            self.used.append([g["lr"] for g in sgd.param_groups])
            return step(*args, **kwargs)

        sgd.step = recording_step

    def on_train_epoch_end(self, trainer, module) -> None:
        self.after_epoch.append(module._optimizers()[0].param_groups[0]["lr"])


def test_lr_warm_up_ramps_linearly_step_by_step_then_hands_over_to_the_schedule():
    """1.5 epochs of warm-up over 4 steps per epoch: steps use lr x 1/6, 2/6, ..., 1 (the
    fraction done after each step), every param group alike (a scaled group too), and the epoch
    schedule (x0.1 at 50 %, 75 % of 4 epochs) is the one it would be without a warm-up."""
    from dbsn.methods import MAP, WeightOptimizer
    from dbsn.nets import VGG16BN

    assert WeightOptimizer(warmup_epochs=0).warmup_factor(0, 0, 4) == 1.0
    assert WeightOptimizer(warmup_epochs=2).warmup_factor(1, 1, 4) == pytest.approx(0.75)
    assert WeightOptimizer(warmup_epochs=2).warmup_factor(0, 0, float("inf")) == 1.0
    with pytest.raises(ValueError, match="warmup_epochs"):
        WeightOptimizer(warmup_epochs=-1)

    class Scaled(MAP):
        def lr_scales(self):  # the classifier at half the lr, in its own param group
            return {id(p): 0.5 for p in self.net.classifier.parameters()}

    torch.manual_seed(0)
    method = Scaled(
        VGG16BN(5, width=0.125),
        learn_structure=False,
        dataset_size=32,
        optim=WeightOptimizer(lr=0.1, warmup_epochs=1.5, grad_clip_norm=None),
    )
    data = TensorDataset(torch.randn(32, 3, 32, 32), torch.randint(0, 5, (32,)))
    lrs = _StepLRs()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[lrs],
    )
    trainer.fit(method, DataLoader(data, batch_size=8, drop_last=True))
    ramp = [min(1.0, k / 6) for k in range(1, 17)]
    schedule = [0.1] * 8 + [0.01] * 4 + [0.001] * 4  # milestones at epochs 2 and 3
    assert [pytest.approx([s * r, 0.5 * s * r]) for s, r in zip(schedule, ramp)] == lrs.used
    assert lrs.after_epoch == pytest.approx(
        [0.1, 0.1, 0.01, 0.001]
    )  # before each epoch's schedule step: untouched by the ramp


@pytest.mark.parametrize("rows", [1, 5, 12])
def test_a_bound_on_the_forwards_rows_splits_the_examples_and_changes_no_number(rows):
    """`prediction.rows_per_forward`: every forward holds at most that many rows (at least one
    example under all its members), the members stay the same, and the member log-probabilities
    and the input gradient equal those of the whole forwards up to float32 rounding (a smaller
    matrix product may sum in another order: 1 ulp here; bit for bit on make train's network)."""
    torch.manual_seed(0)
    method = DBSN(
        StructureNet(**LAYOUT_NET),
        prediction=Prediction(n_samples=6, samples_per_forward=3),
        dataset_size=50,
        theta_init_std=1.0,
    ).eval()
    x = torch.randn(7, 3, 8, 8, requires_grad=True)
    seen = []
    network = method.network
    method.network = lambda inputs, alpha: seen.append(inputs.shape[0] * alpha.shape[0]) or network(inputs, alpha)

    def members_and_gradient():
        torch.manual_seed(1)
        members = method.predict_members(x)
        return members.detach(), torch.autograd.grad(members.logsumexp(0).sum(), x)[0]

    whole, whole_grad = members_and_gradient()
    assert seen == [21, 21]  # 7 examples x 3 members, twice
    seen.clear()
    method.prediction.rows_per_forward = rows
    split, split_grad = members_and_gradient()
    assert max(seen) == max(rows // 3, 1) * 3 and sum(seen) == 42
    assert torch.allclose(whole, split, rtol=0, atol=1e-6) and torch.allclose(whole_grad, split_grad, rtol=0, atol=1e-7)


def test_weights_that_draw_noise_at_every_forward_keep_their_forwards_whole():
    method = MAP(
        StructureNet(**LAYOUT_NET),
        weights=MCDropoutWeights(p=0.2),
        dataset_size=50,
        prediction=Prediction(n_samples=4, samples_per_forward=2, rows_per_forward=3),
    ).eval()
    method.enable_test_noise()
    seen = []
    network = method.network
    method.network = lambda inputs, alpha: seen.append(inputs.shape[0]) or network(inputs, alpha)
    method.predict_members(torch.randn(5, 3, 8, 8))
    assert seen == [5, 5]


def test_a_bound_below_one_row_is_refused():
    with pytest.raises(ValueError, match="rows_per_forward must be >= 1"):
        Prediction(rows_per_forward=0)
