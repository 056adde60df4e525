"""Snapshot ensembles (dbsn.posthoc.snapshot_ensemble): the cosine cycles against the authors' epochs and formula and
cSG-MCMC's cyclical schedule, the lr of every training step, one snapshot per cycle at its last epoch, a run resumed
mid-cycle ending with the uninterrupted run's snapshots bit for bit, the ensemble's prediction against the snapshots'
softmaxes averaged by hand, stochastic methods and deep ensembles as snapshots, the refusals, and train() +
evaluate.py posthoc=snapshot_ensemble on digits."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch

import dbsn.runtime.run
from dbsn.methods import DBSN, MAP, DeepEnsemble, Prediction
from dbsn.posthoc.base import PosthocError
from dbsn.posthoc.snapshot_ensemble import (
    STATE_KEY,
    SnapshotCollector,
    SnapshotEnsemble,
    SnapshotEnsembleMethod,
    SnapshotSchedule,
    load_snapshot_state,
)
from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.sampling import CyclicalSchedule
from tests.support.configs import TINY, compose_config, evaluate_quietly, evaluate_the_whole_suite
from tests.support.netutil import tiny_structure_net


def test_cycles_end_where_the_authors_take_their_snapshots():
    """gaohuang/SnapshotEnsemble main_snapshot_ensemble.lua: snapshot c is the model after epoch c·⌊B/M⌋ (counted from
    1), the last after epoch B."""
    for epochs, cycles in ((200, 5), (10, 3), (7, 7), (9, 1), (11, 4)):
        authors = [epochs if c == cycles else c * (epochs // cycles) for c in range(1, cycles + 1)]
        assert SnapshotSchedule(cycles).cycle_ends(epochs) == [e - 1 for e in authors]
    with pytest.raises(ValueError, match="5 cycles needs at least 5 epochs.*max_epochs=4"):
        SnapshotSchedule(5).cycle_ends(4)
    with pytest.raises(ValueError, match="integer >= 1"):
        SnapshotSchedule(0)


def test_the_lr_is_eq_2_cyclical_schedule_step_for_step_and_the_authors_one_step_later():
    """Where M divides B: α / α₀ at every step equals cSG-MCMC's cyclical step size (the same Eq.), and the authors'
    learningRateCosine (T_cur = ((epoch − 1) mod n)·batches + iter, iter from 1) of the step before."""
    epochs, cycles, batches = 6, 3, 5
    schedule, cyclical = SnapshotSchedule(cycles), CyclicalSchedule(cycles=cycles, exploration=1.0)
    total = epochs * batches
    factors = [schedule.lr_factor(e, b, batches, epochs) for e in range(epochs) for b in range(batches)]
    assert factors == pytest.approx([cyclical.lr_factor(step, total) for step in range(total)], abs=1e-15)
    n = epochs // cycles
    for step in range(total):  # the authors' lr at the step before (their epoch and iter count from 1)
        if step % (n * batches) == 0:
            continue  # a restart: α₀ here; their step before, a cycle's last, had 0
        epoch, iteration = divmod(step - 1, batches)
        t = (epoch % n) * batches + iteration + 1
        assert factors[step] == pytest.approx(0.5 * (1 + math.cos(math.pi * t / (n * batches))), abs=1e-15)
    starts = [factors[c * n * batches] for c in range(cycles)]
    assert starts == [1.0] * cycles and min(factors) > 0  # α₀ at every restart; never 0 (Eq. 2's last step)
    # M not dividing B: the last cycle runs from its first epoch over the rest (3, 3, then 4 epochs)
    last = [SnapshotSchedule(3).lr_factor(e, 0, 1, 10) for e in range(6, 10)]
    assert last == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])


COMMON = [
    "model=map_fixed",
    "data=digits",
    "data.batch_size=16",
    "trainer.limit_train_batches=3",
    "test=false",
    "seed=3",
    "callbacks=snapshot_ensemble",
    "callbacks.snapshot_ensemble.cycles=3",
    "trainer.max_epochs=6",
    "~callbacks.progress_bar",
    *[o for o in TINY if not o.startswith(("model.train_samples", "model.prediction"))],
]


class _Spy(pl.Callback):
    """The weights' lr at every training step (after the collector set it), and optionally a stop."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.lrs: list[tuple[int, int, float]] = []
        self.stop_after = stop_after

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append((trainer.current_epoch, batch_idx, float(trainer.optimizers[0].param_groups[0]["lr"])))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.stop_after:
            trainer.should_stop = True


