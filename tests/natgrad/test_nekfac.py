"""NEK-FAC (Bae et al. 2018): eigenvalue correction, closed-form posterior of Bayesian linear
regression, weight-noise covariance, K-FAC at the reset and KL clipping, the conv position
factor T, and checkpoint resume (with BatchNorm, a bias-free and a depthwise conv).

Conventions checked here (see ``dbsn.natgrad.nekfac``): W̄ = [W, b] is (out, in+1); vec is
column-major, so vec(U_S X U_Aᵀ) = (U_A ⊗ U_S) vec(X) and ``torch.kron(U_A, U_S)`` is the
eigenbasis of vec(W̄); s*, Σ are (out, in+1) and enter vec as ``s.T.reshape(-1)``. The
optimizer keeps a leading group dim on every factor; ``state`` strips it (G = 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dbsn.natgrad.nekfac import NEKFAC, sampled_fisher_loss


def vec(m: torch.Tensor) -> torch.Tensor:
    """Column-major vec of an (out, in+1) matrix."""
    return m.T.reshape(-1)


def wbar(layer: nn.Linear) -> torch.Tensor:
    return torch.cat([layer.weight, layer.bias[:, None]], 1).detach().clone()


def state(opt: NEKFAC, layer: nn.Module) -> dict:
    """The layer's factors without the leading group dim (G = 1 here)."""
    return {k: v[0] for k, v in opt.layer_state(layer).items() if k != "momentum_buffer"}


def basis(opt: NEKFAC, layer: nn.Module) -> torch.Tensor:
    st = state(opt, layer)
    return torch.kron(st["U_A"], st["U_S"]).double()


# --------------------------------------------------------------------------- eigenvalue correction
def _factorial_problem(correlated: bool):
    """A Linear(3, 4) layer (W̄ is 4 x 4, so a transposed projection computes wrong numbers
    instead of failing on shapes) fed every pair (a_j, s_k) of 5 inputs and 6 output gradients.
    The fisher "loss" (out · s).sum() makes the captured output gradient exactly s_k. Over the
    full factorial design a and s are exactly independent, so E[(U_Sᵀ s āᵀ U_A)²] = λ_S ⊗ λ_A;
    ``correlated`` scales s by a function of a, which breaks the factorisation."""
    gen = torch.Generator().manual_seed(0)
    xa = torch.randn(5, 3, generator=gen)
    gs = torch.randn(6, 4, generator=gen) @ torch.randn(4, 4, generator=gen)
    x = xa.repeat_interleave(6, 0)
    g = gs.repeat(5, 1)
    if correlated:
        g = g * (1 + 3 * x[:, :1].square())
    layer = nn.Linear(3, 4)

    def closure():
        out = layer(x)
        return out.square().mean(), (out * g).sum()

    abar = torch.cat([x, torch.ones(len(x), 1)], 1)
    return layer, closure, abar, g


