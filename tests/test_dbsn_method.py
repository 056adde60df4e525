"""The DBSN method: grouped T-sample loss and S-sample prediction equal their loops."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from dbsn.methods import DBSN
from dbsn.nets import StructureNet


def _method(train_samples=3) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    return DBSN(net, train_samples=train_samples, dataset_size=100, samples_per_forward=2)


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


def test_step_counter_drives_tau():
    method = _method()
    assert method.tau == 3.0
    for _ in range(1000):
        method.on_after_optimizer_step()
    assert int(method.structure_step) == 1000
    assert abs(method.tau - 3.0 * math.exp(-1.5e-5 * 1000)) < 1e-12
