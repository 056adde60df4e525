"""Tests of the Bayes by Backprop layers (dbsn.bayes).

References here are written independently of dbsn.bayes: Monte Carlo KLs from
torch.distributions.Normal, and output moments of a layer with weights w ~ N(mu, sigma^2)
computed by hand: E[out] = the layer with the means, Var[out] = the layer applied to x^2
with the variances as weights (the weights are independent). Statistical checks compare
sample moments with these within 5 standard errors (all outputs here are exactly Gaussian,
so the standard error of a sample variance v over N draws is v sqrt(2 / (N - 1))).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Normal

from dbsn.bayes import BayesConv2d, BayesLayer, BayesLinear, bayesianize, gaussian_kl, kl_divergence, set_sampling
from tests.support.autocast import bf16_autocast

F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randomize(layer: BayesLayer, rho_low: float = -2.0, rho_high: float = 0.0) -> BayesLayer:
    """Random mu ~ N(0, 0.5^2) and rho ~ U(rho_low, rho_high) on weight and bias."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("_mu"):
                p.normal_(0.0, 0.5)
            else:
                p.uniform_(rho_low, rho_high)
    return layer


def posterior_params(layer: BayesLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """All (mu, sigma) of a layer, flattened and concatenated (weight then bias)."""
    mus = [layer.weight_mu.flatten()]
    sigmas = [F.softplus(layer.weight_rho).flatten()]
    if layer.bias_mu is not None:
        mus.append(layer.bias_mu)
        sigmas.append(F.softplus(layer.bias_rho))
    return torch.cat(mus), torch.cat(sigmas)


def assert_gaussian_moments(samples: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, n_se: float = 5.0):
    """samples (N, ...) have elementwise mean ``mean`` and variance ``var`` within n_se SEs."""
    n = samples.shape[0]
    sample_mean, sample_var = samples.mean(0), samples.var(0)
    mean_se = (var / n).sqrt()
    var_se = var * (2.0 / (n - 1)) ** 0.5
    assert ((sample_mean - mean).abs() <= n_se * mean_se).all(), (sample_mean - mean).abs().div(mean_se).max()
    assert ((sample_var - var).abs() <= n_se * var_se).all(), (sample_var - var).abs().div(var_se).max()


# Deterministic layer, input shape, and the modes its Bayesian twin is tested in.
LINEAR = [
    (lambda: nn.Linear(6, 4), (5, 6)),
    (lambda: nn.Linear(6, 4, bias=False), (5, 6)),
]
CONV = [
    (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1), (2, 3, 7, 7)),
    (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), (2, 4, 6, 6)),  # depthwise
    (lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2), (2, 4, 6, 6)),  # dilated
    (lambda: nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4), (2, 4, 6, 6)),  # both
]
CASES = [
    pytest.param(make, shape, {"local_reparameterization": lrt}, id=f"linear{i}-lrt{lrt}")
    for i, (make, shape) in enumerate(LINEAR)
    for lrt in (True, False)
] + [
    pytest.param(make, shape, {"flipout": flip}, id=f"conv{i}-flipout{flip}")
    for i, (make, shape) in enumerate(CONV)
    for flip in (False, True)
]


def twin_of(layer: nn.Module, init_rho: float, mode: dict) -> BayesLayer:
    cls = BayesLinear if isinstance(layer, nn.Linear) else BayesConv2d
    return cls.from_deterministic(layer, prior_sigma=0.1, init_rho=init_rho, **mode)


# --- KL -------------------------------------------------------------------------------


def test_gaussian_kl_is_the_closed_form_of_torch_distributions():
    mu, sigma = torch.randn(7, 3, dtype=F64), torch.rand(7, 3, dtype=F64) + 0.05
    for prior_sigma in (0.1, 1.0, 2.5):
        expected = torch.distributions.kl_divergence(Normal(mu, sigma), Normal(0.0, prior_sigma)).sum()
        torch.testing.assert_close(gaussian_kl(mu, sigma, prior_sigma), expected)


