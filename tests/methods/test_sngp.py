"""SNGP (dbsn.methods.sngp, dbsn.nets.spectral, dbsn.bayes.gp): the hidden layers keep their spectral
norm under the bound after training steps, the Gaussian-process covariance is the closed form of
the final epoch's features, the mean-field logits are the formula, and the method trains, predicts
and reloads on digits on the tiny backbones."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dbsn.bayes.gp import RandomFeatureGaussianProcess, orthogonal_random_features
from dbsn.data.digits import DigitsDataModule, digits_splits
from dbsn.methods import SNGP
from dbsn.nets.spectral import spectral_normalize, spectrally_normalized_layers
from dbsn.posthoc.base import point_estimate_classifier
from dbsn.runtime.build import build_model
from dbsn.runtime.run import train
from tests.support.configs import compose_config, evaluate_quietly
from tests.support.steputil import prediction

TINY_NETS = {
    "resnet18": ["model.net.width=8"],
    "wrn28_10": ["model.net.depth=10", "model.net.widen_factor=1"],
    "structure_net": [
        "model.net.num_nodes=3",
        "model.net.cells_per_stage=1",
        "model.net.growth=4",
        "model.net.stem_channels=8",
    ],
}
TINY_GP = ["model.gp.hidden_dim=64", "model.gp.input_dim=16"]


def _sngp(net: str, *extra: str, tmp_path) -> SNGP:
    """model=sngp on the tiny `net`, built from the real config (its optimiser settings included)."""
    cfg = compose_config(
        "train",
        ["model=sngp", f"model/net={net}", *TINY_NETS[net], *TINY_GP, "data=digits", "model.dataset_size=64", *extra],
        tmp_path,
    )
    torch.manual_seed(0)
    return build_model(cfg.model, num_classes=10)


def _steps(method: SNGP, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> None:
    """`steps` SGD steps as `Method.training_step` takes them, with the method's own optimiser."""
    sgd, _ = method.optim.build(method.weight_parameters(), 10, method.no_decay_parameters())
    method.train()
    for _ in range(steps):
        sgd.zero_grad()
        method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
        sgd.step()


def _operator_norm(layer: nn.Module) -> float:
    """The exact spectral norm of the operator the layer computes now (bounded weight): the
    largest singular value of its dense matrix, a convolution applied to every basis image of its
    input, in float64."""
    spec = layer.parametrizations.weight[0]
    w = layer.weight.detach().double()
    if spec.conv is None:
        return torch.linalg.matrix_norm(w, ord=2).item()
    shape = spec.input_shape[1:]
    basis = torch.eye(math.prod(shape), dtype=torch.float64).view(-1, *shape)
    return torch.linalg.matrix_norm(F.conv2d(basis, w, None, **spec.conv).flatten(1), ord=2).item()


