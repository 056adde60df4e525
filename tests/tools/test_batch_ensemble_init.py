"""The BatchEnsemble initialisation study (dbsn.tools.batch_ensemble_init) on a tiny network."""

from __future__ import annotations

import pytest

from dbsn.tools.batch_ensemble_init import _digits, measure

pytestmark = pytest.mark.slow

TINY = ["num_nodes=3", "growth=4", "stem_channels=8"]


def test_ones_make_one_network_and_random_signs_pull_apart():
    """Fast weights of ones: the members are one network (gradient cosine 1, no disagreement, ever);
    random signs: the members' gradients on the shared weights are nearly orthogonal."""
    data = _digits()
    ones = measure("structure_net", 1.0, 0, 3, data, net_overrides=TINY)
    assert ones["grad_cosine_at_init"] == pytest.approx(1.0, abs=1e-4) and ones["member_disagreement"] == 0.0
    signs = measure("structure_net", 0.5, 0, 3, data, net_overrides=TINY)
    assert abs(signs["grad_cosine_at_init"]) < 0.5 and signs["train_nll"] > 0
    assert set(signs) >= {"val_nll", "val_error", "member_disagreement", "train_nll"}
