"""The refinement experiment: discrete structures from the posterior, two ensembles."""

from __future__ import annotations

import json

import pytest
import torch

from dbsn.runtime.run import train
from dbsn.tools.refine import refine, sample_discrete_structures
from tests.support.configs import TINY, compose_config


def test_discrete_structures_follow_softmax_theta_over_beta():
    theta = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    beta = 0.7
    samples = sample_discrete_structures(theta, beta, n=40_000, seed=3)
    assert samples.shape == (40_000, 2, 4)
    assert torch.equal(samples.sum(-1), torch.ones(40_000, 2))  # one-hot rows
    freq = samples.mean(0)
    expected = torch.softmax(theta / beta, -1)
    stderr = (expected * (1 - expected) / 40_000).sqrt()
    assert ((freq - expected).abs() <= 5 * stderr + 1e-4).all(), (freq, expected)
    assert torch.equal(
        sample_discrete_structures(theta, beta, 5, seed=1), sample_discrete_structures(theta, beta, 5, seed=1)
    )


@pytest.mark.slow
def test_refinement_trains_both_ensembles_and_reports_them(tmp_path):
    common = [
        "data=digits",
        "data.batch_size=128",
        "data.train_subset=256",
        "trainer.max_epochs=1",
        *[o for o in TINY if not o.startswith("model.")],
    ]
    dbsn_dir = tmp_path / "dbsn"
    train(compose_config("train", ["model=dbsn", *TINY, *common], dbsn_dir), dbsn_dir)

    out = tmp_path / "refine"
    results = refine(
        dbsn_dir / "checkpoints" / "last.ckpt",
        members=2,
        seed=0,
        output_dir=out,
        overrides=["trainer.max_epochs=1", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"],
    )
    assert set(results) == {"refined", "control"}
    for name in ("refined", "control"):
        assert set(results[name]) >= {"test/error", "test/nll", "test/ece"}
        members = sorted((out / name).glob("member*/checkpoints/last.ckpt"))
        assert len(members) == 2
        structures = [torch.load(p, weights_only=False)["state_dict"]["fixed_alpha"] for p in members]
        for alpha in structures:
            assert torch.equal(alpha.sum(-1), torch.ones(alpha.shape[0])) and set(alpha.unique().tolist()) <= {0.0, 1.0}
        if name == "control":
            assert torch.equal(structures[0], structures[1])
    drawn = json.loads((out / "structures.json").read_text())["structures"]
    refined0 = torch.load(out / "refined" / "member0" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"][
        "fixed_alpha"
    ]
    assert refined0.argmax(-1).tolist() == drawn[0]
    assert json.loads((out / "refinement.json").read_text()) == results