@pytest.mark.parametrize("correlated", [False, True])
def test_eigenvalue_correction(correlated):
    torch.manual_seed(0)
    layer, closure, abar, g = _factorial_problem(correlated)
    opt = NEKFAC(layer, dataset_size=30, cov_update_every=1, eigen_update_every=10, kl_clip=None)
    opt.step(closure)  # step 0: factors, eigendecomposition, s* reset
    st = state(opt, layer)
    # the factors are the design's second moments (batch means) and eigh reproduces them
    torch.testing.assert_close(st["A"], abar.T @ abar / len(abar))
    torch.testing.assert_close(st["S"], g.T @ g / len(g))
    torch.testing.assert_close(st["U_A"] @ torch.diag(st["lam_A"]) @ st["U_A"].T, st["A"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st["U_S"] @ torch.diag(st["lam_S"]) @ st["U_S"].T, st["S"], atol=1e-5, rtol=1e-5)
    # right after an eigendecomposition s* is exactly the outer product of the eigenvalues
    kron_diag = st["lam_S"][:, None] * st["lam_A"][None, :]
    assert torch.equal(st["s_star"], kron_diag)

    # the per-example target E_i[(U_Sᵀ g_i ā_iᵀ U_A)²], computed independently here
    proj = torch.einsum("os,bo,bi,ia->bsa", st["U_S"], g, abar, st["U_A"])
    target = proj.square().mean(0)
    if correlated:
        assert (target - kron_diag).abs().max() > 0.1 * kron_diag.abs().max()  # the correction matters
    else:
        torch.testing.assert_close(target, kron_diag, rtol=1e-4, atol=1e-4 * float(kron_diag.max()))

    # EMA from a different start: s*_k = target + 0.99^k (s*_0 - target) (A, S and the basis stay fixed)
    start = torch.full_like(target, 3.0)
    opt.layer_state(layer)["s_star"] = start[None].clone()
    k = 7
    for _ in range(k):
        opt.step(closure)
    torch.testing.assert_close(state(opt, layer)["s_star"], target + 0.99**k * (start - target), rtol=1e-4, atol=1e-5)
    # the next scheduled eigendecomposition (step 10) resets s* to the outer product again
    for _ in range(10 - 1 - k):
        opt.step(closure)
    assert not torch.allclose(state(opt, layer)["s_star"], kron_diag, rtol=1e-3)
    opt.step(closure)
    st = state(opt, layer)
    assert torch.equal(st["s_star"], st["lam_S"][:, None] * st["lam_A"][None, :])


# --------------------------------------------------------------------------- Bayesian linear regression
def _regression(seed: int = 0, replicas: int = 64):
    """y = W̄ ā + e, e ~ N(0, diag(1/prec)) with anisotropic noise precision, N = 16, in = 3, out = 2.

    Per-example NLL ℓ_i = ½ (y_i − W̄ā_i)ᵀ diag(prec) (y_i − W̄ā_i). Its true Fisher is
    ā āᵀ ⊗ diag(prec): exactly Kronecker, A = ĀᵀĀ/N, S = diag(prec). With λ = 1 and the
    optimizer's objective (1/N)[Σ ℓ_i] + (1/N) KL, the exact posterior over vec(W̄) is
        precision P = ĀᵀĀ ⊗ diag(prec) + I/η,   mean m = P⁻¹ vec(diag(prec) Yᵀ Ā),
    and the optimizer's implied precision is (U_A ⊗ U_S) diag(vec(N s* + 1/η)) (U_A ⊗ U_S)ᵀ.
    Loss scaling: the closure's ``loss`` is the mean NLL (1/N) Σ ℓ_i, the optimizer adds
    (1/(N η)) M, so its fixed point (1/N)(∇Σ ℓ_i + M/η) = 0 is the posterior mean, and with
    damping 0 its preconditioner s* + 1/(N η) is P/N in the eigenbasis (lr 1: a Newton step).
    The closure repeats the data ``replicas`` times (the mean NLL is unchanged; the Fisher
    estimate gets replicas label samples per example, i.e. less Monte Carlo noise).
    """
    gen = torch.Generator().manual_seed(seed)
    n, d, out, eta = 16, 3, 2, 1.0
    prec = torch.tensor([4.0, 0.25])
    x = torch.randn(n, d, generator=gen)
    abar = torch.cat([x, torch.ones(n, 1)], 1)
    w_true = 2 * torch.randn(out, d + 1, generator=gen)
    y = abar @ w_true.T + torch.randn(n, out, generator=gen) / prec.sqrt()

    a64, y64, p64 = abar.double(), y.double(), prec.double()
    precision = torch.kron(a64.T @ a64, torch.diag(p64)) + torch.eye((d + 1) * out, dtype=torch.float64) / eta
    mean = torch.linalg.solve(precision, vec(torch.diag(p64) @ y64.T @ a64))
    mle = torch.linalg.solve(
        precision - torch.eye(len(precision), dtype=torch.float64) / eta, vec(torch.diag(p64) @ y64.T @ a64)
    )

    layer = nn.Linear(d, out)
    xr, yr = x.repeat(replicas, 1), y.repeat(replicas, 1)

    def closure():
        pred = layer(xr)
        loss = 0.5 * ((yr - pred).square() * prec).sum(1).mean()
        y_sampled = pred.detach() + torch.randn_like(pred) / prec.sqrt()
        return loss, 0.5 * ((y_sampled - pred).square() * prec).sum()

    return layer, closure, n, eta, precision, mean, mle


def _whiten(precision: torch.Tensor) -> torch.Tensor:
    lam, u = torch.linalg.eigh(precision)
    return u @ torch.diag(lam.sqrt()) @ u.T  # P^{1/2}


def test_linear_regression_closed_form():
    torch.manual_seed(0)
    layer, closure, n, eta, precision, mean, mle = _regression()
    opt = NEKFAC(
        layer,
        dataset_size=n,
        lr=1.0,
        kl_weight=1.0,
        prior_var=eta,
        damping=0.0,
        kl_clip=None,
        momentum=0.0,
        cov_update_every=1,
        eigen_update_every=50,
    )
    for _ in range(100):  # lr 1: a (noisy) Newton step onto the posterior mean
        opt.step(closure)
    opt.param_groups[0]["lr"] = 0.05
    avg, k = torch.zeros_like(mean), 600
    for _ in range(k):
        opt.step(closure)
        avg += vec(wbar(layer)).double() / k

    # mean, in posterior standard deviations (whitened): the average of k iterates has std ~ 1/sqrt(k)
    root = _whiten(precision)
    err = (root @ (avg - mean)).abs().max()
    assert err < 0.2, err
    assert (root @ (mle - mean)).abs().max() > 1.0  # a missing prior term would fail the check above

    # precision: N s* + 1/η in the eigenbasis vs ĀᵀĀ ⊗ diag(prec) + I/η, compared after whitening
    u = basis(opt, layer)
    sigma = opt.noise_std(layer)[0].double()
    implied = u @ torch.diag(vec(sigma).pow(-2)) @ u.T
    st = state(opt, layer)
    torch.testing.assert_close(vec(sigma).pow(-2), n * vec(st["s_star"]).double() + 1 / eta, rtol=1e-5, atol=0)
    inv_root = torch.linalg.inv(root)
    rel = torch.linalg.eigvalsh(inv_root @ implied @ inv_root)
    assert (rel - 1).abs().max() < 0.03, rel
    no_prior = torch.linalg.eigvalsh(inv_root @ (implied - torch.eye(len(u), dtype=torch.float64) / eta) @ inv_root)
    assert (no_prior - 1).abs().max() > 0.15  # the prior term is resolvable at this tolerance


def test_noise_covariance():
    torch.manual_seed(1)
    layer, closure, n, eta, *_ = _regression(replicas=4)
    opt = NEKFAC(layer, dataset_size=n, kl_weight=0.5, prior_var=eta, cov_update_every=1, eigen_update_every=3)
    seen = []

    def recording_closure():
        seen.append(wbar(layer))
        return closure()

    for _ in range(5):
        before = wbar(layer)
        opt.step(recording_closure)
        assert torch.equal(seen[-1], before) == (opt.steps == 1)  # step 0 at the mean, later at a sample
    st = state(opt, layer)
    assert not torch.allclose(st["s_star"], st["lam_S"][:, None] * st["lam_A"][None, :])  # corrected, not reset

    mean = wbar(layer)
    draws = []
    for _ in range(4000):
        with opt.sample_weights():
            draws.append(wbar(layer) - mean)
    assert torch.equal(wbar(layer), mean)  # the mean is restored exactly
    d = torch.stack(draws).double()
    proj = st["U_S"].T.double() @ d @ st["U_A"].double()  # back to ε ⊙ Σ
    sigma = opt.noise_std(layer)[0].double()
    torch.testing.assert_close(proj.var(0), sigma.square(), rtol=0.1, atol=0)
    z = (proj / sigma).flatten(1)
    corr = z.T @ z / len(z)
    assert (corr - torch.eye(corr.shape[0], dtype=torch.float64)).abs().max() < 0.1
    # the posterior std itself: Σ² = (λ/N) / (s* + λ/(N η))
    torch.testing.assert_close(sigma.square(), (0.5 / n) / (st["s_star"].double() + 0.5 / (n * eta)))


# --------------------------------------------------------------------------- step at the reset: damped K-FAC + KL clip
def _step0(clip: float | None):
    torch.manual_seed(2)
    layer, closure, n, *_ = _regression(replicas=2)
    w0 = wbar(layer)
    loss, _ = closure()
    gw, gb = torch.autograd.grad(loss, [layer.weight, layer.bias])
    opt = NEKFAC(layer, dataset_size=n, lr=0.1, damping=1e-2, kl_clip=clip, momentum=0.9)
    opt.step(closure)  # step 0 runs at the mean: same gradient as above
    grad = torch.cat([gw, gb[:, None]], 1) + opt.prior_precision * w0
    return opt, layer, w0, grad


def test_step0_damped_kfac_and_kl_clip():
    opt, layer, w0, grad = _step0(None)
    st = state(opt, layer)
    v = (w0 - wbar(layer)) / 0.1  # first step: momentum buffer = update
    # at the reset s* = λ_S ⊗ λ_A, so the preconditioner is A ⊗ S + c I: S V A + c V = G
    c = opt.prior_precision + 1e-2
    torch.testing.assert_close(st["S"] @ v @ st["A"] + c * v, grad, rtol=1e-4, atol=1e-5)
    vg = float((v * grad).sum())
    assert 0.1**2 * vg > 1e-6  # so a clip of 1e-6 is active below

    opt, layer, w0, grad = _step0(1e-6)
    v_clipped = (w0 - wbar(layer)) / 0.1
    # the update is scaled by ν so that the quadratic KL estimate lr² (ν V)ᵀ F̃ (ν V) = lr² ν² Vᵀ G = κ
    nu = float((v_clipped * grad).sum()) / vg
    torch.testing.assert_close(0.1**2 * nu**2 * vg, 1e-6, rtol=1e-4, atol=0)
    torch.testing.assert_close(v_clipped, nu * v, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------- classification plumbing + resume
def test_sampled_fisher_loss_gradient_covariance():
    torch.manual_seed(3)
    logits = torch.tensor([[1.0, -0.5, 0.3]]).repeat(20000, 1).requires_grad_()
    (g,) = torch.autograd.grad(sampled_fisher_loss(logits), logits)
    p = logits[0].softmax(-1).detach()
    torch.testing.assert_close(g.T @ g / len(g), torch.diag(p) - torch.outer(p, p), atol=0.01, rtol=0)
    dense = torch.randn(2, 3, 4, 5, requires_grad=True)  # segmentation-shaped logits
    assert sampled_fisher_loss(dense).shape == ()


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Conv2d(3, 3, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(3, 3, 3, padding=1, groups=3, bias=False),  # depthwise: 3 blocks of W̄ (1, 9)
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 4),
    )


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 2, 5, 5, generator=gen), torch.randint(0, 4, (8,), generator=gen)

        def closure():
            logits = model(x)
            return F.cross_entropy(logits, y), sampled_fisher_loss(logits)

        opt.step(closure)