@pytest.mark.parametrize("prior_sigma", [0.05, 0.1, 1.0])
@pytest.mark.parametrize(
    "make",
    [
        lambda p: BayesLinear(4, 3, prior_sigma=p),
        lambda p: BayesConv2d(2, 3, 2, prior_sigma=p),
        lambda p: BayesConv2d(3, 3, 2, groups=3, bias=False, prior_sigma=p),
    ],
    ids=["linear", "conv", "depthwise-nobias"],
)
def test_layer_kl_matches_monte_carlo(make, prior_sigma):
    layer = randomize(make(prior_sigma).to(F64), rho_low=-4.0, rho_high=0.0)
    mu, sigma = posterior_params(layer)
    q, p = Normal(mu, sigma), Normal(torch.zeros_like(mu), prior_sigma)
    w = q.sample((20000,))
    log_ratio = (q.log_prob(w) - p.log_prob(w)).sum(-1)
    mc, se = log_ratio.mean(), log_ratio.std() / len(log_ratio) ** 0.5
    kl = layer.kl()
    assert kl.dim() == 0
    assert abs(kl.item() - mc.item()) < 5 * se.item(), (kl.item(), mc.item(), se.item())


# --- Deterministic limits -------------------------------------------------------------


@pytest.mark.parametrize("make, shape, mode", CASES)
def test_vanishing_sigma_gives_the_deterministic_layer(make, shape, mode):
    layer = make()
    x = torch.randn(shape)
    twin = twin_of(layer, init_rho=-30.0, mode=mode)
    assert twin.sample
    torch.testing.assert_close(twin(x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make, shape, mode", CASES)
def test_sampling_off_gives_exactly_the_mean_network(make, shape, mode):
    layer = make()
    x = torch.randn(shape)
    twin = twin_of(layer, init_rho=0.0, mode=mode)  # sigma = log 2: far from deterministic
    assert not torch.allclose(twin(x), layer(x), atol=1e-2)
    set_sampling(twin, False)
    assert not twin.sample
    assert torch.equal(twin(x), layer(x))
    assert torch.equal(twin(x), twin(x))
    set_sampling(twin, True)
    assert not torch.equal(twin(x), twin(x))


# --- Gradients ------------------------------------------------------------------------


@pytest.mark.parametrize("make, shape, mode", CASES)
@pytest.mark.parametrize("with_kl", [False, True], ids=["data", "data+kl"])
def test_gradients_reach_mu_and_rho(make, shape, mode, with_kl):
    twin = twin_of(make(), init_rho=-3.0, mode=mode)
    x = torch.randn(shape)
    out = twin(x)
    loss = (out * torch.randn_like(out)).sum()
    if with_kl:
        loss = loss + 1e-3 * kl_divergence(twin)
    loss.backward()
    for name, p in twin.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("make, shape, mode", CASES)
def test_sampling_off_gives_no_data_gradient_to_rho(make, shape, mode):
    twin = set_sampling(twin_of(make(), init_rho=-3.0, mode=mode), False)
    twin(torch.randn(shape)).sum().backward()
    assert twin.weight_mu.grad.abs().sum() > 0
    assert twin.weight_rho.grad is None


def test_local_reparameterization_gradient_is_finite_for_a_zero_input_without_bias():
    layer = BayesLinear(3, 2, bias=False)
    x = torch.cat([torch.zeros(1, 3), torch.randn(1, 3)])
    layer(x).sum().backward()
    assert torch.isfinite(layer.weight_mu.grad).all() and torch.isfinite(layer.weight_rho.grad).all()
    assert layer.weight_rho.grad.abs().sum() > 0


# --- Output distributions -------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_local_reparameterization_has_the_moments_of_weight_sampling(bias):
    layer = randomize(BayesLinear(5, 3, bias=bias).to(F64))
    x = torch.randn(4, 5, dtype=F64)
    w_var = F.softplus(layer.weight_rho).square()
    mean = x @ layer.weight_mu.T
    var = x.square() @ w_var.T
    if bias:
        mean = mean + layer.bias_mu
        var = var + F.softplus(layer.bias_rho).square()
    mean, var = mean.detach(), var.detach()
    with torch.no_grad():
        for lrt in (True, False):
            layer.local_reparameterization = lrt
            samples = torch.stack([layer(x) for _ in range(20000)])
            assert_gaussian_moments(samples, mean, var)
        # Local reparameterisation draws every example independently; weight sampling shares
        # one weight matrix across the batch.
        same = x[:1].expand(2, -1)
        layer.local_reparameterization = True
        out = layer(same)
        assert not torch.equal(out[0], out[1])
        layer.local_reparameterization = False
        out = layer(same)
        assert torch.equal(out[0], out[1])


CONV_MOMENT_CASES = [
    pytest.param(dict(in_channels=2, out_channels=3, kernel_size=3, padding=1), 2, id="conv"),
    pytest.param(
        dict(in_channels=3, out_channels=3, kernel_size=3, padding=2, dilation=2, groups=3, bias=False),
        3,
        id="depthwise-dilated",
    ),
]


@pytest.mark.parametrize("kwargs, channels", CONV_MOMENT_CASES)
def test_flipout_has_the_moments_of_weight_sampling(kwargs, channels):
    layer = randomize(BayesConv2d(**kwargs).to(F64))
    x = torch.randn(2, channels, 4, 4, dtype=F64)
    conv_args = (layer.stride, layer.padding, layer.dilation, layer.groups)
    b_var = None if layer.bias_rho is None else F.softplus(layer.bias_rho).square()
    with torch.no_grad():
        mean = F.conv2d(x, layer.weight_mu, layer.bias_mu, *conv_args)
        var = F.conv2d(x.square(), F.softplus(layer.weight_rho).square(), b_var, *conv_args)
        for flipout in (False, True):
            layer.flipout = flipout
            samples = torch.stack([layer(x) for _ in range(4000)])
            assert_gaussian_moments(samples, mean, var)


@pytest.mark.parametrize("kwargs, channels", CONV_MOMENT_CASES)
def test_flipout_decorrelates_the_examples_of_a_batch(kwargs, channels):
    layer = randomize(BayesConv2d(**kwargs).to(F64))
    x = torch.randn(1, channels, 4, 4, dtype=F64).expand(2, -1, -1, -1)  # one example, twice
    with torch.no_grad():
        layer.flipout = False
        for _ in range(10):
            out = layer(x)
            assert torch.equal(out[0], out[1])  # one weight sample: perfectly correlated
        layer.flipout = True
        samples = torch.stack([layer(x) for _ in range(1500)])  # (N, 2, C, H, W)
        if layer.groups == 1:
            # Input signs matter: with output signs alone the two perturbations would always
            # be +- each other (they still are when s_in^0 = +-s_in^1: probability 1/2 for
            # two input channels, hence 20 draws). A depthwise conv has one input channel
            # per output channel, so there the input signs are absorbed into the output signs.
            set_sampling(layer, False)
            perturbation = samples[:20] - layer(x)
            assert not torch.allclose(perturbation[:, 0].abs(), perturbation[:, 1].abs())
    a, b = (samples[:, i] - samples[:, i].mean(0) for i in (0, 1))
    corr = (a * b).mean(0) / (a.square().mean(0) * b.square().mean(0)).sqrt()
    assert corr.abs().max() < 0.15, corr.abs().max()  # SE of a zero correlation: 1/sqrt(N) ~ 0.026


# --- Whole networks -------------------------------------------------------------------


class Residual(nn.Sequential):
    """A custom nn.Sequential subclass: x + its layers applied to x."""

    def forward(self, x):
        return x + super().forward(x)


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.ModuleList(
            [
                Residual(
                    nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4, bias=False),
                    nn.BatchNorm2d(4),
                    nn.ReLU(),
                    nn.Conv2d(4, 4, 1),
                ),
                Residual(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
            ]
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 8), nn.ReLU())
        self.classifier = nn.Linear(8, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.classifier(self.head(x))


def count(module: nn.Module, types) -> int:
    return sum(isinstance(m, types) for m in module.modules())


@pytest.mark.parametrize("flipout", [False, True])
def test_bayesianize_replaces_every_conv_and_linear(flipout):
    net = SmallNet().eval()  # eval: BatchNorm with running statistics, deterministic
    original = copy.deepcopy(net)
    n_bn = count(net, nn.BatchNorm2d)
    converted_params = sum(
        p.numel() for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear)) for p in m.parameters()
    )
    total_params = sum(p.numel() for p in net.parameters())
    x = torch.randn(3, 3, 8, 8)

    assert bayesianize(net, prior_sigma=0.2, init_rho=-2.0, flipout=flipout) is net
    assert count(net, (nn.Conv2d, nn.Linear)) == 0
    assert count(net, BayesConv2d) == 4 and count(net, BayesLinear) == 2
    assert count(net, nn.BatchNorm2d) == n_bn
    assert isinstance(net.blocks[0], Residual)
    assert all(m.flipout == flipout for m in net.modules() if isinstance(m, BayesConv2d))
    assert all(m.prior_sigma == 0.2 for m in net.modules() if isinstance(m, BayesLayer))
    assert sum(p.numel() for p in net.parameters()) == total_params + converted_params

    assert not torch.allclose(net(x), original(x), atol=1e-3)
    set_sampling(net, False)
    torch.testing.assert_close(net(x), original(x), rtol=0, atol=0)

    kl = kl_divergence(net)
    assert kl.dim() == 0 and kl > 0
    torch.testing.assert_close(kl, sum(m.kl() for m in net.modules() if isinstance(m, BayesLayer)))
    kl.backward()
    assert net.stem[0].weight_rho.grad.abs().sum() > 0


