"""BatchEnsemble (dbsn.methods.batch_ensemble, dbsn.nets.batch_ensemble): with unit fast weights
every member is the slow network (outputs and gradients); each member depends only on its own
fast weights; the authors' initialisation and optimiser groups; two training steps and a
prediction of M members on digits, on DBSN's cell network and on a backbone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dbsn.methods import MAP, BatchEnsemble, MCDropoutWeights
from dbsn.nets import VGG16BN, StructureNet
from dbsn.nets.batch_ensemble import BatchEnsembleConv2d, BatchEnsembleLinear, batch_ensemble, fast_parameters
from dbsn.nets.batch_ensemble import member_biases as biases
from tests.support.configs import TINY, compose_config, configured_optimizers
from tests.support.netutil import set_random_affine

M = 3


def _structure_net() -> StructureNet:
    return StructureNet(num_classes=10, num_nodes=4, cells_per_stage=1, growth=4, stem_channels=8)


def _wide_resnet() -> nn.Module:
    from dbsn.nets.wideresnet import WideResNet

    return WideResNet(num_classes=10, depth=10, widen_factor=1)


NETS = {"structure_net": _structure_net, "vgg16_bn": lambda: VGG16BN(num_classes=10, width=0.25), "wrn": _wide_resnet}


def _pair(make, seed: int = 0) -> tuple[BatchEnsemble, MAP]:
    """A BatchEnsemble with every fast weight 1, and MAP on a copy of its slow network (same θ)."""
    torch.manual_seed(seed)
    net = make()
    set_random_affine(net, seed)
    slow = MAP(copy.deepcopy(net), dataset_size=10)
    ensemble = BatchEnsemble(net, size=M, random_sign_init=0.0, dataset_size=10)
    if slow.learn_structure:
        ensemble.theta.data.copy_(slow.theta.data + torch.randn_like(slow.theta))  # a θ away from uniform
        slow.theta.data.copy_(ensemble.theta.data)
    return ensemble, slow


def _slow_name(name: str) -> str:
    """The slow network's name of a BatchEnsemble parameter (`conv.layer.weight` -> `conv.weight`)."""
    return name.replace(".layer.", ".")


@pytest.mark.parametrize("name", NETS)
def test_unit_fast_weights_give_the_slow_network_in_outputs_and_gradients(name):
    """With r = s = 1 and member biases equal to the slow bias, every member's logits are the slow
    network's, in training (BatchNorm over the repeated batch: M copies of the batch have its
    statistics) and at prediction. The loss, the mean NLL over the M·b rows, is then the slow
    network's mean NLL *as a function of the slow weights*, so every slow weight, BatchNorm
    parameter and θ has exactly the slow network's gradient (each member contributes 1/M of it;
    a loss summed over the rows would give M times the slow network's summed loss), and each
    member's bias 1/M of the slow bias's gradient."""
    ensemble, slow = _pair(NETS[name])
    ensemble, slow = ensemble.double(), slow.double()  # exact up to the order of sums
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    ensemble.eval(), slow.eval()  # the running statistics as initialised (after a step the unbiased
    with torch.no_grad():  # variances differ: M·b rows against b)
        predicted = ensemble.predict_members(x)
        assert predicted.shape == (M, 4, 10)
        for m in range(M):
            torch.testing.assert_close(predicted[m], slow.predict_log_probs(x), rtol=1e-10, atol=1e-10)

    ensemble.train(), slow.train()
    out, ref = ensemble.training_loss(x, y), slow.training_loss(x, y)
    members = out["logits"].view(4, M, 10)
    for m in range(M):
        torch.testing.assert_close(members[:, m], ref["logits"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-12, atol=1e-12)
    out["loss"].backward()
    ref["loss"].backward()

    slow_params = dict(slow.named_parameters())
    fast, member_biases = {id(p) for p in fast_parameters(ensemble.net)}, {id(p) for p in biases(ensemble.net)}
    compared = {"slow": 0, "bias": 0}
    for key, p in ensemble.named_parameters():
        if id(p) in fast:
            continue
        if id(p) in member_biases:  # (M, out): each member 1/M of the slow bias's gradient
            torch.testing.assert_close(p.grad, slow_params[key].grad.expand(M, -1) / M, rtol=1e-8, atol=1e-12, msg=key)
            compared["bias"] += 1
            continue
        torch.testing.assert_close(p.grad, slow_params[_slow_name(key)].grad, rtol=1e-8, atol=1e-12, msg=key)
        compared["slow"] += 1
    assert compared["slow"] == len(slow_params) - compared["bias"] and compared["bias"] >= 1, compared


@pytest.mark.parametrize("name", ["structure_net", "wrn"])
def test_each_member_depends_only_on_its_own_fast_weights(name):
    """At prediction (running statistics) the gradient of member m's logits reaches its own fast
    weights and member biases, and no other member's. In training BatchNorm normalises with the
    statistics of all M·b rows (the authors' shared BatchNorm), which couples the members."""
    torch.manual_seed(0)
    ensemble = BatchEnsemble(NETS[name](), size=M, dataset_size=10)
    layers = [m for m in ensemble.net.modules() if isinstance(m, (BatchEnsembleConv2d, BatchEnsembleLinear))]
    assert any(isinstance(m.layer, nn.Conv2d) and m.layer.groups > 1 for m in layers) == (name == "structure_net")
    x = torch.randn(2, 3, 32, 32)
    alpha = ensemble.prediction_structures(M)
    for training in (False, True):
        ensemble.train(training)
        for m in range(M):
            ensemble.zero_grad(set_to_none=True)
            ensemble.network(x, alpha).view(2, M, 10)[:, m].sum().backward()
            reached = {}
            for layer in layers:
                for p in (layer.r, layer.s) + (() if layer.bias is None else (layer.bias,)):
                    assert p.grad[m].abs().sum() > 0
                    reached[p] = torch.cat([p.grad[:m], p.grad[m + 1 :]]).abs().sum() > 0
            assert any(reached.values()) == training, (training, m)  # in training: through BatchNorm
            head = ensemble.net.classifier  # after the last BatchNorm: never coupled
            assert not any(reached[p] for p in (head.r, head.s, head.bias))


def test_fast_weights_are_initialised_as_the_authors():
    """random_sign_init -0.5: N(1, 0.5²); 0.75: random signs, P(+1) = 0.75; 0: ones. Member biases start at the
    slow bias (VGG's convolutions and every classifier have one); the slow layer keeps no bias."""
    torch.manual_seed(0)
    layer = nn.Linear(400, 300)
    wrapped = BatchEnsembleLinear(copy.deepcopy(layer), size=4, random_sign_init=-0.5)
    assert wrapped.r.mean().item() == pytest.approx(1.0, abs=0.02) and wrapped.s.std().item() == pytest.approx(
        0.5, abs=0.02
    )
    assert wrapped.layer.bias is None and torch.equal(wrapped.bias, layer.bias.expand(4, -1))
    signs = BatchEnsembleConv2d(nn.Conv2d(500, 400, 1), size=4, random_sign_init=0.75)
    assert set(signs.r.unique().tolist()) == {-1.0, 1.0} and (signs.s == 1).float().mean().item() == pytest.approx(
        0.75, abs=0.02
    )
    net = batch_ensemble(VGG16BN(num_classes=10, width=0.25), 2, random_sign_init=0.0)
    assert all(torch.equal(p, torch.ones_like(p)) for p in fast_parameters(net))
    slow = {id(m.layer) for m in net.modules() if isinstance(m, (BatchEnsembleConv2d, BatchEnsembleLinear))}
    assert all(id(m) in slow for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))) and len(slow) == 14
    with pytest.raises(ValueError, match="whole member groups"):
        net(torch.randn(3, 3, 32, 32))
    with pytest.raises(ValueError, match="point-estimate weights"):
        BatchEnsemble(_structure_net(), weights=MCDropoutWeights(), dataset_size=10)


