"""The training step without host synchronisation (dbsn.methods.step), on the CPU: no operation in
a step reads a device value on the host, counted with a dispatch mode under Lightning's loop;
τ, β and the learning rate that the step sees are device tensors that follow their schedules
over many steps (a value frozen into a captured graph would fail); the NaN guard skips the bad
step and every later one on the device, and raises at its check naming the first."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dbsn.methods.base
import dbsn.methods.training
from dbsn.methods import DBSN, MAP, Execution, WeightOptimizer
from dbsn.methods.step import FiniteGuard, NonFiniteLossError
from dbsn.nets import StructureNet
from dbsn.structure.schedules import REFERENCE_BATCH, BetaSchedule, TauSchedule
from dbsn.tools.bench.step import HOST_READS, OpCounter


class _CountInSteps(pl.Callback):
    """Counts the host reads (`dbsn.tools.bench.step.HOST_READS`) within every training step,
    Lightning's own work in it included."""

    def __init__(self) -> None:
        self.counts: list[dict[str, int]] = []
        self._mode: OpCounter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._mode = OpCounter()
        self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._mode.__exit__(None, None, None)
        self.counts.append({name: n for name, n in self._mode.counts.items() if name in HOST_READS})


def _data(n: int = 48, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 3, 16, 16, generator=generator), torch.randint(0, 5, (n,), generator=generator))
    return DataLoader(data, batch_size=8)


def _dbsn(**kwargs) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)
    return DBSN(net, train_samples=4, dataset_size=48, **kwargs)


def _fit(method, epochs: int = 2, callbacks=(), data=None) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(method, data or _data())
    return trainer


@pytest.mark.parametrize("chunk", [None, 2], ids=["grouped", "chunked"])
def test_a_training_step_reads_nothing_on_the_host(chunk):
    """Every step but the first reads nothing on the host; the first makes the BatchNorm update's
    index tensors from host lists, once (`RunningStatistics`; a CUDA graph's warm-up steps do it)."""
    counter = _CountInSteps()
    _fit(_dbsn(train_samples_per_forward=chunk), callbacks=[counter])
    assert len(counter.counts) == 12 and all(c == {} for c in counter.counts[1:]), counter.counts
    assert set(counter.counts[0]) <= {"aten.lift_fresh"}, counter.counts[0]


def test_the_count_sees_the_immediate_nan_check(monkeypatch):
    """Guards the test above: optimisers that cannot skip a step on the device get the immediate
    NaN check, whose `.item()` the count sees in every step."""
    monkeypatch.setattr(FiniteGuard, "attach", lambda self, optimizers, device: False)
    counter = _CountInSteps()
    _fit(_dbsn(), epochs=1, callbacks=[counter])
    assert all(c.get("aten._local_scalar_dense", 0) >= 1 for c in counter.counts), counter.counts


class _EagerGraph:
    """Stands in for `GraphedStep` on the CPU: runs the step eagerly, as a replay would run it."""

    instances: list[_EagerGraph] = []

    def __init__(self, body, zero) -> None:
        self.body, self.zero, self.calls = body, zero, 0
        _EagerGraph.instances.append(self)

    def __call__(self, x, y):
        self.calls += 1
        self.zero()
        return self.body(x, y)


def test_tau_beta_and_the_learning_rate_follow_their_schedules_inside_a_graphed_step(monkeypatch):
    """With `execution.cuda_graph` the step reads τ, β and every learning rate from device tensors
    that the host writes in place between steps: the same tensor objects every step (what a graph
    captured), holding each step's scheduled value. τ decays per example, β per epoch, the lr by
    its warm-up within the first epoch and its milestone after the second."""
    monkeypatch.setattr(dbsn.methods.training, "GraphedStep", _EagerGraph)
    monkeypatch.setattr(dbsn.methods.base.Method, "_graph_refusal", lambda self: None)
    _EagerGraph.instances.clear()
    tau, beta = TauSchedule(initial=3.0, decay=0.5, minimum=1.0), BetaSchedule(start=1.0, end=0.5, decay_per_epoch=0.2)
    method = _dbsn(
        tau=tau,
        beta=beta,
        execution=Execution(cuda_graph=True),
        optim=WeightOptimizer(lr=0.1, warmup_epochs=1, milestones=(0.6,), gamma=0.5),
    )
    seen = []
    sample = method.structure.sample

    def spy(n, b, t):
        weights_lr = method.trainer.optimizers[0].param_groups[0]["lr"]
        seen.append((t, b, weights_lr, float(t), float(b), float(weights_lr)))
        return sample(n, b, t)

    method.structure.sample = spy
    _fit(method, epochs=3)
    assert len(_EagerGraph.instances) == 1 and _EagerGraph.instances[0].calls == 18
    taus, betas, lrs = zip(*[(t, b, lr) for t, b, lr, *_ in seen])
    assert all(isinstance(t, torch.Tensor) for t in taus)
    assert all(b is betas[0] for b in betas) and all(lr is lrs[0] for lr in lrs), "the step must read the same tensors"
    for step, (*_, t, b, lr) in enumerate(seen):
        epoch, batch = divmod(step, 6)
        assert t == pytest.approx(tau(step * 8 / REFERENCE_BATCH), rel=1e-6)
        assert b == pytest.approx(beta(epoch), rel=1e-6)
        warm = min(1.0, (batch + 1) / 6) if epoch == 0 else 1.0
        assert lr == pytest.approx(0.1 * warm * (0.5 if epoch >= 2 else 1.0), rel=1e-6), (step, lr)
    assert len({round(float(t), 6) for t, *_ in seen}) == 18 and len({round(lr, 6) for *_, lr in seen}) > 3


