"""The Bayes ensemble's predictive (dbsn.methods.predictive): probabilities averaged, in chunks, over
the chosen members, in float32 under autocast.
"""

from __future__ import annotations

import math

import pytest
import torch

from dbsn.methods.predictive import BayesEnsemble, EnsembleStream
from tests.support.autocast import bf16_autocast


def _fixed_members(members: torch.Tensor):
    """A stochastic forward over a fixed set of members: members first .. first + n - 1, and a
    check that the ensemble asks for consecutive members without gaps or repeats."""
    state = {"next": None}

    def forward(x, n, first):
        assert state["next"] in (None, first), (state["next"], first)
        state["next"] = first + n
        return members[first : first + n]

    return forward


def test_averages_probabilities_not_logits():
    # Two members, one example, two classes: member logits (+4, 0) and (-4, 0).
    members = torch.tensor([[[4.0, 0.0]], [[-4.0, 0.0]]])
    log_probs = BayesEnsemble(n_samples=2, samples_per_forward=2)(_fixed_members(members), torch.zeros(1, 1))
    p1 = 1 / (1 + math.exp(-4))  # softmax of (4, 0), class 0
    expected = torch.tensor([[(p1 + (1 - p1)) / 2, ((1 - p1) + p1) / 2]])  # = (0.5, 0.5)
    assert torch.allclose(log_probs.exp(), expected, atol=1e-6)
    # Averaging logits gives the same answer here by symmetry; break the symmetry:
    members = torch.tensor([[[6.0, 0.0]], [[0.0, 0.0]]])
    log_probs = BayesEnsemble(2, 1)(_fixed_members(members), torch.zeros(1, 1))
    prob_avg = (torch.softmax(members[0], -1) + torch.softmax(members[1], -1)) / 2
    logit_avg = torch.softmax(members.mean(0), -1)
    assert torch.allclose(log_probs.exp(), prob_avg, atol=1e-6)
    assert not torch.allclose(log_probs.exp(), logit_avg, atol=1e-3)


@pytest.mark.parametrize("chunk", [1, 3, 7, 10, 64])
def test_chunking_does_not_change_the_result(chunk):
    torch.manual_seed(0)
    members = torch.randn(10, 5, 4) * 3
    reference = torch.log(torch.softmax(members, -1).mean(0))
    got = BayesEnsemble(10, chunk)(_fixed_members(members), torch.zeros(5, 1))
    assert torch.allclose(got, reference, atol=1e-5)
    assert torch.allclose(got.exp().sum(-1), torch.ones(5), atol=1e-5)


def test_member_log_probs_are_all_members():
    members = torch.randn(6, 3, 4)
    got = BayesEnsemble(6, 4).member_log_probs(_fixed_members(members), torch.zeros(3, 1))
    assert got.shape == (6, 3, 4)
    assert torch.allclose(got, members.log_softmax(-1))


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_first_selects_the_members(chunk):
    members = torch.randn(10, 3, 4)
    got = BayesEnsemble(4, chunk, first=5).member_log_probs(_fixed_members(members), torch.zeros(3, 1))
    assert torch.allclose(got, members[5:9].log_softmax(-1))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n_samples"):
        BayesEnsemble(0)
    with pytest.raises(ValueError, match="samples_per_forward"):
        BayesEnsemble(10, 0)


# ---------------------------------------------------------------------- mixed precision: a float32 island (dbsn.precision)


def test_bayes_ensemble_averages_in_float32_under_autocast():
    torch.manual_seed(0)
    logits = (4 * torch.randn(10, 6, 5)).bfloat16()  # 10 members' bfloat16 logits, as under autocast

    def forward(x, n, first):
        return logits[first : first + n]

    ensemble = BayesEnsemble(10, samples_per_forward=3)
    expected = torch.logsumexp(logits.float().log_softmax(-1), 0) - math.log(10)
    with bf16_autocast():
        predictive = ensemble(forward, torch.zeros(6, 1))
        members = ensemble.member_log_probs(forward, torch.zeros(6, 1))
    assert predictive.dtype == members.dtype == torch.float32
    torch.testing.assert_close(predictive, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(members, logits.float().log_softmax(-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 10])
def test_the_stream_gives_the_ensemble_its_decomposition_and_prefixes_without_keeping_members(chunk):
    """`EnsembleStream` over chunks of members: the same ensemble, uncertainty decomposition (of the
    calibrated members) and prefix ensembles as computed from all the members at once."""
    from dbsn.metrics.ablation import prefix_ensembles
    from dbsn.metrics.uncertainty import ensemble_log_probs, uncertainty_decomposition

    torch.manual_seed(0)
    members = (torch.randn(10, 6, 5) * 3).log_softmax(-1)
    calibrate = lambda log_probs: (log_probs / 1.7).log_softmax(-1)  # noqa: E731 - a temperature
    stream = EnsembleStream(calibrate, prefix_sizes=[1, 3, 10]).extend(members.split(chunk))
    torch.testing.assert_close(stream.log_probs(), ensemble_log_probs(members))
    expected = uncertainty_decomposition(calibrate(members))
    assert stream.scores().keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(stream.scores()[name], value, msg=name)
    assert sorted(stream.prefixes) == [1, 3, 10]
    for s, prefix in zip([1, 3, 10], prefix_ensembles(members, [1, 3, 10])):
        torch.testing.assert_close(stream.prefixes[s], prefix)
    # the last prefix is the ensemble itself, and asking for prefixes changes the ensemble in no bit
    assert torch.equal(stream.prefixes[10], stream.log_probs())
    assert torch.equal(EnsembleStream(calibrate).extend(members.split(chunk)).log_probs(), stream.log_probs())
