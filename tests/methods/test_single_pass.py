"""The single-pass ensembles' shared contract (dbsn.methods.single_pass): M members from one forward,
S fixed to M, members counted modulo M, and the evaluations that ask for more members than M."""

from __future__ import annotations

import pytest
import torch

from dbsn.methods import MIMO, BatchEnsemble, PackedEnsemble
from dbsn.nets import ResNet18

METHODS = {
    "batch_ensemble": lambda: BatchEnsemble(ResNet18(10, width=8), size=3, learn_structure=False, dataset_size=10),
    "packed_ensemble": lambda: PackedEnsemble(
        ResNet18(10, width=8), size=2, alpha=2, gamma=1, learn_structure=False, dataset_size=10
    ),
    "mimo": lambda: MIMO(ResNet18(10, width=8), size=3, learn_structure=False, dataset_size=10),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_members_come_from_one_forward_and_repeat_modulo_m(name):
    torch.manual_seed(0)
    method = METHODS[name]().eval()
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        members = method.predict_members(x)
        m = method.size
        assert members.shape == (m, 5, 10) and method.num_members == m
        assert not torch.allclose(members[0], members[1])  # different members
        shifted = method.stochastic_forward(x, m + 1, first=m - 1)  # members M-1, 0, 1, ..., M-1
        order = [(m - 1 + i) % m for i in range(m + 1)]
        torch.testing.assert_close(shifted.log_softmax(-1), members[order])
        # what the adversarial evaluation asks: S = 30 members after the 30 it attacked
        late = method.predict_log_probs(x, 30, first=30)
        torch.testing.assert_close(late, method.predict_log_probs(x))
        assert torch.isfinite(late).all()
    with pytest.raises(ValueError, match="cannot predict with S = 7"):
        method.n_samples = 7
    method.n_samples = m  # S = M is accepted


def test_mimo_sums_or_averages_its_members_nlls():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    losses = {}
    for reduction in ("sum", "mean"):
        method = MIMO(ResNet18(10, width=8), size=3, learn_structure=False, dataset_size=10, member_loss=reduction)
        torch.manual_seed(1)  # the same MIMO batch
        out = method.training_loss(x, y)
        losses[reduction] = (out["loss"], out["nll"])
    torch.testing.assert_close(losses["sum"][0], 3 * losses["sum"][1])
    torch.testing.assert_close(losses["mean"][0], losses["mean"][1])
    with pytest.raises(ValueError, match="member_loss"):
        MIMO(ResNet18(10, width=8), member_loss="max")