def test_state_dict_resume_matches_uninterrupted():
    kwargs = dict(dataset_size=100, cov_update_every=2, eigen_update_every=4)
    torch.manual_seed(4)
    model = _cnn()
    opt = NEKFAC(model, **kwargs)
    assert len(opt.layers) == 4
    _train(model, opt, 7, seed=0)
    assert opt.layer_state(model[5])["s_star"].shape == (3, 1, 9)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert opt_sd["nekfac_steps"] == 7
    _train(model, opt, 6, seed=1)  # crosses statistics (8, 10, 12) and eigen (8, 12) steps
    expected = copy.deepcopy(model.state_dict())

    torch.manual_seed(5)
    model2 = _cnn()
    opt2 = NEKFAC(model2, **kwargs)
    model2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    assert opt2.steps == 7
    _train(model2, opt2, 6, seed=1)
    for key, value in expected.items():
        torch.testing.assert_close(model2.state_dict()[key], value, rtol=0, atol=0, msg=key)
    # without the optimizer state the continuation differs
    model3 = _cnn()
    model3.load_state_dict(model_sd)
    _train(model3, NEKFAC(model3, **kwargs), 6, seed=1)
    assert not torch.equal(model3[0].weight, expected["0.weight"])
    for m in (model, model2, model3):
        assert all(torch.isfinite(p).all() for p in m.parameters())


def test_conv_positions_scale_s():
    """KFC: with output gradients independent across the T positions, E_i[(U_Sᵀ ∇W̄_i U_A)²]
    = T λ_S ⊗ λ_A for position-mean factors, so the reset s* must carry the factor T (= 16)."""
    torch.manual_seed(6)
    conv = nn.Conv2d(2, 3, 1)
    x = torch.randn(3000, 2, 4, 4) + 0.5
    g = torch.randn(3000, 3, 4, 4) * torch.tensor([1.0, 2.0, 0.5])[:, None, None]
    opt = NEKFAC(conv, dataset_size=3000)

    def closure():
        out = conv(x)
        return out.square().mean(), (out * g).sum()

    opt.step(closure)
    st = state(opt, conv)
    abar = torch.cat([x, torch.ones(3000, 1, 4, 4)], 1).flatten(2)  # (B, in+1, T)
    per_example = torch.einsum("bot,bit->boi", g.flatten(2), abar)
    target = (st["U_S"].T @ per_example @ st["U_A"]).square().mean(0)
    torch.testing.assert_close(st["s_star"], target, rtol=0.15, atol=0)