def _train(overrides, out, monkeypatch, spy=None):
    from dbsn.runtime.run import train

    with monkeypatch.context() as patch:
        if spy is not None:
            build_trainer = dbsn.runtime.run.build_trainer
            patch.setattr(
                dbsn.runtime.run,
                "build_trainer",
                lambda cfg, o, callbacks=(), loggers=(): build_trainer(cfg, o, [*callbacks, spy], loggers),
            )
        train(compose_config("train", overrides, out), out)
    return load_checkpoint(out / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 6-epoch run of 3 cycles, the same run stopped after epoch 2 (inside the second cycle), and that run
    resumed from its last checkpoint."""
    tmp = tmp_path_factory.mktemp("snapshots")
    patch = pytest.MonkeyPatch()
    try:
        spy = _Spy()
        straight = _train(COMMON, tmp / "straight", patch, spy)
        stopped = _train(COMMON, tmp / "stopped", patch, _Spy(stop_after=2))
        resumed = _train(
            [*COMMON, f"ckpt_path={tmp / 'stopped' / 'checkpoints' / 'last.ckpt'}"], tmp / "resumed", patch
        )
    finally:
        patch.undo()
    return {"straight": straight, "stopped": stopped, "resumed": resumed, "lrs": spy.lrs, "dir": tmp}


def test_every_step_has_the_cycles_lr_and_each_cycle_one_snapshot_at_its_end(runs):
    lrs, schedule = runs["lrs"], SnapshotSchedule(3)
    assert len(lrs) == 6 * 3
    for epoch, batch, lr in lrs:
        assert lr == pytest.approx(0.2 * schedule.lr_factor(epoch, batch, 3, 6), rel=1e-12), (epoch, batch)
    state = load_snapshot_state(runs["straight"])
    assert state["epochs"] == [1, 3, 5] and len(state["snapshots"]) == 3 and state["cycles"] == 3
    final = runs["straight"]["state_dict"]
    assert state["snapshots"][-1].keys() == final.keys()
    assert all(torch.equal(state["snapshots"][-1][k], final[k]) for k in final)  # the last snapshot: the final model
    first = state["snapshots"][0]
    assert not torch.equal(first["net.classifier.weight"], final["net.classifier.weight"])
    assert any("running_mean" in k for k in first)  # BatchNorm's statistics are part of each snapshot


def test_a_run_resumed_mid_cycle_keeps_its_snapshots_and_ends_with_the_uninterrupted_ones(runs):
    stopped = load_snapshot_state(runs["stopped"])
    assert runs["stopped"]["epoch"] == 2 and stopped["epochs"] == [1]  # stopped inside the second cycle
    straight, resumed = load_snapshot_state(runs["straight"]), load_snapshot_state(runs["resumed"])
    assert resumed["epochs"] == straight["epochs"] == [1, 3, 5]
    for a, b in zip(straight["snapshots"], resumed["snapshots"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(stopped["snapshots"][0][k], straight["snapshots"][0][k]) for k in straight["snapshots"][0])


def _by_hand(snapshot: dict, x: torch.Tensor) -> torch.Tensor:
    """One snapshot's softmax on x, from its tensors through the plain network (no method built)."""
    net = tiny_structure_net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in snapshot.items() if k.startswith("net.")})
    net.eval()
    return torch.softmax(net(x, snapshot["fixed_alpha"].unsqueeze(0), replicate=True), dim=-1)


