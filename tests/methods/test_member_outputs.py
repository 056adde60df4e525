"""What the detection scores read of a method (`Method.member_outputs`, `member_heads`,
`fixed_members`): each member's logits are its prediction's, its features are what its last layer
sees (the member's linear head applied to them gives its logits back), and DBSN's members are the
same networks at every call while they are held."""

from __future__ import annotations

import pytest
import torch

from dbsn.methods import (
    DBSN,
    DDU,
    MAP,
    MIMO,
    SNGP,
    BatchEnsemble,
    DeepEnsemble,
    Masksembles,
    MCDropoutWeights,
    PackedEnsemble,
    Prediction,
    Rank1BNN,
)
from dbsn.nets import ResNet18
from dbsn.testing import check_method
from tests.support.netutil import tiny_structure_net

METHODS = {
    "map_fixed": lambda: MAP(tiny_structure_net(), learn_structure=False, dataset_size=10),
    "dbsn": lambda: DBSN(tiny_structure_net(), dataset_size=10, prediction=Prediction(n_samples=3)),
    "mc_dropout": lambda: MAP(
        tiny_structure_net(),
        learn_structure=False,
        dataset_size=10,
        weights=MCDropoutWeights(p=0.3),
        prediction=Prediction(n_samples=3),
    ),
    "deep_ensemble": lambda: DeepEnsemble(
        [MAP(tiny_structure_net(), learn_structure=False, dataset_size=10) for _ in range(2)]
    ),
    "batch_ensemble": lambda: BatchEnsemble(tiny_structure_net(), size=3, learn_structure=False, dataset_size=10),
    "packed_ensemble": lambda: PackedEnsemble(
        ResNet18(10, width=8), size=2, alpha=2, gamma=1, learn_structure=False, dataset_size=10
    ),
    "mimo": lambda: MIMO(tiny_structure_net(), size=3, learn_structure=False, dataset_size=10),
    "rank1_bnn": lambda: Rank1BNN(ResNet18(10, width=8), size=2, dataset_size=10, prediction=Prediction(4, 2, 3)),
    "ddu": lambda: DDU(ResNet18(10, width=8), dataset_size=10),
    "masksembles": lambda: Masksembles(
        ResNet18(10, width=16), size=3, dataset_size=10
    ),  # 10 channels: the masks' minimum
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_members_linear_head_on_its_features_gives_its_logits(name):
    """`dbsn.testing.check_method`: each member's head on its features gives its logits, which are the
    members the prediction averages (held alike), and the training loss reaches the weights."""
    checked = check_method(METHODS[name]())
    assert checked["features"] and checked["members"] == (name != "mc_dropout")  # dropout draws at every call


def test_dbsn_holds_its_members_while_asked_and_draws_afresh_after():
    torch.manual_seed(0)
    method = METHODS["dbsn"]().eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        with method.fixed_members(3):
            first, _ = method.member_outputs(x, 3)
            again, _ = method.member_outputs(x, 3)
        torch.testing.assert_close(first, again)  # member s is one structure at every call
        assert not torch.allclose(first[0], first[1])  # and the members differ
        after, _ = method.member_outputs(x, 3)
    assert not torch.allclose(after, first)  # fresh draws outside


def test_sngp_gives_features_but_no_linear_head():
    torch.manual_seed(0)
    method = SNGP(tiny_structure_net(), learn_structure=False, dataset_size=10).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        logits, features = method.member_outputs(x, 1)
        torch.testing.assert_close(logits[0].log_softmax(-1), method.predict_log_probs(x), atol=1e-5, rtol=1e-4)
    assert features.shape[:2] == (1, 4) and method.member_heads(1) is None


def test_features_of_a_forward_run_in_parts_are_those_of_the_whole_forward():
    """`prediction.rows_per_forward` below the batch: each member's forward runs its examples in
    parts, so its last layer sees them in several calls; the features are those calls' rows in
    order, as the whole forward's."""
    torch.manual_seed(0)
    method = METHODS["dbsn"]().eval()
    x = torch.randn(7, 3, 32, 32)
    with torch.no_grad(), method.fixed_members(3):
        whole = method.member_outputs(x, 3)
        method.prediction.rows_per_forward = 3
        parts = method.member_outputs(x, 3)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
