"""Tests for dbsn.metrics.uncertainty: entropy and its decomposition."""

import math

import pytest
import torch

from dbsn.metrics.uncertainty import ensemble_log_probs, entropy, ood_scores, uncertainty_decomposition

INF = float("inf")


def random_members(s=5, n=7, c=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(s, n, c, generator=gen, dtype=dtype)).log_softmax(dim=-1)


def test_entropy_of_uniform_is_log_c():
    for c in (2, 3, 10):
        log_probs = torch.full((3, c), -math.log(c))
        assert entropy(log_probs).tolist() == pytest.approx([math.log(c)] * 3, abs=1e-6)


def test_entropy_of_one_hot_is_exactly_zero_with_minus_inf_log_probs():
    log_probs = torch.tensor([[0.0, -INF, -INF], [-INF, -INF, 0.0]])
    h = entropy(log_probs)
    assert torch.isfinite(h).all()
    assert h.tolist() == [0.0, 0.0]


def test_entropy_two_classes_by_hand_and_dim():
    # p = (0.25, 0.75): H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3466 + 0.2158 = 0.5623 nats.
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert expected == pytest.approx(0.5623, abs=1e-4)
    log_probs = torch.tensor([0.25, 0.75], dtype=torch.float64).log()
    assert entropy(log_probs).item() == pytest.approx(expected, rel=1e-12)
    # Classes along dim 0 instead of the last one.
    assert entropy(log_probs.unsqueeze(1).expand(2, 3), dim=0).tolist() == pytest.approx([expected] * 3, rel=1e-12)


def test_entropy_gradient_is_finite_at_zero_probability():
    log_probs = torch.tensor([[0.0, -INF], [math.log(0.3), math.log(0.7)]], requires_grad=True)
    entropy(log_probs).sum().backward()
    assert torch.isfinite(log_probs.grad).all()


def test_ensemble_log_probs_matches_naive_float64():
    members = random_members(s=6, n=9, c=5, seed=1)
    naive = members.double().exp().mean(dim=0).log()
    result = ensemble_log_probs(members)
    assert result.shape == (9, 5)
    torch.testing.assert_close(result.double(), naive, rtol=1e-5, atol=1e-6)


def test_ensemble_log_probs_of_one_member_is_that_member():
    members = random_members(s=1, seed=2)
    assert torch.equal(ensemble_log_probs(members), members[0])


def test_decomposition_disagreeing_one_hot_members():
    # Member 1 is sure of class 0, member 2 of class 1: each has entropy 0 (aleatoric 0), the
    # average is (1/2, 1/2, 0) with entropy log 2, all of it epistemic.
    members = torch.tensor([[[0.0, -INF, -INF]], [[-INF, 0.0, -INF]]])
    scores = uncertainty_decomposition(members)
    assert scores["predictive_entropy"].tolist() == pytest.approx([math.log(2)], abs=1e-6)
    assert scores["expected_entropy"].tolist() == [0.0]
    assert scores["mutual_information"].tolist() == pytest.approx([math.log(2)], abs=1e-6)
    assert scores["max_probability"].tolist() == pytest.approx([0.5], abs=1e-6)


def test_decomposition_identical_members_have_no_mutual_information():
    one = random_members(s=1, n=200, c=10, seed=3)
    members = one.expand(7, 200, 10)
    scores = uncertainty_decomposition(members)
    assert scores["mutual_information"].tolist() == pytest.approx([0.0] * 200, abs=1e-6)
    # Round-off makes total - aleatoric slightly negative for some of these (about a third in
    # float32); the clamp keeps the mutual information >= 0.
    assert (scores["mutual_information"] >= 0).all()
    torch.testing.assert_close(scores["predictive_entropy"], entropy(one[0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores["expected_entropy"], entropy(one[0]), rtol=1e-5, atol=1e-6)


def test_decomposition_single_member_has_exactly_zero_mutual_information():
    members = random_members(s=1, n=20, c=6, seed=4)
    scores = uncertainty_decomposition(members)
    assert torch.equal(scores["mutual_information"], torch.zeros(20))
    assert torch.equal(scores["predictive_entropy"], scores["expected_entropy"])


def test_total_is_aleatoric_plus_epistemic_and_mi_nonnegative():
    for seed in range(5):
        members = random_members(s=8, n=50, c=10, seed=seed)
        scores = uncertainty_decomposition(members)
        assert all(v.shape == (50,) for v in scores.values())
        assert (scores["mutual_information"] >= 0).all()
        torch.testing.assert_close(
            scores["expected_entropy"] + scores["mutual_information"],
            scores["predictive_entropy"],
            rtol=1e-5,
            atol=1e-5,
        )
        # Against a float64 computation from the probabilities.
        probs = members.double().exp()
        mean = probs.mean(dim=0)
        total = -(mean * mean.log()).sum(dim=-1)
        aleatoric = -(probs * probs.log()).sum(dim=-1).mean(dim=0)
        torch.testing.assert_close(scores["predictive_entropy"].double(), total, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scores["mutual_information"].double(), total - aleatoric, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(scores["max_probability"].double(), mean.amax(dim=-1), rtol=1e-5, atol=1e-6)


def test_ood_scores_point_towards_ood():
    # Example 0: both members confident in class 0. Example 1: members disagree.
    members = torch.tensor([[[0.0, -INF], [0.0, -INF]], [[0.0, -INF], [-INF, 0.0]]])
    scores = ood_scores(members)
    assert set(scores) == {"entropy", "mutual_information", "max_probability"}
    assert scores["entropy"].tolist() == pytest.approx([0.0, math.log(2)], abs=1e-6)
    assert scores["mutual_information"].tolist() == pytest.approx([0.0, math.log(2)], abs=1e-6)
    # Stored as 1 - max probability: 1 - 1 = 0 and 1 - 1/2 = 1/2.
    assert scores["max_probability"].tolist() == pytest.approx([0.0, 0.5], abs=1e-6)


@pytest.mark.parametrize("shape", [(4, 3), (0, 2, 3), (2, 3, 4, 5)])
def test_members_must_be_s_n_c(shape):
    with pytest.raises(ValueError, match="shape"):
        uncertainty_decomposition(torch.zeros(shape))
