"""The rank-1 BNN (dbsn.methods.rank1_bnn): with vanishing scales and unit factors it is the plain
network (outputs and the shared weights' gradients), with vanishing scales and any factors the
BatchEnsemble of those fast weights; its loss is the NLL plus the annealed closed-form KL over N;
the authors' optimiser groups; S members, member j a draw of component j mod M; a few
training steps and the evaluation suite on digits; the registry, compare and the field know it."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dbsn.methods import MAP, BatchEnsemble, Prediction, Rank1BNN
from dbsn.nets import StructureNet
from dbsn.nets.batch_ensemble import fast_parameters, member_biases
from dbsn.nets.rank1 import rank1_layers, scale_parameters
from tests.support.configs import (
    ROOT,
    TINY,
    compose_config,
    configured_optimizers,
    evaluate_quietly,
    evaluate_the_whole_suite,
)
from tests.support.netutil import set_random_affine
from tests.support.scripts import run_python

M = 3


def _structure_net() -> StructureNet:
    return StructureNet(num_classes=10, num_nodes=4, cells_per_stage=1, growth=4, stem_channels=8)


def _wide_resnet() -> nn.Module:
    from dbsn.nets.wideresnet import WideResNet

    return WideResNet(num_classes=10, depth=10, widen_factor=1)


NETS = {"structure_net": _structure_net, "wrn": _wide_resnet}


def _vanish_scales(method: Rank1BNN) -> None:
    """Scales softplus(-40) ≈ 4e-18: every draw is its location in float64, the KL finite."""
    with torch.no_grad():
        for rho in scale_parameters(method.net):
            rho.fill_(-40.0)


def _shared_name(name: str) -> str:
    return name.replace(".layer.", ".")


@pytest.mark.parametrize("name", NETS)
def test_vanishing_scales_and_unit_factors_give_the_plain_network_in_outputs_and_gradients(name):
    """Factors r = s = 1 with scales → 0 and the components' biases equal to the plain bias: every
    row is the plain network, in training (BatchNorm over the M copies of the batch has the batch's
    statistics) and at prediction; the loss's NLL is the plain network's mean NLL, and the KL does not
    touch the shared weights, so every shared weight, BatchNorm parameter and θ has the plain
    network's gradient, each component's bias 1/M of the plain bias's."""
    torch.manual_seed(0)
    net = NETS[name]()
    set_random_affine(net, 0)
    plain = MAP(copy.deepcopy(net), dataset_size=10).double()
    bnn = Rank1BNN(net, size=M, random_sign_init=0.0, dataset_size=10, prediction=Prediction(2 * M, M, M)).double()
    _vanish_scales(bnn)
    if plain.learn_structure:
        bnn.theta.data.copy_(plain.theta.data + torch.randn_like(plain.theta))
        plain.theta.data.copy_(bnn.theta.data)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    bnn.eval(), plain.eval()
    with torch.no_grad():
        members = bnn.predict_members(x)
        assert members.shape == (2 * M, 4, 10)
        for member in members:
            torch.testing.assert_close(member, plain.predict_log_probs(x), rtol=1e-10, atol=1e-10)

    bnn.train(), plain.train()
    out, ref = bnn.training_loss(x, y), plain.training_loss(x, y)
    rows = out["logits"].view(4, M, 10)
    for m in range(M):
        torch.testing.assert_close(rows[:, m], ref["logits"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["nll"], ref["nll"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["loss"], ref["loss"] + out["weight_kl"] / 10, rtol=1e-12, atol=1e-12)
    out["loss"].backward()
    ref["loss"].backward()
    plain_params = dict(plain.named_parameters())
    factors = {id(p) for p in bnn.factor_parameters()}
    biases = {id(p) for p in member_biases(bnn.net)}
    compared = {"shared": 0, "bias": 0}
    for key, p in bnn.named_parameters():
        if id(p) in factors:
            continue
        if id(p) in biases:
            torch.testing.assert_close(p.grad, plain_params[key].grad.expand(M, -1) / M, rtol=1e-8, atol=1e-12, msg=key)
            compared["bias"] += 1
            continue
        torch.testing.assert_close(p.grad, plain_params[_shared_name(key)].grad, rtol=1e-8, atol=1e-12, msg=key)
        compared["shared"] += 1
    assert compared["shared"] == len(plain_params) - compared["bias"] and compared["bias"] >= 1, compared


@pytest.mark.parametrize("name", NETS)
def test_vanishing_scales_give_the_batch_ensemble_of_the_same_fast_weights(name):
    """Any locations r, s (BatchEnsemble's N(1, 0.5²) initialisation) with scales → 0: the rank-1 BNN
    is BatchEnsemble with those fast weights, its rows, its NLL and every gradient of it, and member j
    at prediction is BatchEnsemble's member j mod M."""
    torch.manual_seed(0)
    net = NETS[name]()
    set_random_affine(net, 0)
    ensemble = BatchEnsemble(copy.deepcopy(net), size=M, dataset_size=10).double()
    bnn = Rank1BNN(net, size=M, dataset_size=10, prediction=Prediction(2 * M, M, 4)).double()
    missing, unexpected = bnn.load_state_dict(ensemble.state_dict(), strict=False)
    scales = {id(p) for p in scale_parameters(bnn.net)}
    assert not unexpected and set(missing) == {n for n, p in bnn.named_parameters() if id(p) in scales} | {"steps"}
    _vanish_scales(bnn)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    bnn.eval(), ensemble.eval()
    with torch.no_grad():
        members, reference = bnn.predict_members(x), ensemble.predict_members(x)
    for j, member in enumerate(members):
        torch.testing.assert_close(member, reference[j % M], rtol=1e-10, atol=1e-10)
    bnn.train(), ensemble.train()
    out, ref = bnn.training_loss(x, y), ensemble.training_loss(x, y)
    torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-10, atol=1e-10)
    out["nll"].backward()
    ref["nll"].backward()
    grads = dict(ensemble.named_parameters())
    for key, p in bnn.named_parameters():
        if key in grads:
            torch.testing.assert_close(p.grad, grads[key].grad, rtol=1e-8, atol=1e-12, msg=key)


def _normal_kl_sum(loc, scale, mean=1.0, stddev=0.1) -> float:
    return (
        torch.distributions.kl_divergence(
            torch.distributions.Normal(loc, scale), torch.distributions.Normal(mean, stddev)
        )
        .sum()
        .item()
    )


def test_the_loss_is_the_nll_plus_the_annealed_closed_form_kl_over_n():
    """KL: every factor entry of every component and layer against N(1, 0.1²), in closed form; its weight
    rises with the optimiser steps as (step + 1) / (kl_annealing · epochs · steps per epoch) to 1."""
    torch.manual_seed(0)
    bnn = Rank1BNN(_structure_net(), size=M, dataset_size=50, learn_structure=False)
    expected = sum(
        _normal_kl_sum(loc, scale)
        for layer in rank1_layers(bnn.net)
        for loc, scale in zip((layer.r.detach(), layer.s.detach()), layer.scales())
    )
    assert bnn.kl().item() == pytest.approx(expected, rel=1e-5)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    out = bnn.training_loss(x, y)  # outside a trainer (a step timed alone): the whole KL
    assert out["kl_scale"].item() == 1.0
    torch.testing.assert_close(out["loss"], out["nll"] + out["weight_kl"] / 50)
    bnn._trainer = SimpleNamespace(max_epochs=10, num_training_batches=5)  # 0.8 x 50 steps: 40
    for steps, scale in ((0, 1 / 40), (19, 0.5), (39, 1.0), (120, 1.0)):
        bnn.steps.fill_(steps)
        assert bnn.kl_scale().item() == pytest.approx(scale), steps
    bnn.on_after_optimizer_step(2)
    assert bnn.steps.item() == 121
    bnn.kl_annealing = 0.0
    assert bnn.kl_scale() == 1.0


def test_the_optimiser_follows_the_authors_groups(tmp_path):
    """lr 0.1, Nesterov, no clipping, × 0.2 at 40, 80, 90 % of training; weight decay 2 × 1e-4 (their
    L2) on the shared weights, BatchNorm and the components' biases, none on the factors' locations
    and scales, which take fast_weight_lr_multiplier × the lr (1 in the authors' flags)."""
    overrides = ["model=rank1_bnn", "model/net=structure_net", "model.net.num_nodes=3", "model.net.cells_per_stage=1"]
    method, optimizers, schedules = configured_optimizers(compose_config("train", overrides, tmp_path).model)
    sgd = optimizers[0]
    assert method.size == 4 and sgd.defaults["nesterov"] and method.optim.grad_clip_norm is None
    kinds = {(g["lr"], g["weight_decay"]): {id(p) for p in g["params"]} for g in sgd.param_groups}
    factors = {id(p) for p in fast_parameters(method.net) + scale_parameters(method.net)}
    assert kinds.keys() == {(0.1, 2e-4), (0.1, 0.0)} and kinds[0.1, 0.0] == factors
    assert {id(method.net.classifier.bias)} <= kinds[0.1, 2e-4]
    assert sorted(schedules[0].milestones) == [2, 3, 4] and schedules[0].gamma == 0.2  # of max_epochs = 4
    halved = configured_optimizers(
        compose_config("train", [*overrides, "model.fast_weight_lr_multiplier=0.5"], tmp_path).model
    )[1][0]
    kinds = {(g["lr"], g["weight_decay"]): {id(p) for p in g["params"]} for g in halved.param_groups}
    assert kinds.keys() == {(0.1, 2e-4), (0.05, 0.0)} and len(kinds[0.05, 0.0]) == len(factors)


def test_members_are_draws_of_component_j_mod_m_in_any_chunks():
    torch.manual_seed(0)
    bnn = Rank1BNN(_structure_net(), size=M, dataset_size=10, prediction=Prediction(4 * M, M, 5)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        drawn = bnn.predict_members(x)
        assert drawn.shape == (4 * M, 2, 10) and not torch.allclose(drawn[0], drawn[M])  # two draws of component 0
        with bnn.fixed_members(4 * M):  # the same draws for both: the predictive is the members' mean probability
            torch.testing.assert_close(bnn.predict_log_probs(x).exp(), bnn.predict_members(x).exp().mean(0))
        _vanish_scales(bnn)
        members = bnn.predict_members(x)  # chunks of 5 members: rounds of M = 3 cut inside
        one_call = bnn.stochastic_forward(x, 4 * M).log_softmax(-1)
    torch.testing.assert_close(members, one_call)
    for j in range(4 * M):
        torch.testing.assert_close(members[j], members[j % M])
    assert not torch.allclose(members[0], members[1])
    bnn.n_samples = 10  # not a multiple of M: components 0 .. (S mod M) - 1 have one draw more
    with torch.no_grad():
        members = bnn.predict_members(x)
    assert bnn.num_members == 10 and members.shape[0] == 10
    torch.testing.assert_close(members[9], members[0])
    with pytest.raises(ValueError, match="point estimates; it cannot take MCDropoutWeights"):
        from dbsn.methods import MCDropoutWeights

        Rank1BNN(_structure_net(), weights=MCDropoutWeights())
    with pytest.raises(ValueError, match="dropout_rate .* must be in \\(0, 1\\), got 0.0"):
        Rank1BNN(_structure_net(), dropout_rate=0.0)


def test_held_members_are_one_network_each_while_held():
    torch.manual_seed(0)
    bnn = Rank1BNN(_structure_net(), size=M, dataset_size=10).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        with bnn.fixed_members(5):
            first, features = bnn.member_outputs(x, 5)
            again = bnn.stochastic_forward(x, 3, 2)  # members 2, 3, 4 in one forward
            pair = bnn.stochastic_forward(x[:1].expand(2, -1, -1, -1), 1, 4)  # one example twice: one network
        after = bnn.stochastic_forward(x, 5)
    torch.testing.assert_close(again, first[2:5])
    torch.testing.assert_close(pair[0, 0], pair[0, 1])
    assert features.shape == (5, 3, bnn.net.classifier.layer.in_features)
    assert not torch.allclose(after, first)  # fresh draws outside


COMMON = [
    "model=rank1_bnn",
    "data=digits",
    "data.batch_size=16",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "model.size=2",
    "model.prediction.n_samples=4",
    "model.prediction.val_samples=2",
    "test=false",
    *[o for o in TINY if not o.startswith("model.")],
]
NET_OVERRIDES = {
    "structure_net": [
        "model/net=structure_net",
        "model.net.num_nodes=3",
        "model.net.cells_per_stage=1",
        "model.net.growth=4",
        "model.net.stem_channels=8",
    ],
    "resnet18": ["model/net=resnet18", "model.net.width=4"],
}


@pytest.mark.parametrize("net", NET_OVERRIDES)
def test_trains_and_predicts_on_digits(net, tmp_path):
    """Two training steps through train() (the KL annealed over 0.8 of the 2 steps); the method rebuilt
    from the checkpoint keeps its step count and predicts S = 4 members, two draws of each component;
    evaluate.py's test pass on the ResNet-18 checkpoint."""
    from dbsn.data.digits import DigitsDataModule, digits_splits
    from dbsn.runtime.build import load_method
    from dbsn.runtime.run import train

    train(compose_config("train", [*COMMON, *NET_OVERRIDES[net]], tmp_path), tmp_path)
    method = load_method(tmp_path / "checkpoints" / "last.ckpt", num_classes=10).eval()
    assert isinstance(method, Rank1BNN) and method.steps.item() == 2 and method.n_samples == 4
    images = digits_splits()[1][0][:8].float() / 255
    x = (images - torch.tensor(DigitsDataModule.mean)[:, None, None]) / torch.tensor(DigitsDataModule.std)[
        :, None, None
    ]
    with torch.no_grad():
        members = method.predict_members(x)
    assert members.shape == (4, 8, 10) and torch.isfinite(members).all() and (members[0] - members[2]).abs().max() > 0
    if net != "resnet18":  # one evaluate.py run is enough (the suite's: test_the_evaluation_suite_runs_on_it)
        return
    results = evaluate_quietly(tmp_path / "checkpoints" / "last.ckpt", tmp_path / "eval", ["ablation.sizes=[1,2,4]"])
    assert 0 <= results["test/error"] <= 1 and results["test/nll"] > 0
    assert json.loads((tmp_path / "evaluation" / "metrics.json").read_text())["n_samples"] == 4


@pytest.mark.slow
def test_the_evaluation_suite_runs_on_it(tmp_path):
    """evaluate.py's OOD detection with every score (features at the last layer of held members, ViM's
    heads), dataset shift on generated corruptions, conformal sets and the adversarial attacks."""
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
    from dbsn.methods.registry import method_config
    from dbsn.runtime.config import validate_config
    from dbsn.tools.compare import compared_methods, method_overrides, shared_overrides

    entry = method_config("rank1_bnn")
    assert entry.cls is Rank1BNN and not entry.fixed_members and entry.networks == "any" and entry.sgd
    assert "rank1_bnn" in compared_methods()
    cfg = compose_config(
        "train", [*method_overrides("rank1_bnn", 10, 21, backbone="resnet18"), *shared_overrides()], tmp_path
    )
    validate_config(cfg)
    own = compose_config("train", ["model=rank1_bnn"], tmp_path).model
    assert cfg.model.prediction.n_samples == 100 and list(cfg.model.optim.milestones) == [0.5, 0.75]
    for key in (
        "prior",
        "prior_stddev",
        "dropout_rate",
        "random_sign_init",
        "kl_annealing",
        "fast_weight_lr_multiplier",
    ):
        assert cfg.model[key] == own[key], key  # the fair protocol keeps its own relative settings
    assert (cfg.model.optim.lr, cfg.model.optim.weight_decay, cfg.model.optim.nesterov) == (0.1, 2e-4, True)
    result = run_python(
        ROOT / "train.py",
        "experiment=cifar10_field",
        "field=resnet18/rank1_bnn",
        "seed=1",
        "--cfg",
        "job",
        cwd=tmp_path,
        timeout=120,
    )
    assert "_target_: dbsn.methods.Rank1BNN" in result.stdout and "_target_: dbsn.nets.ResNet18" in result.stdout
    assert "max_epochs: 75" in result.stdout and "seed: 1" in result.stdout