def test_the_prediction_is_the_mean_of_the_snapshots_softmaxes_by_hand(runs):
    from dbsn.runtime.build import load_method

    checkpoint = runs["straight"]
    method = load_method(runs["dir"] / "straight" / "checkpoints" / "last.ckpt", num_classes=10, checkpoint=checkpoint)
    x = torch.randn(5, 3, 32, 32)
    snapshots = load_snapshot_state(checkpoint)["snapshots"]
    posterior = SnapshotEnsemble()
    assert posterior.why_not(method, checkpoint) is None
    posterior.check(method, None, checkpoint)
    with torch.no_grad():
        ensemble = posterior.fit(method, None, checkpoint)
        assert isinstance(ensemble, SnapshotEnsembleMethod) and ensemble.num_members == 3
        expected = torch.stack([_by_hand(s, x) for s in snapshots]).mean(0)
        torch.testing.assert_close(ensemble.predict_log_probs(x).exp(), expected, rtol=1e-5, atol=1e-6)
        last_two = SnapshotEnsemble(last=2).fit(method, None, checkpoint)
        torch.testing.assert_close(
            last_two.predict_log_probs(x).exp(),
            torch.stack([_by_hand(s, x) for s in snapshots[1:]]).mean(0),
            rtol=1e-5,
            atol=1e-6,
        )
    assert ensemble.run_facts()["snapshot_epochs"] == [1, 3, 5] and last_two.epochs == [3, 5]
    with pytest.raises(PosthocError, match="posthoc.last=4, but the run collected 3 snapshots"):
        SnapshotEnsemble(last=4).check(method, None, checkpoint)
    assert "needs the snapshots its run collected" in SnapshotEnsemble().why_not(method, {"callbacks": {}})