def test_a_nan_loss_skips_its_step_and_every_later_one_and_raises_at_the_check(monkeypatch):
    """The loss of the fourth step is NaN: the fused optimisers skip it (and the steps after it, up to
    the check at the epoch's last batch), the BatchNorm statistics stay, and the run stops naming
    the fourth step."""
    method = _dbsn()
    original = method.training_loss
    calls = []
    states = []

    def poisoned(x, y):
        out = original(x, y)
        calls.append(1)
        if len(calls) >= 4:
            out["loss"] = out["loss"] * float("nan")
        return out

    class Snapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    method.training_loss = poisoned
    with pytest.raises(NonFiniteLossError, match=r"nan at global step 6 \(epoch 0, batch 3\)"):
        _fit(method, epochs=2, callbacks=[Snapshot()])
    assert len(calls) == 6  # the check ran at the epoch's last batch, before any checkpoint or a second epoch
    before_bad = states[3]
    for key, value in method.state_dict().items():
        if key not in ("examples_seen",):
            assert torch.equal(value, before_bad[key]), key


def test_the_guard_checks_every_so_many_steps_and_at_the_last_batch():
    guard = FiniteGuard()
    assert guard.due(FiniteGuard.check_every, last_batch=False) and guard.due(7, last_batch=True)
    assert not guard.due(FiniteGuard.check_every + 1, last_batch=False)


def test_a_graph_is_refused_in_one_line_where_it_cannot_run():
    method = MAP(
        StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8),
        learn_structure=False,
        dataset_size=48,
        execution=Execution(cuda_graph=True),
    )
    with pytest.raises(
        ValueError,
        match=r"model.execution.cuda_graph=true: it captures the step on a CUDA device, "
        r"and this run trains on cpu\. Set model.execution.cuda_graph=false\.",
    ):
        _fit(method, epochs=1)


def test_predictions_go_through_the_graphed_forward_only_with_the_modules_own_statistics():
    """`execution.cuda_graph_prediction` routes the members' forwards through `GraphedForward` (on a CPU
    it runs them eagerly: the same numbers), except where each member brings its own BatchNorm
    statistics (a graph would replay the first member's)."""
    from dbsn.methods import BatchNormRecalibration
    from dbsn.methods.step import GraphedForward

    calls = []

    class Spy(GraphedForward):
        def __call__(self, *inputs):
            calls.append(inputs[0].shape[0])
            return super().__call__(*inputs)

    plain, graphed = _dbsn(), _dbsn(execution=Execution(cuda_graph_prediction=True))
    assert isinstance(graphed._graphed_network, GraphedForward) and plain._graphed_network is None
    graphed._graphed_network = Spy(graphed.network, graphed._module_modes)
    graphed.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 16, 16)
    for method in (plain, graphed):
        method.eval()
    torch.manual_seed(1)
    expected = plain.predict_members(x, 6)
    torch.manual_seed(1)
    torch.testing.assert_close(graphed.predict_members(x, 6), expected)
    assert calls == [4] * 1 and graphed._graphed_network.graphs == {}  # one forward of 6 members; no graph on a CPU
    graphed.bn_recalibration = BatchNormRecalibration(enabled=True, images=4, batch_size=4)
    graphed.use_calibration_images([torch.randn(4, 3, 16, 16)])
    calls.clear()
    graphed.predict_members(x, 2)
    assert calls == []
