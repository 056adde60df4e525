"""Masksembles (dbsn.methods.masksembles): with masks of ones every member is the plain network (outputs and
gradients); member m is the network under its own masks alone; the members are fixed (the same masks at every
call, kept by the checkpoint); training steps and a prediction on digits, the evaluation suite; the registry,
compare and the field know it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dbsn.methods import MAP, Masksembles, MCDropoutWeights
from dbsn.nets import ResNet18, StructureNet
from dbsn.nets.masksembles import masked_layers
from tests.support.configs import ROOT, TINY, compose_config, configured_optimizers, evaluate_the_whole_suite
from tests.support.netutil import set_random_affine
from tests.support.scripts import run_python

M = 3


def _structure_net() -> StructureNet:  # growth 10: the authors' masks need 10 channels in a layer
    return StructureNet(num_classes=10, num_nodes=3, cells_per_stage=1, growth=10, stem_channels=16)


def _wide_resnet() -> nn.Module:
    from dbsn.nets.wideresnet import WideResNet

    return WideResNet(num_classes=10, depth=10, widen_factor=1)


NETS = {"structure_net": _structure_net, "resnet18": lambda: ResNet18(10, width=16), "wrn": _wide_resnet}


def _plain_name(name: str) -> str:
    """The plain network's name of a masked layer's parameter (`conv1.layer.weight` -> `conv1.weight`)."""
    return name.replace(".layer.", ".")


@pytest.mark.parametrize("name", NETS)
def test_masks_of_ones_give_the_plain_network_in_outputs_and_gradients(name):
    """Every mask 1: every member's logits are the plain network's, in training (BatchNorm over M copies of the
    batch has the batch's statistics) and at prediction; the loss, the mean NLL over the M·b rows, is the plain
    network's mean NLL, so every weight, BatchNorm parameter and θ has exactly the plain network's gradient."""
    torch.manual_seed(0)
    net = NETS[name]()
    set_random_affine(net, 0)
    plain = MAP(copy.deepcopy(net), dataset_size=10).double()
    ensemble = Masksembles(net, size=M, dataset_size=10).double()
    for layer in masked_layers(ensemble.net):
        layer.masks.fill_(1.0)
    if plain.learn_structure:
        ensemble.theta.data.copy_(plain.theta.data + torch.randn_like(plain.theta))  # a θ away from uniform
        plain.theta.data.copy_(ensemble.theta.data)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    ensemble.eval(), plain.eval()
    with torch.no_grad():
        members = ensemble.predict_members(x)
    assert members.shape == (M, 4, 10)
    for member in members:
        torch.testing.assert_close(member, plain.predict_log_probs(x), rtol=1e-10, atol=1e-10)

    ensemble.train(), plain.train()
    out, ref = ensemble.training_loss(x, y), plain.training_loss(x, y)
    rows = out["logits"].view(4, M, 10)
    for m in range(M):
        torch.testing.assert_close(rows[:, m], ref["logits"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-12, atol=1e-12)
    out["loss"].backward()
    ref["loss"].backward()
    grads = {_plain_name(key): p.grad for key, p in ensemble.named_parameters()}
    assert grads.keys() == dict(plain.named_parameters()).keys()
    for key, p in plain.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, rtol=1e-8, atol=1e-12, msg=key)
    norms = [
        [m for m in method.net.modules() if isinstance(m, nn.BatchNorm2d) and m.track_running_stats]
        for method in (ensemble, plain)
    ]
    assert len(norms[0]) == len(norms[1]) > 0
    for a, b in zip(*norms):  # the running statistics moved as the plain network's
        torch.testing.assert_close(a.running_mean, b.running_mean, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NETS)
def test_member_m_is_the_network_under_its_own_masks_alone(name):
    """At prediction (running statistics) member m of one forward equals a one-member Masksembles whose masks
    are row m of every layer's: the rows are interleaved by member and no member sees another's masks."""
    torch.manual_seed(0)
    net = NETS[name]()
    set_random_affine(net, 0)
    ensemble = Masksembles(net, size=M, dataset_size=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        members = ensemble.predict_members(x)
        for m in range(M):
            alone = copy.deepcopy(ensemble)
            alone.size = 1
            for layer in masked_layers(alone.net):
                layer.masks = layer.masks[m : m + 1].clone()
            torch.testing.assert_close(
                alone.stochastic_forward(x, 1)[0].log_softmax(-1), members[m], rtol=1e-5, atol=1e-6
            )
    assert not torch.allclose(members[0], members[1])  # different masks: different members


def test_members_are_fixed_at_every_call_and_by_the_checkpoint():
    torch.manual_seed(0)
    ensemble = Masksembles(ResNet18(10, width=16), size=M, dataset_size=10).eval()
    masks = [layer.masks.clone() for layer in masked_layers(ensemble.net)]
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        first, again = ensemble.predict_members(x), ensemble.predict_members(x)
        shifted = ensemble.stochastic_forward(x, 2, M + 1)  # members counted modulo M: M + 1 is member 1
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    torch.testing.assert_close(shifted.log_softmax(-1), first[1:3])
    assert all(torch.equal(a, layer.masks) for a, layer in zip(masks, masked_layers(ensemble.net)))
    rebuilt = Masksembles(ResNet18(10, width=16), size=M, dataset_size=10).eval()  # masks of its own draw ...
    assert not torch.equal(masked_layers(rebuilt.net)[0].masks, masks[0])
    rebuilt.load_state_dict(ensemble.state_dict())  # ... until the checkpoint's are loaded
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.predict_members(x), first, rtol=0, atol=0)
    assert 0.2 < ensemble.run_facts()["mask_iou"] < 0.45  # scale 2: about 1/3
    with pytest.raises(ValueError, match="point-estimate weights; it cannot take MCDropoutWeights"):
        Masksembles(ResNet18(10, width=16), weights=MCDropoutWeights())
    with pytest.raises(ValueError, match="prediction.n_samples=5"):
        from dbsn.methods import Prediction

        Masksembles(ResNet18(10, width=16), size=M, prediction=Prediction(5))


def test_the_optimiser_follows_torch_uncertainty(tmp_path):
    """tu resnet18/masked.yaml: lr 0.05, momentum 0.9, wd 5e-4 on every weight, no clipping, x 0.1 at 1/3 and
    2/3 of training; M = 4, scale 2; the masks are buffers, not parameters."""
    method, optimizers, schedules = configured_optimizers(
        compose_config("train", ["model=masksembles"], tmp_path).model
    )
    sgd = optimizers[0]
    assert (method.size, method.scale) == (4, 2.0) and method.optim.grad_clip_norm is None
    assert {(g["lr"], g["weight_decay"]) for g in sgd.param_groups} == {(0.05, 5e-4)}
    assert sorted(schedules[0].milestones) == [1, 3] and schedules[0].gamma == 0.1  # of max_epochs = 4
    assert sum(p.numel() for p in method.parameters()) == 11_173_962  # ResNet-18's: the masks add no parameter


COMMON = [
    "model=masksembles",
    "data=digits",
    "data.batch_size=16",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "model.size=2",
    "test=false",
    *[o for o in TINY if not o.startswith("model.")],
]
NET_OVERRIDES = {
    "structure_net": [
        "model/net=structure_net",
        "model.net.num_nodes=3",
        "model.net.cells_per_stage=1",
        "model.net.growth=10",
        "model.net.stem_channels=16",
    ],
    "resnet18": ["model/net=resnet18", "model.net.width=10"],
}


@pytest.mark.parametrize("net", NET_OVERRIDES)
def test_trains_and_predicts_on_digits(net, tmp_path):
    """Two training steps through train(); the method rebuilt from the checkpoint has the trained masks and
    predicts its M members."""
    from dbsn.data.digits import DigitsDataModule, digits_splits
    from dbsn.runtime.build import load_method
    from dbsn.runtime.run import train

    train(compose_config("train", [*COMMON, *NET_OVERRIDES[net]], tmp_path), tmp_path)
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    method = load_method(tmp_path / "checkpoints" / "last.ckpt", num_classes=10).eval()
    assert isinstance(method, Masksembles) and method.num_members == 2
    for key, layer in ((k, m) for k, m in method.net.named_modules() if m in masked_layers(method.net)):
        assert torch.equal(layer.masks, checkpoint["state_dict"][f"net.{key}.masks"])
    images = digits_splits()[1][0][:8].float() / 255
    x = (images - torch.tensor(DigitsDataModule.mean)[:, None, None]) / torch.tensor(DigitsDataModule.std)[
        :, None, None
    ]
    with torch.no_grad():
        members = method.predict_members(x)
    assert members.shape == (2, 8, 10) and torch.isfinite(members).all() and (members[0] - members[1]).abs().max() > 0


@pytest.mark.slow
def test_the_evaluation_suite_runs_on_it(tmp_path):
    """evaluate.py's OOD detection with every score (each member's masked features and the shared head), dataset
    shift on generated corruptions, conformal sets and the adversarial attacks."""
    from dbsn.runtime.run import train

    run = tmp_path / "run"
    train(
        compose_config(
            "train",
            [*COMMON, *NET_OVERRIDES["resnet18"], "data.train_subset=200", "trainer.limit_train_batches=3"],
            run,
        ),
        run,
    )
    evaluate_the_whole_suite(run / "checkpoints" / "last.ckpt", tmp_path / "eval", tmp_path)


def test_the_registry_compare_and_the_field_know_it(tmp_path):
    from dbsn.methods.registry import REPORT_ORDER, method_config
    from dbsn.runtime.config import validate_config
    from dbsn.tools.compare import compared_methods, method_overrides, shared_overrides

    entry = method_config("masksembles")
    assert entry.cls is Masksembles and entry.fixed_members and entry.networks == "any" and entry.sgd
    assert "masksembles" in compared_methods() and "masksembles" in REPORT_ORDER
    for backbone in ("structure_net", "resnet18"):  # the fair protocol on the cell network and on a backbone
        cfg = compose_config(
            "train", [*method_overrides("masksembles", 10, 21, backbone=backbone), *shared_overrides()], tmp_path
        )
        validate_config(cfg)
        assert list(cfg.model.optim.milestones) == [0.5, 0.75] and cfg.model.optim.lr == 0.05 and cfg.model.scale == 2.0
        torch.manual_seed(0)
        from dbsn.runtime.build import build_model

        assert isinstance(build_model(cfg.model, num_classes=10), Masksembles)
    result = run_python(
        ROOT / "train.py",
        "experiment=cifar10_field",
        "field=resnet18/masksembles",
        "seed=1",
        "--cfg",
        "job",
        cwd=tmp_path,
        timeout=120,
    )  # the field's job through train.py's command line
    assert "_target_: dbsn.methods.Masksembles" in result.stdout and "_target_: dbsn.nets.ResNet18" in result.stdout
    assert "seed: 1" in result.stdout
    for backbone, net in (("wrn28_10", "WideResNet"), ("structure_net", "StructureNet")):  # the other jobs, composed
        cfg = compose_config("train", ["experiment=cifar10_field", f"field={backbone}/masksembles", "seed=1"], tmp_path)
        validate_config(cfg)
        assert (cfg.model._target_, cfg.model.net._target_, cfg.seed) == (
            "dbsn.methods.Masksembles",
            f"dbsn.nets.{net}",
            1,
        )