def test_optimiser_follows_the_authors_groups(tmp_path):
    """The authors' recipe: lr 0.1, Nesterov; r and s at half the lr and no weight decay, the
    member biases at half the lr with weight decay, slow weights and BatchNorm at the lr with weight
    decay 2 x 3e-4 (their Keras L2 of 3e-4); no clipping; decay x 0.2 at 40, 80, 90 % of training."""
    cfg = compose_config(
        "train",
        ["model=batch_ensemble", "model/net=structure_net", "model.net.num_nodes=3", "model.net.cells_per_stage=1"],
        tmp_path,
    )
    method, optimizers, schedules = configured_optimizers(cfg.model)
    sgd = optimizers[0]
    assert method.size == 4 and sgd.defaults["nesterov"] and method.optim.grad_clip_norm is None
    kinds = {(g["lr"], g["weight_decay"]): {id(p) for p in g["params"]} for g in sgd.param_groups}
    fast = {id(p) for p in fast_parameters(method.net)}
    classifier_bias = {id(method.net.classifier.bias)}  # the cell network's only layer with a bias
    assert kinds.keys() == {(0.1, 6e-4), (0.05, 6e-4), (0.05, 0.0)}
    assert kinds[0.05, 0.0] == fast and kinds[0.05, 6e-4] == classifier_bias and len(kinds[0.1, 6e-4]) > 10
    assert sorted(schedules[0].milestones) == [2, 3, 4] and schedules[0].gamma == 0.2  # of max_epochs = 4


COMMON = [
    "model=batch_ensemble",
    "data=digits",
    "data.batch_size=16",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "model.size=4",
    "test=false",
    *[o for o in TINY if not o.startswith("model.")],
]
NET_OVERRIDES = {
    "structure_net": [
        "model.net.num_nodes=4",
        "model.net.cells_per_stage=1",
        "model.net.growth=4",
        "model.net.stem_channels=8",
    ],
    "wrn28_10": ["model.net.depth=10", "model.net.widen_factor=1", "model.learn_structure=false"],
}


@pytest.mark.parametrize("net", NET_OVERRIDES)
def test_trains_two_steps_and_predicts_m_members_on_digits(net, tmp_path):
    """model/net=structure_net (DBSN's cell network, 4 nodes, one cell per stage) and
    model/net=wrn28_10 (depth 10, width 1): two training steps through train(); the method
    rebuilt from the checkpoint predicts M = 4 members of digits test images, which differ."""
    from dbsn.data.digits import DigitsDataModule, digits_splits
    from dbsn.runtime.build import load_method
    from dbsn.runtime.run import train

    train(compose_config("train", [*COMMON, f"model/net={net}", *NET_OVERRIDES[net]], tmp_path), tmp_path)
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] >= 2
    method = load_method(tmp_path / "checkpoints" / "last.ckpt", num_classes=10).eval()
    fast = fast_parameters(method.net)
    assert fast and not all(torch.equal(p[0], p[1]) for p in fast)
    images = digits_splits()[1][0][:8].float() / 255
    x = (images - torch.tensor(DigitsDataModule.mean)[:, None, None]) / torch.tensor(DigitsDataModule.std)[
        :, None, None
    ]
    with torch.no_grad():
        members = method.predict_members(x)
        log_probs = method.predict_log_probs(x)
    assert (
        members.shape == (4, 8, 10) and torch.isfinite(members).all() and (members[0] - members[1]).abs().max() > 1e-4
    )
    torch.testing.assert_close(log_probs.exp(), members.exp().mean(0))  # the members' mean probability
