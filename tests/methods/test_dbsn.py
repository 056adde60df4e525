"""The DBSN method (dbsn.methods.dbsn): grouped T-sample loss and S-sample prediction equal their
loops, τ and β, the structure law it predicts with, and per-structure BatchNorm statistics.

Per-structure BatchNorm statistics at prediction: each fixed member of the Bayes ensemble is
normalised with the statistics of its own structure, computed for many structures in grouped
forwards; they must equal those of the structure alone.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dbsn.methods import DBSN, BatchNormRecalibration, Prediction
from dbsn.nets import GroupBatchNorm2d, StructureNet
from tests.support.netutil import tiny_structure_net


def _method(train_samples=3) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    return DBSN(
        net,
        train_samples=train_samples,
        dataset_size=100,
        prediction=Prediction(n_samples=100, val_samples=10, samples_per_forward=2),
    )


def test_training_loss_equals_average_over_separate_structures():
    method = _method(train_samples=3)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    alpha = method.structure.sample(3, 1.0, 2.0).detach()
    method.structure.sample = lambda n, beta, tau: alpha  # the draws the loop below uses too
    reference = copy.deepcopy(method.net)  # training-mode BN: per-structure batch statistics

    out = method.training_loss(x, y)
    separate = torch.stack([F.cross_entropy(reference(x, alpha[t]), y) for t in range(3)])
    torch.testing.assert_close(out["nll"], separate.mean(), rtol=1e-5, atol=1e-6)
    kl = method.structure.kl(alpha, method.beta, method.tau).mean()
    torch.testing.assert_close(out["loss"], separate.mean() + kl / 100, rtol=1e-5, atol=1e-6)


def test_stochastic_forward_returns_members_in_sample_order():
    method = _method().eval()
    x = torch.randn(3, 3, 16, 16)
    alpha = torch.softmax(torch.randn(4, method.net.num_edges, method.net.num_ops), -1)
    method.sample_structures = lambda n, tau=None: alpha[:n]
    with torch.no_grad():
        members = method.stochastic_forward(x, 4)
        assert members.shape == (4, 3, 5)
        for s in range(4):
            torch.testing.assert_close(members[s], method.net(x, alpha[s]), rtol=1e-5, atol=1e-6)


def test_prediction_uses_test_tau_and_final_beta():
    method = _method()
    seen = {}

    def sample(n, beta, tau):
        seen.update(beta=float(beta), tau=float(tau))
        return torch.full((n, method.net.num_edges, method.net.num_ops), 1 / method.net.num_ops)

    method.structure.sample = sample
    method.beta.fill_(0.6)
    method.eval()
    with torch.no_grad():
        method.predict_log_probs(torch.randn(2, 3, 16, 16), n_samples=2)
    assert seen["tau"] == 1.0 and abs(seen["beta"] - 0.6) < 1e-6


def test_tau_follows_examples_seen_not_steps():
    """τ's progress is examples / 64: 1000 steps at batch 64 = 2000 at batch 32 = 250 steps of
    4 data-parallel ranks at 64; structure-parallel ranks share their batch (no factor)."""
    expected = 3.0 * math.exp(-1.5e-5 * 1000)
    for batch, steps, world, parallel in [
        (64, 1000, 1, "data"),
        (32, 2000, 1, "data"),
        (64, 250, 4, "data"),
        (64, 1000, 4, "structure"),
    ]:
        method = _method()
        method.parallel = parallel
        method._world_size = lambda: world
        assert method.tau == 3.0
        for _ in range(steps):
            method.on_after_optimizer_step(batch)
        assert int(method.examples_seen) == 64 * 1000
        assert abs(method.tau - expected) < 1e-12 and abs(method.trained_tau - expected) < 1e-12


def test_prediction_at_another_tau_warns_once_naming_both_and_the_overrides(recwarn):
    method = _method()
    method.examples_seen.fill_(64 * 1000)  # τ = 3 exp(-0.015) = 2.955
    method.warn_if_tau_differs()
    method.warn_if_tau_differs()
    messages = [str(w.message) for w in recwarn if "test_tau" in str(w.message)]
    assert len(messages) == 1
    assert "τ = 2.955" in messages[0] and "test_tau = 1" in messages[0]
    assert "model.test_tau=2.955" in messages[0] and f"model.tau.decay={math.log(3) / 1000:.3g}" in messages[0]
    assert method.run_facts() == {"train_tau_final": method.trained_tau, "test_tau": 1.0, "bn_statistics": "running"}
    finished = _method()
    finished.examples_seen.fill_(64 * 80_000)  # past τ = 1
    finished.warn_if_tau_differs()
    assert not [w for w in recwarn if "test_tau" in str(w.message)][1:]


def test_a_checkpoint_with_the_old_step_counter_loads_with_the_same_tau():

    from dbsn.methods import DBSN
    from dbsn.nets import StructureNet

    net = StructureNet(num_classes=3, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = DBSN(net, dataset_size=10)
    old = method.state_dict()
    old["structure_step"] = old.pop("examples_seen").fill_(1000)  # written before τ counted examples
    method.load_state_dict(old, strict=True)
    assert int(method.examples_seen) == 64 * 1000
    assert method.trained_tau == pytest.approx(3 * math.exp(-1.5e-5 * 1000))


# ---------------------------------------------------------------------- the structure law it predicts with
def _net() -> StructureNet:
    torch.manual_seed(0)
    return tiny_structure_net(num_classes=5)


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_dbsn_structure_probabilities_are_the_argmax_law_of_its_samples(tau):
    method = DBSN(_net(), dataset_size=100)
    theta = torch.tensor([[1.0, 0.0, -1.0, 0.5], [2.0, -1.0, 0.0, 0.0], [0.3, 0.3, -0.5, 0.1]])
    with torch.no_grad():
        method.structure.theta.copy_(theta)
    method.beta.fill_(0.5)
    n = 200_000
    torch.manual_seed(0)
    with torch.no_grad():
        chosen = method.structure.sample(n, method.beta, tau).argmax(-1)
    frequency = F.one_hot(chosen, 4).double().mean(0)
    probs = method.structure_probabilities().double()
    std = (probs * (1 - probs) / n).sqrt()
    assert ((frequency - probs).abs() < 5 * std).all(), (frequency, probs)
    # and β matters: softmax(θ), the law at β = 1, is far outside the Monte Carlo error
    assert ((frequency - torch.softmax(theta, -1).double()).abs() > 20 * std).any()


# ---------------------------------------------------------------------- per-structure BatchNorm statistics


class _Images:
    """What the method needs of a data module: training images and their preprocessing."""

    def __init__(self, n: int = 24) -> None:
        self.images = torch.randint(
            0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )

    def training_images(self, n: int, seed: int = 0) -> torch.Tensor:
        return self.images[:n]

    def preprocess(self, images: torch.Tensor, train: bool = False) -> torch.Tensor:
        return images.float() / 255 - 0.5


def _recalibrating_method(enabled: bool = True) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(
        net,
        dataset_size=100,
        prediction=Prediction(n_samples=100, val_samples=10, samples_per_forward=2),
        bn_recalibration=BatchNormRecalibration(enabled=enabled, images=24, batch_size=10),
    )
    with torch.no_grad():  # running statistics unlike any structure's, as after training
        for m in net.modules():
            if isinstance(m, GroupBatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    method.beta.fill_(0.5)
    return method.eval()


def _alone(method: DBSN, alpha: torch.Tensor, batches: list[torch.Tensor]):
    """The network with the running statistics of one structure on `batches`, computed the
    plain way: nn.BatchNorm2d's cumulative average (momentum=None) over the batches, groups = 1."""
    net = copy.deepcopy(method.net).train()
    for m in net.modules():
        if isinstance(m, GroupBatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    with torch.no_grad():
        for x in batches:
            net(x, alpha)
    return net.eval()


def test_each_member_has_the_statistics_of_its_structure_alone():
    method, data = _recalibrating_method(), _Images()
    method.prepare_prediction(data)
    batches = [data.preprocess(b) for b in data.images.split(10)]  # 10, 10, 4 images
    alpha, statistics = method._fixed_members(5)  # grouped forwards of 2, 2 and 1 structures
    assert alpha.shape[0] == 5 and len(statistics) == sum(isinstance(m, GroupBatchNorm2d) for m in method.net.modules())
    for s in range(5):
        reference = dict(_alone(method, alpha[s], batches).named_modules())
        for name, (mean, var) in statistics.items():
            torch.testing.assert_close(mean[s], reference[name].running_mean, rtol=1e-4, atol=1e-5, msg=name)
            torch.testing.assert_close(var[s], reference[name].running_var, rtol=1e-4, atol=1e-5, msg=name)
    # the network's own running statistics are untouched
    assert all(
        torch.equal(a, b)
        for a, b in zip(method.net.state_dict().values(), _recalibrating_method().net.state_dict().values())
    )


def test_a_member_predicts_as_its_structure_alone_with_its_statistics():
    method, data = _recalibrating_method(), _Images()
    method.prepare_prediction(data)
    batches = [data.preprocess(b) for b in data.images.split(10)]
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        members = method.stochastic_forward(x, 3, first=2)  # members 2, 3, 4
        alpha = method.prediction_structures(3, first=2)
        for i in range(3):
            torch.testing.assert_close(members[i], _alone(method, alpha[i], batches)(x, alpha[i]), rtol=1e-4, atol=1e-5)
        # with the shared running statistics the prediction is another one
        assert not torch.allclose(members[0], method.net(x, alpha[0]), atol=1e-3)


def test_members_are_fixed_and_grow_on_demand_while_recalibrated():
    method, data = _recalibrating_method(), _Images()
    method.prepare_prediction(data)
    first = method.prediction_structures(3)
    assert torch.equal(method.prediction_structures(2, first=1), first[1:3])
    more = method.prediction_structures(4, first=3)  # members 3..6 are drawn now
    assert torch.equal(method.prediction_structures(7)[:3], first) and torch.equal(
        method.prediction_structures(7)[3:], more
    )
    method.prepare_prediction(data)  # a new test pass: the same members, drawn from the setting's seed
    torch.manual_seed(123)  # whatever the global stream
    assert torch.equal(method.prediction_structures(3), first)


def test_data_parallel_ranks_predict_with_the_same_members():
    """Each data-parallel rank's random stream is its own (the seed is offset per rank), yet the
    fixed members (and their statistics) are the same on every rank: one ensemble scores the
    whole test set. Two ranks emulated by two copies of the trained method with different global
    streams."""
    data = _Images()
    ranks = []
    for rank in range(2):
        method = _recalibrating_method()
        torch.manual_seed(1000 + 104729 * rank)  # as Method.on_fit_start offsets ranks
        method.prepare_prediction(data)
        ranks.append(method._fixed_members(5))
    assert torch.equal(ranks[0][0], ranks[1][0])
    for name in ranks[0][1]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][1][name], ranks[1][1][name]))


def test_without_recalibration_every_call_draws_fresh_structures_with_running_statistics():
    method, data = _recalibrating_method(enabled=False), _Images()
    method.prepare_prediction(data)
    assert not torch.equal(method.prediction_structures(3), method.prediction_structures(3))
    x = torch.randn(4, 3, 16, 16)
    torch.manual_seed(5)
    members = method.stochastic_forward(x, 2)
    torch.manual_seed(5)
    alpha = method.prediction_structures(2)
    torch.testing.assert_close(members[1], method.net(x, alpha[1]))