def test_train_and_evaluate_posthoc_snapshot_ensemble_on_digits(runs, tmp_path):
    run = runs["dir"] / "straight"
    results = evaluate_quietly(run / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=snapshot_ensemble"])
    assert 0 <= results["test/error"] <= 1
    record = json.loads((run / "posthoc" / "snapshot_ensemble" / "metrics.json").read_text())
    assert record["posthoc"] == "snapshot_ensemble" and record["n_samples"] == 3
    assert record["snapshot_epochs"] == [1, 3, 5]


def _collected(method, states) -> dict:
    """A checkpoint holding the snapshots of `method` at each state of `states` (applied in place)."""
    collector = SnapshotCollector(cycles=len(states))
    for epoch, change in enumerate(states):
        change(method)
        collector.collect(method, epoch)
    return {"callbacks": {STATE_KEY: collector.state_dict()}}


def test_stochastic_methods_and_deep_ensembles_are_snapshots_too():
    """DBSN's snapshots each keep their own θ and predict with their own S structures; a deep ensemble's snapshots
    are its networks, K per snapshot."""
    torch.manual_seed(0)
    dbsn = DBSN(tiny_structure_net(), dataset_size=10, prediction=Prediction(n_samples=3)).eval()
    thetas = []

    def shift(method):
        with torch.no_grad():
            method.structure.theta.add_(torch.randn_like(method.structure.theta))
        thetas.append(method.structure.theta.detach().clone())

    checkpoint = _collected(dbsn, [shift, shift])
    ensemble = SnapshotEnsemble().fit(dbsn, None, checkpoint, n_samples=2)
    assert [type(m) for m in ensemble.members] == [DBSN, DBSN] and [m.n_samples for m in ensemble.members] == [2, 2]
    for member, theta in zip(ensemble.members, thetas):
        torch.testing.assert_close(member.structure.theta, theta)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert ensemble.predict_members(x).shape == (2, 2, 10)

    ensemble_of_two = DeepEnsemble([MAP(tiny_structure_net(), learn_structure=False) for _ in range(2)]).eval()
    checkpoint = _collected(ensemble_of_two, [lambda m: None] * 3)
    flat = SnapshotEnsemble().fit(ensemble_of_two, None, checkpoint)
    assert flat.num_members == 6 and flat.epochs == [0, 0, 1, 1, 2, 2] and all(type(m) is MAP for m in flat.members)


class _Trainer:
    """What the collector reads of a trainer."""

    def __init__(self, optimizers, schedules, max_epochs=6):
        self.optimizers, self.lr_scheduler_configs, self.max_epochs = optimizers, schedules, max_epochs


def test_runs_it_cannot_drive_are_refused_before_training():
    method = MAP(tiny_structure_net(), learn_structure=False)
    sgd = torch.optim.SGD(method.parameters(), lr=0.1)
    collector = SnapshotCollector(cycles=3)
    with pytest.raises(ValueError, match="3 cycles needs at least 3 epochs"):
        collector.on_fit_start(_Trainer([sgd], [object()], max_epochs=2), method)
    with pytest.raises(ValueError, match="weights move by a step size of its own"):
        collector.on_fit_start(_Trainer([sgd], []), method)  # cSG-MCMC: a sampler, no schedule
    method.optim.warmup_epochs = 1
    with pytest.raises(ValueError, match="set model.optim.warmup_epochs=0"):
        collector.on_fit_start(_Trainer([sgd], [object()]), method)
    with pytest.raises(ValueError, match="resume with callbacks.snapshot_ensemble.cycles=5"):
        collector.load_state_dict(SnapshotCollector(cycles=5).state_dict())
    with pytest.raises(ValueError, match="lr .* must be > 0"):
        SnapshotCollector(lr=0.0)


def test_a_group_keeps_its_multiple_of_the_methods_lr():
    """BatchEnsemble's fast weights at half the lr stay at half α₀; a captured (tensor) lr is written in place."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.05}], lr=0.1)
    torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=[1])  # sets each group's initial_lr, as the methods' do
    captured = torch.optim.SGD([{"params": [a], "lr": torch.tensor(0.1)}], lr=0.1)
    torch.optim.lr_scheduler.MultiStepLR(captured, milestones=[1])
    tensor = captured.param_groups[0]["lr"]
    trainer = _Trainer([sgd, captured], [object(), object()], max_epochs=4)
    trainer.current_epoch, trainer.num_training_batches = 1, 4
    SnapshotCollector(cycles=2, lr=0.2).set_lr(trainer, 2)  # step 6 of a cycle of 8: factor (cos(3π/4) + 1) / 2
    factor = 0.5 * (math.cos(math.pi * 6 / 8) + 1)
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([0.2 * factor, 0.1 * factor])
    assert captured.param_groups[0]["lr"] is tensor and tensor.item() == pytest.approx(0.2 * factor)


@pytest.mark.slow
def test_the_evaluation_suite_runs_on_the_snapshot_ensemble(runs, tmp_path):
    """evaluate.py posthoc=snapshot_ensemble with OOD detection by every score (each snapshot's features and head),
    dataset shift on generated corruptions, conformal sets and the adversarial attacks."""
    evaluate_the_whole_suite(
        runs["dir"] / "straight" / "checkpoints" / "last.ckpt",
        tmp_path,
        tmp_path,
        extra=["posthoc=snapshot_ensemble", f"output_dir={tmp_path / 'out'}"],
    )


@pytest.mark.slow
def test_a_dbsn_run_collects_snapshots_and_evaluates_as_their_ensemble(tmp_path):
    """DBSN (structures sampled, θ by its own Adam): the collector drives the weights' SGD alone; the ensemble's
    members are the snapshots' DBSNs, each with its own θ and S structures."""
    from dbsn.runtime.run import train

    run = tmp_path / "run"
    overrides = [
        "model=dbsn",
        "data=digits",
        "data.batch_size=16",
        "trainer.limit_train_batches=2",
        "test=false",
        "callbacks=snapshot_ensemble",
        "callbacks.snapshot_ensemble.cycles=2",
        "trainer.max_epochs=2",
        "~callbacks.progress_bar",
        *TINY,
    ]
    train(compose_config("train", overrides, run), run)
    state = load_snapshot_state(load_checkpoint(run / "checkpoints" / "last.ckpt"))
    assert state["epochs"] == [0, 1]
    assert not torch.equal(state["snapshots"][0]["structure.theta"], state["snapshots"][1]["structure.theta"])
    results = evaluate_quietly(run / "checkpoints" / "last.ckpt", tmp_path, ["posthoc=snapshot_ensemble"])
    record = json.loads((run / "posthoc" / "snapshot_ensemble" / "metrics.json").read_text())
    assert 0 <= results["test/error"] <= 1 and record["n_samples"] == 2 and record["snapshot_epochs"] == [0, 1]
