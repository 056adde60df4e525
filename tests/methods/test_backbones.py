"""The methods without structure on the field's backbones (ResNet-18, WideResNet, at tiny widths):
each composes from the real configs, trains two steps and predicts on digits; what needs DBSN's
cells (a structure posterior, MC dropout on the cells' node outputs) is refused in one line
before anything is built."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dbsn.runtime.build import build_model
from dbsn.runtime.config import ConfigError, validate_config
from dbsn.runtime.errors import one_line
from dbsn.runtime.run import train
from tests.support.configs import compose_config
from tests.support.fakedata import normalised_digits
from tests.support.steputil import prediction

TINY_NETS = {"resnet18": ["model.net.width=8"], "wrn28_10": ["model.net.depth=10", "model.net.widen_factor=1"]}
# MC dropout's placement on a network without cells: after every convolution on ResNet-18,
# WideResNet's own dropout layers (between the two convolutions of every block)
PLACEMENT = {"resnet18": "every_conv", "wrn28_10": "existing"}
S = 2


def _overrides(model: str, net: str) -> list[str]:
    tiny = TINY_NETS[net]
    if model == "deep_ensemble":  # the members' network
        return [
            "model=deep_ensemble",
            "model.size=2",
            f"model/net@model.member.net={net}",
            *[o.replace("model.", "model.member.", 1) for o in tiny],
            "model.member.dataset_size=32",
        ]
    extra = [f"model.weights.placement={PLACEMENT[net]}"] if model == "mc_dropout" else []
    return [
        f"model={model}",
        f"model/net={net}",
        *tiny,
        *extra,
        "model.dataset_size=32",
        f"model.prediction.n_samples={S}",
        f"model.prediction.samples_per_forward={S}",
    ]


@pytest.fixture(scope="module")
def digits():
    """32 digits, normalised as the data module does."""
    return normalised_digits(32)


@pytest.mark.parametrize("net", list(TINY_NETS))
@pytest.mark.parametrize("model", ["map_fixed", "mc_dropout", "bbb", "deep_ensemble"])
def test_method_trains_two_steps_and_predicts_on_the_backbone(model, net, digits, tmp_path):
    cfg = compose_config("train", ["data=digits", "trainer.accelerator=cpu", *_overrides(model, net)], tmp_path)
    validate_config(cfg)
    torch.manual_seed(0)
    method = build_model(cfg.model, num_classes=10)
    nets = [m.net for m in getattr(method, "members", [method])]
    assert all(type(n).__name__ == cfg.model.get("member", cfg.model).net._target_.rsplit(".", 1)[-1] for n in nets)
    for member in getattr(method, "members", [method]):  # mc_dropout and bbb ask for a learned θ: there is none
        assert not member.learn_structure and member.structure_probabilities() is None
    before = [p.detach().clone() for p in method.parameters()]

    x, y = digits
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(method, DataLoader(TensorDataset(x, y), batch_size=16))
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, method.parameters()))

    members = prediction(method, x[:8], method.num_members)
    assert members.shape == (method.num_members, 8, 10) and torch.isfinite(members).all()
    assert method.num_members == (1 if model == "map_fixed" else S)
    if method.num_members > 1:  # dropout masks, weight draws, or members: they differ
        assert not torch.allclose(members[0], members[1])
    torch.testing.assert_close(members.exp().sum(-1), torch.ones(method.num_members, 8))


REFUSED = {
    "dbsn": (
        ["model=dbsn", "model/net=resnet18"],
        [
            "model: DBSN learns a distribution over the structure",
            "model.net (ResNet18) has no structure",
            "model/net=structure_net",
        ],
    ),
    "fbn": (["model=fbn", "model/net=wrn28_10"], ["DBSN learns", "model.net (WideResNet)"]),
    "vogn_fbn": (["model=vogn_fbn", "model/net=resnet18"], ["VOGNMethod learns", "model.net (ResNet18)"]),
    "mc_dropout's default placement": (
        ["model=mc_dropout", "model/net=resnet18"],
        [
            "model.weights.placement=node_outputs",
            "model.net (ResNet18) has none",
            "model.weights.placement=every_conv",
            "existing",
        ],
    ),
    "a deep ensemble of mc_dropout": (
        ["model=deep_ensemble", "model/member=mc_dropout", "model/net@model.member.net=wrn28_10"],
        ["model.member.weights.placement=node_outputs", "WideResNet"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_needs_the_cells_is_refused_in_one_line_before_anything_is_built(case, tmp_path):
    overrides, phrases = REFUSED[case]
    cfg = compose_config("train", ["data=digits", "trainer.accelerator=cpu", *overrides], tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        train(cfg, tmp_path / "run")  # what train.py runs; ConfigError prints one line (dbsn.runtime.errors)
    message = one_line(refused.value)
    assert message == str(refused.value)  # one line already
    for phrase in phrases:
        assert phrase in message, message
    assert not (tmp_path / "run").exists()  # refused before the run folder, the data or the network
