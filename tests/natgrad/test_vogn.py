"""VOGN: the update by hand, exact Bayesian linear regression, sampling scale, state_dict resume."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dbsn.natgrad import VOGN

# Bayesian linear regression y = Xw + noise(SIGMA2), prior N(0, PRIOR_VAR I), XᵀX diagonal.
N, D, SIGMA2, PRIOR_VAR = 32, 4, 0.25, 0.5


def _regression():
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(N, D, dtype=torch.float64))
    x = q * torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)  # orthogonal columns, XᵀX = diag(c^2)
    y = x @ torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64) + SIGMA2**0.5 * torch.randn(N, dtype=torch.float64)
    precision = x.T @ x / SIGMA2 + torch.eye(D, dtype=torch.float64) / PRIOR_VAR  # Σ⁻¹
    mean = torch.linalg.solve(precision, x.T @ y / SIGMA2)  # Σ Xᵀy / σ²
    return x, y, torch.diag(precision), mean


def _regression_run(steps: int, draws_per_step: int, noise: bool, momentum: float = 0.8, lr: float = 0.02):
    x, y, _, _ = _regression()
    torch.manual_seed(1)
    model = nn.Linear(D, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    opt = VOGN(
        model,
        lr=lr,
        dataset_size=N,
        prior_variance=PRIOR_VAR,
        tau=1.0,
        damping=0.0,
        momentum=momentum,
        beta2=1.0,
        init_precision=1.0,
        draws_per_step=draws_per_step,
    )
    opt.sample_noise = noise

    def closure():
        z = model(x).squeeze(1)
        loss = (0.5 * (y - z).square() / SIGMA2).sum()  # sum of per-example losses
        loss.backward(retain_graph=True)
        # ĥ from the exact Gauss-Newton: the output gradient 1/σ per example gives
        # (1/N) Σ_i x_i² / σ² (squared gradients at the observed y, r_i x_i / σ², would give the
        # empirical Fisher (1/N) Σ_i r_i² x_i² / σ⁴ instead, which is not the posterior precision).
        torch.autograd.grad((z / SIGMA2**0.5).sum(), [model.weight])
        return loss

    history = []
    for _ in range(steps):
        opt.step(closure)
        history.append(model.weight.detach().clone().squeeze(0))
    return model, opt, torch.stack(history)


def test_linear_regression_fixed_point_is_the_exact_posterior() -> None:
    """Noise-free (for linear regression E_q[ĝ] = ĝ(μ), so the mean's fixed point is the same).

    The correspondence: with N_eff = N, τ = 1, γ = 0, β2 = 1 and ĥ the GGN diagonal,
    N_eff (s + δ̃) = diag(XᵀX)/σ² + 1/prior_var = diag(Σ⁻¹) and μ = Σ Xᵀy/σ² (XᵀX diagonal).
    200 steps of lr 0.02 with β1 = 0.8 contract the error by ~0.894^200 ≈ 2e-10; with a
    (1 - β1) factor the effective step is 5x smaller and ~1% of the error would remain.
    """
    _, _, precision_diag, mean = _regression()
    model, opt, _ = _regression_run(steps=200, draws_per_step=1, noise=False)
    s = opt.state[model.weight]["precision"].squeeze(0)
    delta_tilde = 1.0 / (PRIOR_VAR * N)
    torch.testing.assert_close(N * (s + delta_tilde), precision_diag, rtol=1e-10, atol=0)
    torch.testing.assert_close(model.weight.detach().squeeze(0), mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.posterior_std()["weight"].squeeze(0), precision_diag.rsqrt(), rtol=1e-10, atol=0)


def test_linear_regression_with_weight_noise_converges_to_the_posterior() -> None:
    """K = 8 MC samples per step; μ averaged over the last 150 steps is within 0.15 posterior
    std of the exact mean (MC error ~0.03 std; a doubled prior, i.e. N_eff or δ̃ off by 2,
    moves coordinate 1 by 0.74 std)."""
    _, _, precision_diag, mean = _regression()
    model, opt, history = _regression_run(steps=250, draws_per_step=8, noise=True)
    std = precision_diag.rsqrt()
    s = opt.state[model.weight]["precision"].squeeze(0)
    torch.testing.assert_close(N * (s + 1.0 / (PRIOR_VAR * N)), precision_diag, rtol=1e-10, atol=0)
    error = (history[-150:].mean(0) - mean) / std
    assert error.abs().max() < 0.15, error


def _classifier_data():
    torch.manual_seed(2)
    model = nn.Linear(3, 2).double()
    return model, torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])


def _stats_by_hand(model: nn.Module, x: torch.Tensor, t: torch.Tensor):
    """ĝ = mean of per-example gradients, ĥ = mean of their squares (torch.func reference)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_example = vmap(
        grad(lambda p, xi, ti: F.cross_entropy(functional_call(model, p, (xi[None],)), ti[None])), in_dims=(None, 0, 0)
    )(params, x, t)
    return {k: v.mean(0) for k, v in per_example.items()}, {k: v.square().mean(0) for k, v in per_example.items()}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_two_noise_free_steps_match_the_update_by_hand(momentum: float, reduction: str) -> None:
    model, x, t = _classifier_data()
    lr, n_eff, prior_var, tau, damping, beta2, s0 = 0.1, 100 * 2, 0.3, 0.5, 0.01, 0.3, 0.5
    opt = VOGN(
        model,
        lr=lr,
        dataset_size=100,
        augmentation_factor=2.0,
        prior_variance=prior_var,
        tau=tau,
        damping=damping,
        momentum=momentum,
        beta2=beta2,
        init_precision=s0,
        draws_per_step=1,
        kl_warmup_start=0.1,
        kl_warmup_steps=10,
        loss_reduction=reduction,
    )
    opt.sample_noise = False  # w = μ: σ forced to 0

    def closure():
        loss = F.cross_entropy(model(x), t, reduction=reduction)
        loss.backward()
        return loss

    mu = {k: v.detach().clone() for k, v in model.named_parameters()}
    s = {k: torch.full_like(v, s0) for k, v in mu.items()}
    m = {k: torch.zeros_like(v) for k, v in mu.items()}
    for step, tau_t in enumerate([tau * 0.1, tau * (0.1 + 0.9 * 1 / 10)]):  # linear KL warm-up
        assert opt.current_tau() == pytest.approx(tau_t)
        g_hat, h_hat = _stats_by_hand(model, x, t)
        delta_tilde = tau_t / (prior_var * n_eff)
        for k in mu:
            m[k] = momentum * m[k] + g_hat[k] + delta_tilde * mu[k]  # no (1 - β1)
            s[k] = beta2 * h_hat[k] + (1 - beta2) * s[k]  # β2 weighs the new ĥ
            mu[k] = mu[k] - lr * m[k] / (s[k] + delta_tilde + damping)
        opt.step(closure)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), mu[k], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(opt.state[p]["precision"], s[k], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(p.grad, g_hat[k], rtol=1e-12, atol=1e-12)
        assert opt.steps_taken == step + 1


def test_weight_noise_has_the_posterior_scale() -> None:
    """The draws inside step() and sample_weights() are N(μ, τ / (N_eff (s + δ̃ + γ)))."""
    model, x, t = _classifier_data()
    opt = VOGN(
        model,
        lr=0.0,
        dataset_size=50,
        augmentation_factor=2.0,
        prior_variance=0.5,
        tau=2.0,
        damping=0.1,
        init_precision=0.3,
        draws_per_step=1000,
        kl_warmup_start=0.1,
        kl_warmup_steps=4,
    )
    tau_t, delta_tilde = 0.2, 0.2 / (0.5 * 100)
    expected = (tau_t / (100 * (0.3 + delta_tilde + 0.1))) ** 0.5
    mu = [p.detach().clone() for p in model.parameters()]
    draws = []

    def closure():
        draws.append(torch.cat([(p.detach() - m).flatten() for p, m in zip(model.parameters(), mu)]))
        loss = F.cross_entropy(model(x), t, reduction="sum")
        loss.backward()
        return loss

    opt.step(closure)  # lr = 0: μ stays, only the draws matter
    for p, m in zip(model.parameters(), mu):
        assert torch.equal(p.detach(), m)
    z = torch.stack(draws) / expected
    assert abs(z.std().item() - 1) < 0.05 and z.mean(0).abs().max() < 0.15

    opt = VOGN(model, lr=0.1, dataset_size=50, prior_variance=0.5, tau=2.0, damping=0.1, init_precision=0.3)
    std = opt.posterior_std()
    expected = {k: (2.0 / (50 * (0.3 + 2.0 / (0.5 * 50) + 0.1))) ** 0.5 for k in std}
    draws = []
    for _ in range(1000):
        with opt.sample_weights():
            draws.append(
                torch.cat([((p.detach() - m) / std[k]).flatten() for (k, p), m in zip(model.named_parameters(), mu)])
            )
    for k, p in model.named_parameters():
        assert torch.allclose(std[k], torch.full_like(p, expected[k]))
    assert all(torch.equal(p.detach(), m) for p, m in zip(model.parameters(), mu))
    z = torch.stack(draws)
    assert abs(z.std().item() - 1) < 0.05 and z.mean(0).abs().max() < 0.15


def _small_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    )