def _digits(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    (images, labels), _ = digits_splits()
    mean, std = torch.tensor(DigitsDataModule.mean), torch.tensor(DigitsDataModule.std)
    return (images[:n].float() / 255 - mean[:, None, None]) / std[:, None, None], labels[:n]


# ---------------------------------------------------------------------- spectral normalisation


@pytest.mark.parametrize("net", ["resnet18", "wrn28_10"])
def test_every_hidden_layer_stays_under_the_bound_after_two_steps(net, tmp_path):
    """The bound 0.5 is below most layers' norms, so it is active: every convolution's operator norm
    on its input (6x6 images), computed exactly, is at most the bound (power iteration approaches
    it from below: 3 % for the weights' change since the last iteration), and a layer whose weight
    exceeds the bound sits at it. (Not the norm of the reshaped kernel: that differs.)"""
    method = _sngp(net, "model.spectral_bound=0.5", "model.input_size=6", tmp_path=tmp_path)
    layers = spectrally_normalized_layers(method.net)
    convs = [name for name, m in method.net.named_modules() if isinstance(m, nn.Conv2d)]
    assert sorted(layers) == sorted(convs) and "classifier" not in layers  # every conv, not the GP
    g = torch.Generator().manual_seed(0)
    _steps(method, torch.randn(16, 3, 6, 6, generator=g), torch.randint(0, 10, (16,), generator=g))
    method.eval()
    for name, layer in layers.items():
        norm = _operator_norm(layer)
        assert norm <= 0.5 * 1.03, (name, norm)
        with torch.no_grad(), torch.nn.utils.parametrize.cached():
            original = layer.parametrizations.weight.original
            unbounded = layer.parametrizations.weight[0].sigma(original).item()
        if unbounded > 0.5 * 1.05:
            assert norm >= 0.5 * 0.97, (name, norm, unbounded)


def test_a_loose_bound_leaves_the_weights_alone_and_eval_does_not_iterate():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    net = nn.Module()
    net.conv, net.classifier = conv, nn.Linear(4, 2)
    net.forward = lambda x, alpha=None: net.classifier(net.conv(x).mean((2, 3)))
    before = conv.weight.detach().clone()
    spectral_normalize(net, bound=1e3, input_size=8, skip=("classifier",))
    assert list(spectrally_normalized_layers(net)) == ["conv"]
    torch.testing.assert_close(conv.weight, before)  # min(1, c / sigma) = 1
    spec = conv.parametrizations.weight[0]
    net.eval()
    u = spec._u.clone()
    conv.weight  # noqa: B018 - a forward in eval mode reads the weight
    assert torch.equal(spec._u, u)


# ---------------------------------------------------------------------- the Gaussian-process layer


def _features(gp: RandomFeatureGaussianProcess, h: torch.Tensor) -> torch.Tensor:
    """φ(h) = cos(W LayerNorm(P h) + b), from the layer's buffers, in float64."""
    z = F.layer_norm(
        h.double() @ gp.projection.double().T,
        (gp.projection.shape[0],),
        gp.input_norm.weight.double(),
        gp.input_norm.bias.double(),
        eps=1e-3,
    )
    return torch.cos(z @ gp.feature_weight.double().T + gp.feature_bias.double())


def test_covariance_and_mean_field_logits_are_the_closed_form():
    torch.manual_seed(0)
    ridge, factor = 0.5, 2.0
    gp = RandomFeatureGaussianProcess(6, 3, hidden_dim=32, input_dim=4, ridge_penalty=ridge, mean_field_factor=factor)
    with torch.no_grad():  # LayerNorm away from the identity, so the test sees it
        gp.input_norm.weight.uniform_(0.5, 1.5)
        gp.input_norm.bias.uniform_(-0.5, 0.5)
    epochs = [[torch.randn(5, 6), torch.randn(7, 6)], [torch.randn(4, 6), torch.randn(6, 6)]]
    gp.train()
    for batches in epochs:  # two epochs of two batches: the precision holds the last epoch's
        gp.reset_precision()
        for h in batches:
            gp(h)
    phi = _features(gp, torch.cat(epochs[-1]))  # (10, 32): fewer examples than features
    precision = ridge * torch.eye(32, dtype=torch.float64) + phi.T @ phi
    torch.testing.assert_close(gp.precision.double(), precision, rtol=1e-5, atol=1e-5)

    gp.eval()
    h_test = torch.cat([torch.randn(3, 6), torch.cat(epochs[-1])[:2]])  # new inputs and trained ones
    phi_test = _features(gp, h_test)
    variance = ridge * (phi_test * torch.linalg.solve(precision, phi_test.T).T).sum(-1)  # s φᵀ (s I + ΦᵀΦ)⁻¹ φ
    torch.testing.assert_close(gp.predictive_variance(phi_test.float()).double(), variance, rtol=1e-4, atol=1e-5)
    logits = phi_test @ gp.output.weight.double().T
    torch.testing.assert_close(
        gp(h_test).double(), logits / torch.sqrt(1 + factor * variance)[:, None], rtol=1e-4, atol=1e-5
    )
    gp.mean_field_factor = -1.0  # the MAP logits
    torch.testing.assert_close(gp(h_test).double(), logits, rtol=1e-4, atol=1e-5)


def test_the_precision_resets_and_sums_the_processes():
    torch.manual_seed(0)
    gp = RandomFeatureGaussianProcess(6, 3, hidden_dim=16, input_dim=None, ridge_penalty=1.0)
    h = torch.randn(8, 6)
    gp.train()
    gp(h)
    gram = gp.precision - torch.eye(16)
    assert gram.abs().sum() > 1
    gp.sync_precision(lambda t: 2 * t)  # two processes with the same batch
    torch.testing.assert_close(gp.precision, torch.eye(16) + 2 * gram)
    gp.reset_precision()
    torch.testing.assert_close(gp.precision, torch.eye(16))
    gp.eval()
    torch.testing.assert_close(gp.covariance, torch.eye(16))  # s (s I)⁻¹, recomputed at the prediction
    gp(h)
    torch.testing.assert_close(gp.covariance, torch.eye(16))


def test_orthogonal_random_features_are_orthogonal_in_each_block():
    w = orthogonal_random_features(8, 20, std=0.05, generator=torch.Generator().manual_seed(0))
    assert w.shape == (20, 8)
    for block in (w[:8], w[8:16]):
        gram = block @ block.T
        torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)), atol=1e-6, rtol=0)
    assert 0.05 * 1.5 < w.norm(dim=1).mean() < 0.05 * 4  # |N(0, 0.05² I_8)| ≈ 0.05 √8