def test_bayesianize_keeps_tied_layers_tied_and_converts_a_bare_layer():
    shared = nn.Linear(3, 3)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    bayesianize(net)
    assert isinstance(net[0], BayesLinear) and net[0] is net[2]
    torch.testing.assert_close(kl_divergence(net), net[0].kl())  # counted once

    conv = nn.Conv2d(2, 2, 1)
    twin = bayesianize(conv, init_rho=-3.0)
    assert isinstance(twin, BayesConv2d) and torch.equal(twin.weight_mu, conv.weight)


def test_kl_divergence_is_zero_without_bayesian_layers():
    kl = kl_divergence(nn.Sequential(nn.Linear(2, 2).to(F64), nn.ReLU()))
    assert kl.dim() == 0 and kl.item() == 0.0 and kl.dtype == F64
    assert kl_divergence(nn.ReLU()).item() == 0.0


def test_from_deterministic_copies_means_and_hyperparameters():
    conv = nn.Conv2d(4, 8, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2).to(F64)
    twin = BayesConv2d.from_deterministic(conv, prior_sigma=0.3, init_rho=-6.0, flipout=True)
    for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
        assert getattr(twin, attr) == getattr(conv, attr), attr
    assert twin.weight_mu.dtype == F64 and torch.equal(twin.weight_mu, conv.weight)
    assert torch.equal(twin.bias_mu, conv.bias)
    assert (twin.weight_rho == -6.0).all() and (twin.bias_rho == -6.0).all()
    assert twin.flipout and twin.prior_sigma == 0.3
    with pytest.raises(ValueError, match="padding_mode"):
        BayesConv2d.from_deterministic(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))

    linear = nn.Linear(3, 2, bias=False)
    twin = BayesLinear.from_deterministic(linear, local_reparameterization=False)
    assert twin.bias_mu is None and twin.bias_rho is None and not twin.local_reparameterization
    assert torch.equal(twin.weight_mu, linear.weight)


# ----- mixed precision: the Gaussian weights' KL is a float32 island (dbsn.precision)


def test_gaussian_weight_kl_is_float32_under_autocast():
    torch.manual_seed(0)
    net = nn.Sequential(
        BayesConv2d(3, 8, 3, prior_sigma=0.1, init_rho=-3.0),
        nn.ReLU(),
        BayesConv2d(8, 4, 3, prior_sigma=0.1, init_rho=-4.0),
    )
    reference = kl_divergence(net)
    with bf16_autocast():
        mixed = kl_divergence(net)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, reference, rtol=1e-6, atol=0)