def _make_opt(net: nn.Module) -> VOGN:
    return VOGN(
        net,
        lr=0.05,
        dataset_size=60,
        momentum=0.9,
        beta2=0.9,
        draws_per_step=2,
        kl_warmup_start=0.1,
        kl_warmup_steps=5,
        init_precision=0.1,
    )


def test_state_dict_round_trip_gives_the_identical_next_step() -> None:
    x, t = torch.randn(6, 2, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2])

    def closure_for(net):
        def closure():
            loss = F.cross_entropy(net(x), t, reduction="sum")
            loss.backward()
            return loss

        return closure

    net = _small_net(0)
    opt = _make_opt(net)
    for _ in range(3):
        opt.step(closure_for(net))
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    rng = torch.get_rng_state()
    for _ in range(2):
        opt.step(closure_for(net))
    uninterrupted = copy.deepcopy(net.state_dict())

    def resumed(load_optimizer: bool) -> dict:
        buffer.seek(0)
        saved = torch.load(buffer)
        net2 = _small_net(1)
        net2.load_state_dict(saved["model"])
        opt2 = _make_opt(net2)
        if load_optimizer:
            opt2.load_state_dict(saved["opt"])
            assert opt2.steps_taken == 3
        torch.set_rng_state(rng)
        for _ in range(2):
            opt2.step(closure_for(net2))
        return net2.state_dict()

    state = resumed(load_optimizer=True)
    assert all(torch.equal(state[k], uninterrupted[k]) for k in uninterrupted)
    state = resumed(load_optimizer=False)  # the test can tell: fresh s, m and step counter differ
    assert not torch.equal(state["4.weight"], uninterrupted["4.weight"])


def test_uncovered_parameters_and_repeated_layers_are_rejected() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"1\.weight.*1\.bias|1\.bias.*1\.weight"):
        VOGN(net, lr=0.1, dataset_size=10)
    VOGN(net, lr=0.1, dataset_size=10, params=[*net[0].parameters(), *net[2].parameters()])  # a subset is fine

    shared = nn.Linear(3, 3)
    opt = VOGN(shared, lr=0.1, dataset_size=10)
    x = torch.randn(4, 3)

    def closure():
        loss = shared(shared(x)).sum()
        loss.backward()
        return loss

    before = shared.weight.detach().clone()
    with pytest.raises(RuntimeError, match="once per forward"):
        opt.step(closure)
    assert torch.equal(shared.weight.detach(), before)  # μ restored after the failed step