# ---------------------------------------------------------------------- the method


@pytest.mark.parametrize("net", ["resnet18", "structure_net"])
def test_sngp_trains_two_steps_and_predicts_on_digits(net, tmp_path):
    method = _sngp(net, tmp_path=tmp_path)
    assert isinstance(method.net.classifier, RandomFeatureGaussianProcess)
    x, y = _digits()
    before = [p.detach().clone() for p in method.parameters()]
    method.on_train_epoch_start()
    _steps(method, x, y)
    assert any(not torch.equal(a, b) for a, b in zip(before, method.parameters()))
    assert (method.gp.precision - torch.eye(64)).abs().sum() > 1  # the steps' features

    members = prediction(method, x[:8], 1)
    assert members.shape == (1, 8, 10) and torch.isfinite(members).all()
    torch.testing.assert_close(members, prediction(method, x[:8], 1))  # one deterministic pass
    torch.testing.assert_close(members.exp().sum(-1), torch.ones(1, 8))
    method.on_train_epoch_start()  # a new epoch
    torch.testing.assert_close(method.gp.precision, torch.eye(64))
    assert "nn.Linear" in point_estimate_classifier(method, "laplace")  # posthoc=laplace refuses it in one line


@pytest.mark.slow
def test_train_then_evaluate_the_checkpoint_with_the_final_epochs_covariance(tmp_path, monkeypatch):
    """train.py for two epochs of one step: the checkpoint's precision is s I + the second epoch's
    features only, and evaluate.py on it predicts exactly what the run's test pass did."""
    seen: dict[int, list] = {}
    accumulate, reset = RandomFeatureGaussianProcess.accumulate, RandomFeatureGaussianProcess.reset_precision
    monkeypatch.setattr(
        RandomFeatureGaussianProcess,
        "accumulate",
        lambda self, phi: (seen.setdefault(id(self), []).append(phi.detach().clone()), accumulate(self, phi)),
    )
    monkeypatch.setattr(
        RandomFeatureGaussianProcess,
        "reset_precision",
        lambda self: (seen.setdefault(id(self), []).append("reset"), reset(self)),
    )
    run = tmp_path / "run"
    cfg = compose_config(
        "train",
        [
            "model=sngp",
            *TINY_NETS["wrn28_10"],
            *TINY_GP,
            "model.learn_structure=false",
            "data=digits",
            "data.batch_size=32",
            "data.eval_batch_size=450",
            "statistics.resamples=100",
            "trainer.max_epochs=2",
            "trainer.limit_train_batches=1",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
        ],
        run,
    )
    metrics = train(cfg, run)
    calls = next(c for c in seen.values() if c.count("reset") == 2)  # the trained network's layer
    last_epoch = calls[len(calls) - calls[::-1].index("reset") :]
    assert len(last_epoch) == 1 and last_epoch[0].shape == (32, 64)
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    phi = last_epoch[0].double()
    precision = torch.eye(64, dtype=torch.float64) + phi.T @ phi
    torch.testing.assert_close(state["net.classifier.precision"].double(), precision, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        state["net.classifier.covariance"].double(), torch.linalg.inv(precision), rtol=1e-4, atol=1e-5
    )

    evaluated = evaluate_quietly(run / "checkpoints" / "last.ckpt", tmp_path / "eval", ["statistics.resamples=100"])
    assert evaluated["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-6)
    assert json.loads((run / "metrics.json").read_text())["metrics"]["test/nll"] == pytest.approx(metrics["test/nll"])


def test_a_deep_ensemble_refuses_sngp_members_whose_precision_needs_their_epoch_hooks():
    from dbsn.methods import SNGP, DeepEnsemble
    from dbsn.nets import ResNet18

    with pytest.raises(ValueError, match="separate runs"):
        DeepEnsemble([SNGP(ResNet18(10, width=8)) for _ in range(2)])
