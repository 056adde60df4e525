"""The MC-sample ablation (dbsn.metrics.ablation): every prefix ensemble from one set of member predictions."""

from __future__ import annotations

import pytest
import torch

from dbsn.metrics.ablation import SampleAblation, prefix_ensembles
from dbsn.metrics.classification import ClassificationMetrics
from dbsn.metrics.uncertainty import ensemble_log_probs


def _members(s=7, n=50, c=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(s, n, c, generator=generator, dtype=torch.float64).mul(2).log_softmax(-1)


def test_prefix_ensembles_equal_the_mean_of_the_first_s_members():
    members = _members()
    sizes = [1, 2, 5, 7]
    got = prefix_ensembles(members, sizes)
    for row, s in zip(got, sizes):
        expected = members[:s].exp().mean(0).log()
        torch.testing.assert_close(row, expected)
    with pytest.raises(ValueError, match="1..7"):
        prefix_ensembles(members, [0, 8])


def test_last_row_equals_the_full_ensemble_metrics_over_batches():
    members, target = (
        _members(s=6, n=90).float(),
        torch.randint(0, 5, (90,), generator=torch.Generator().manual_seed(1)),
    )
    ablation = SampleAblation(num_classes=5, n_samples=6)
    full = ClassificationMetrics(5)
    for chunk in range(3):  # three test batches
        part = slice(30 * chunk, 30 * (chunk + 1))
        ablation.update(members[:, part], target[part])
        full.update(ensemble_log_probs(members[:, part]), target[part])
    rows = ablation.compute()
    assert [r["n_samples"] for r in rows] == list(range(1, 7))
    expected = {k: float(v) for k, v in full.compute().items()}
    assert rows[-1]["n_samples"] == 6
    assert {k: rows[-1][k] for k in expected} == pytest.approx(expected, rel=1e-6)  # float32 round-off only
    # and the S = 1 row is the first member alone
    first = ClassificationMetrics(5)
    first.update(members[0], target)
    assert rows[0]["nll"] == pytest.approx(float(first.compute()["nll"]), rel=1e-6)


def test_transform_is_applied_to_every_prefix_ensemble():
    members, target = _members(s=3).float(), torch.zeros(50, dtype=torch.long)
    plain, halved = SampleAblation(5, 3, sizes=[3]), SampleAblation(5, 3, sizes=[3])
    plain.update(members, target)
    halved.update(members, target, transform=lambda lp: (lp / 2).log_softmax(-1))
    assert plain.compute()[0]["nll"] != pytest.approx(halved.compute()[0]["nll"])
    reference = ClassificationMetrics(5)
    reference.update((ensemble_log_probs(members) / 2).log_softmax(-1), target)
    assert halved.compute()[0]["nll"] == pytest.approx(float(reference.compute()["nll"]), rel=1e-6)


def test_sizes_are_checked_and_wrong_member_count_refused():
    with pytest.raises(ValueError, match="1..4"):
        SampleAblation(3, 4, sizes=[2, 5])
    ablation = SampleAblation(3, 4, sizes=[1, 4])
    with pytest.raises(ValueError, match="expected 4 members"):
        ablation.update(_members(s=3, c=3), torch.zeros(50, dtype=torch.long))


def test_the_default_sizes_are_every_s_up_to_100_then_a_few_per_decade():
    from dbsn.metrics.ablation import default_sizes

    assert default_sizes(4) == [1, 2, 3, 4]
    assert default_sizes(100) == list(range(1, 101))
    assert default_sizes(1234) == [*range(1, 101), 200, 500, 1000, 1234]
    assert default_sizes(100_000) == [*range(1, 101), 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000]
    assert len(default_sizes(10**9)) <= 100 + 3 * 7 + 1  # bounded by log S, not S
    assert SampleAblation(3, n_samples=100_000).sizes == default_sizes(100_000)


def test_prefixes_handed_over_by_a_stream_give_the_same_rows_as_the_members():
    members, target = (
        _members(s=6, n=40).float(),
        torch.randint(0, 5, (40,), generator=torch.Generator().manual_seed(2)),
    )
    from_members, from_prefixes = SampleAblation(5, 6, sizes=[2, 6]), SampleAblation(5, 6, sizes=[2, 6])
    from_members.update(members, target)
    from_prefixes.update_prefixes({s: p for s, p in zip([2, 6], prefix_ensembles(members, [2, 6]))}, target)
    assert from_members.compute() == from_prefixes.compute()
    with pytest.raises(ValueError, match=r"no prefix ensemble of sizes \[6\]"):
        from_prefixes.update_prefixes({2: members[0]}, target)
