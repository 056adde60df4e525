"""The DBSN method: grouped T-sample loss and S-sample prediction equal their loops."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from dbsn.methods import DBSN, Prediction
from dbsn.nets import StructureNet


def _method(train_samples=3) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    return DBSN(net, train_samples=train_samples, dataset_size=100,
                prediction=Prediction(n_samples=100, val_samples=10, samples_per_forward=2))


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
    for batch, steps, world, parallel in [(64, 1000, 1, "data"), (32, 2000, 1, "data"), (64, 250, 4, "data"),
                                          (64, 1000, 4, "structure")]:
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
