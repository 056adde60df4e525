"""cSGHMC and cSGLD as an optimiser (dbsn.sampling.CyclicalSGMCMC): they sample known posteriors (a
2-D Gaussian, Bayesian linear regression) to within Monte Carlo error; at temperature 0 they are
SGD with momentum on the cyclical step size; the noise has the authors' scale and is on only in the
sampling stage; a chain resumed from its state dict continues exactly."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from dbsn.sampling import CyclicalSampler, CyclicalSchedule, CyclicalSGMCMC

A = np.array([[2.0, 0.6], [0.6, 1.0]])  # the energy U(x) = ½ xᵀ A x: the posterior N(0, T A⁻¹)


def _chains(x0, n: int) -> torch.nn.Parameter:
    """n independent chains of a d-dimensional target, one row each (one optimiser moves them all)."""
    return torch.nn.Parameter(torch.as_tensor(x0, dtype=torch.float64).repeat(n, 1))


def _standard_errors(cov: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo standard errors of the mean and of the covariance's entries from n independent
    Gaussian draws: √(Σ_ii / n) and √((Σ_ii Σ_jj + Σ_ij²) / n)."""
    diag = np.diag(cov)
    return np.sqrt(diag / n), np.sqrt((np.outer(diag, diag) + cov**2) / n)


def _exact_moments(
    x0,
    grad: np.ndarray,
    b: np.ndarray,
    dataset_size: int,
    lr: float,
    friction: float,
    temperature: float,
    grad_noise: float,
    schedule: CyclicalSchedule,
    total: int,
):
    """Mean and covariance of the position at every kept step, by the linear recursion that the update
    (v ← (1 − a) v − α_k (G x − b + σ_g ξ) + √(2 α_k a T / N) ε, x ← x + v) is on a Gaussian target:
    the chain's exact law, discretisation included."""
    d = len(x0)
    eye = np.eye(d)
    mean, cov = np.concatenate([x0, np.zeros(d)]), np.zeros((2 * d, 2 * d))
    kept = []
    for k in range(total):
        step = lr * schedule.lr_factor(k, total)
        noise = 2 * step * friction * temperature / dataset_size if schedule.sampling(k, total) else 0.0
        noise += (step * grad_noise) ** 2
        transition = np.block([[eye - step * grad, (1 - friction) * eye], [-step * grad, (1 - friction) * eye]])
        mean = transition @ mean + np.concatenate([step * b, step * b])
        cov = transition @ cov @ transition.T + noise * np.block([[eye, eye], [eye, eye]])
        if schedule.keeps(k, total):
            kept.append((mean[:d], cov[:d, :d]))
    return np.mean([m for m, _ in kept], 0), np.mean([c for _, c in kept], 0)


def _sample(
    x0,
    grad: np.ndarray,
    b: np.ndarray,
    dataset_size: int,
    lr: float,
    friction: float,
    temperature: float,
    grad_noise: float,
    schedule: CyclicalSchedule,
    total: int,
    chains: int,
    weight_decay: float = 0.0,
):
    """The kept samples of `chains` chains on the mean loss ½ xᵀ G x − bᵀ x (+ weight decay), with
    Gaussian noise of std `grad_noise` on every gradient entry."""
    x = _chains(x0, chains)
    opt = CyclicalSGMCMC(
        [x],
        lr=lr,
        schedule=schedule,
        total_steps=total,
        dataset_size=dataset_size,
        friction=friction,
        weight_decay=weight_decay,
        temperature=temperature,
        seed=1,
    )
    g, grad, b = torch.Generator().manual_seed(2), torch.as_tensor(grad), torch.as_tensor(b)
    kept = []
    for _ in range(total):
        x.grad = x.detach() @ grad - b
        if grad_noise:
            x.grad += grad_noise * torch.randn(x.shape, generator=g, dtype=x.dtype)
        opt.step()
        if opt.keeps():
            kept.append(x.detach().clone())
    return torch.cat(kept).numpy()


@pytest.mark.parametrize(
    "friction, temperature, grad_noise",
    [
        (1.0, 1.0, 0.0),  # cSGLD on the posterior
        (0.9, 1.0, 0.0),  # cSGHMC
        (0.9, 1.0, 0.1),  # cSGHMC with noisy gradients
        (0.9, 0.25, 0.0),  # cSGHMC on a cold posterior
    ],
)
def test_the_samples_have_the_gaussian_posteriors_moments(friction, temperature, grad_noise):
    """U(x) = ½ xᵀ A x over N = 10 "examples": the loss is the mean U / N, its gradient A x / N, and the
    kept samples are N(0, T A⁻¹) within Monte Carlo error: their mean and covariance against the
    closed form, within 4 standard errors; and against the chain's exact law at those steps (the
    recursion), whose discretisation bias is under one standard error. 4,000 chains, 2 cycles with
    noise in their second half, one sample at the end of each: 8,000 independent draws."""
    dataset_size, chains, schedule = 10, 4000, CyclicalSchedule(cycles=2, exploration=0.5, samples_per_cycle=1)
    total, lr, x0, b = 2 * 550, 1.0, np.array([3.0, -2.0]), np.zeros(2)
    posterior = temperature * np.linalg.inv(A)
    samples = _sample(
        x0, A / dataset_size, b, dataset_size, lr, friction, temperature, grad_noise, schedule, total, chains
    )
    n = samples.shape[0]
    se_mean, se_cov = _standard_errors(posterior, n)
    exact_mean, exact_cov = _exact_moments(
        x0, A / dataset_size, b, dataset_size, lr, friction, temperature, grad_noise, schedule, total
    )
    assert np.all(np.abs(exact_cov - posterior) < se_cov) and np.all(np.abs(exact_mean) < se_mean)  # the set-up is fair
    assert np.all(np.abs(samples.mean(0)) < 4 * se_mean), samples.mean(0) / se_mean
    assert np.all(np.abs(np.cov(samples.T) - posterior) < 4 * se_cov), (np.cov(samples.T) - posterior) / se_cov
    assert np.all(np.abs(np.cov(samples.T) - exact_cov) < 4 * se_cov)


def test_the_samples_have_the_bayesian_linear_regressions_posterior():
    """y = Xw + ε, ε ~ N(0, σ²), w ~ N(0, 1/λ): the loss is the mean NLL over the N = 100 examples,
    ½ (xᵀw − y)² / σ², and the prior is weight decay λ / N; the kept samples have the closed-form
    posterior N(P⁻¹ Xᵀy / σ², P⁻¹), P = XᵀX / σ² + λ I, within 4 standard errors (full-batch
    gradients, from the data's sufficient statistics)."""
    g = torch.Generator().manual_seed(0)
    n_data, sigma, prior = 100, 0.5, 1.0
    X = torch.randn(n_data, 2, generator=g, dtype=torch.float64).numpy()
    y = X @ np.array([1.0, -0.5]) + sigma * torch.randn(n_data, generator=g, dtype=torch.float64).numpy()
    precision = X.T @ X / sigma**2 + prior * np.eye(2)
    cov = np.linalg.inv(precision)
    mean = cov @ X.T @ y / sigma**2
    schedule = CyclicalSchedule(cycles=2, exploration=0.5, samples_per_cycle=1)
    samples = _sample(
        np.zeros(2),
        X.T @ X / (n_data * sigma**2),
        X.T @ y / (n_data * sigma**2),
        n_data,
        0.02,
        0.9,
        1.0,
        0.0,
        schedule,
        2 * 600,
        4000,
        weight_decay=prior / n_data,
    )
    se_mean, se_cov = _standard_errors(cov, samples.shape[0])
    assert np.all(np.abs(samples.mean(0) - mean) < 4 * se_mean), (samples.mean(0) - mean) / se_mean
    assert np.all(np.abs(np.cov(samples.T) - cov) < 4 * se_cov), (np.cov(samples.T) - cov) / se_cov


def _network_and_batches(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    batches = [(torch.randn(16, 5), torch.randint(0, 3, (16,))) for _ in range(4)]
    return net, batches


def _train(net, opt, batches, steps: int, before_step=None) -> None:
    for k in range(steps):
        x, y = batches[k % len(batches)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if before_step is not None:
            before_step(k)
        opt.step()


def test_at_temperature_zero_sgld_is_sgd_on_the_cyclical_step_size():
    """Friction 1, T = 0: torch.optim.SGD (no momentum, the same weight decay) with its lr set to
    α₀ (cos(π r) + 1) / 2 before every step, over two cycles."""
    schedule, total, lr, decay = CyclicalSchedule(cycles=2, exploration=0.5, samples_per_cycle=1), 24, 0.3, 5e-4
    net, batches = _network_and_batches()
    copy, _ = _network_and_batches()
    sampler = CyclicalSGMCMC(
        net.parameters(),
        lr=lr,
        schedule=schedule,
        total_steps=total,
        dataset_size=50,
        friction=1.0,
        weight_decay=decay,
        temperature=0.0,
    )
    sgd = torch.optim.SGD(copy.parameters(), lr=lr, momentum=0.0, weight_decay=decay)

    def set_lr(k):
        sgd.param_groups[0]["lr"] = lr * schedule.lr_factor(k, total)

    _train(net, sampler, batches, total)
    _train(copy, sgd, batches, total, set_lr)
    for p, q in zip(net.parameters(), copy.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_at_temperature_zero_sghmc_is_sgd_with_momentum_on_the_cyclical_step_size():
    """Friction a, T = 0: the authors' velocity v ← (1 − a) v − α_k d carries the step size inside it,
    so it is torch.optim.SGD with momentum 1 − a at lr 1 on the gradients α_k (g + λ w) (under a
    constant step size, SGD with momentum 1 − a and lr α₀ itself). Over two cycles, restarts included."""
    schedule, total, lr, decay, friction = (
        CyclicalSchedule(cycles=2, exploration=0.5, samples_per_cycle=1),
        24,
        0.3,
        5e-4,
        0.9,
    )
    net, batches = _network_and_batches()
    copy, _ = _network_and_batches()
    sampler = CyclicalSGMCMC(
        net.parameters(),
        lr=lr,
        schedule=schedule,
        total_steps=total,
        dataset_size=50,
        friction=friction,
        weight_decay=decay,
        temperature=0.0,
    )
    sgd = torch.optim.SGD(copy.parameters(), lr=1.0, momentum=1 - friction)

    def scale_gradients(k):
        step = lr * schedule.lr_factor(k, total)
        for p in copy.parameters():
            p.grad = step * (p.grad + decay * p.detach())

    _train(net, sampler, batches, total)
    _train(copy, sgd, batches, total, scale_gradients)
    for p, q in zip(net.parameters(), copy.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_noise_has_the_authors_scale_and_only_in_the_sampling_stage():
    """With no gradient and friction 1 a step moves each coordinate by √(2 α_k T / N) ε: the
    authors' `(2 lr alpha temperature / datasize) ** .5 * eps`, in the sampling stage only."""
    schedule, total, lr, n, temperature = (
        CyclicalSchedule(cycles=2, exploration=0.5, samples_per_cycle=1),
        40,
        0.4,
        1000,
        0.3,
    )
    x = torch.nn.Parameter(torch.zeros(200_000, dtype=torch.float64))
    opt = CyclicalSGMCMC(
        [x], lr=lr, schedule=schedule, total_steps=total, dataset_size=n, friction=1.0, temperature=temperature, seed=0
    )
    for k in range(total):
        before = x.detach().clone()
        x.grad = torch.zeros_like(x)
        expected = np.sqrt(2 * lr * schedule.lr_factor(k, total) * temperature / n) if k % 20 >= 10 else 0.0
        assert opt.noise_std(opt.param_groups[0]) == pytest.approx(expected, rel=1e-12)
        assert opt.param_groups[0]["lr"] == lr * schedule.lr_factor(k, total)  # what an lr monitor logs
        opt.step()
        moved = (x.detach() - before).std().item()
        assert moved == pytest.approx(expected, rel=0.01, abs=1e-12), k


def test_a_resumed_chain_continues_exactly():
    """60 steps at once equal 25 steps, a state dict through torch.save / torch.load(weights_only=True)
    (as Lightning resumes), a new optimiser (another seed) loading it, and 35 steps more: the same
    velocities, the same place in the cycle, the same noise."""
    schedule = CyclicalSchedule(cycles=3, exploration=0.3, samples_per_cycle=2, sample_spacing=0.1)

    def sampler(net, seed):
        return CyclicalSGMCMC(
            net.parameters(),
            lr=0.2,
            schedule=schedule,
            total_steps=60,
            dataset_size=20,
            friction=0.8,
            weight_decay=1e-3,
            temperature=1.0,
            seed=seed,
        )

    straight, batches = _network_and_batches()
    _train(straight, sampler(straight, 7), batches, 60)

    first, _ = _network_and_batches()
    opt = sampler(first, 7)
    _train(first, opt, batches, 25)
    buffer = io.BytesIO()
    torch.save({"net": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, _ = _network_and_batches(seed=1)
    resumed.load_state_dict(saved["net"])
    opt = sampler(resumed, 99)
    opt.load_state_dict(saved["opt"])
    assert opt.steps == 25
    _train(resumed, opt, batches[1:] + batches[:1], 35)  # step 25 takes batch 25 mod 4 = 1
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_the_settings_build_the_sampler_with_the_authors_temperature():
    settings = CyclicalSampler()
    assert (settings.lr, settings.friction, settings.weight_decay, settings.temperature) == (0.5, 0.9, 5e-4, None)
    opt = settings.build([torch.nn.Parameter(torch.zeros(3))], total_steps=400, dataset_size=50_000)
    assert opt.param_groups[0]["temperature"] == 1 / 50_000 and opt.total_steps == 400 and opt.dataset_size == 50_000
    assert CyclicalSampler(temperature=1.0).posterior_temperature(50_000) == 1.0
    for bad, message in (
        (dict(lr=0), "lr"),
        (dict(friction=1.5), "friction"),
        (dict(temperature=-1), "temperature"),
        (dict(weight_decay=-1), "weight_decay"),
    ):
        with pytest.raises(ValueError, match=message):
            CyclicalSampler(**bad)


@pytest.mark.parametrize("total, exploration", [(40, 0.5), (37, 0.9), (41, 0.0), (30, 1.0)])
def test_the_peak_noise_is_the_largest_of_every_step(total, exploration):
    """`peak_noise_std` (the first sampling step of each cycle) against the loop over every step's noise."""
    schedule = CyclicalSchedule(cycles=3, exploration=exploration, samples_per_cycle=1)
    opt = CyclicalSGMCMC(
        [torch.nn.Parameter(torch.zeros(2))],
        lr=0.4,
        schedule=schedule,
        total_steps=total,
        dataset_size=1000,
        friction=0.9,
        temperature=0.3,
    )
    group = opt.param_groups[0]
    assert opt.peak_noise_std() == max(opt.noise_std(group, k) for k in range(total))


def test_the_authors_temperature_leaves_about_3e_6_of_noise_a_step():
    """At T = 1/N on CIFAR (N = 50,000, α₀ 0.5, friction 0.9, noise in the last 10 % of 4 cycles of 50
    epochs at batch 64) the largest noise is √(2 α₀ (cos(0.9π) + 1) / 2 · 0.9 / N²) ≈ 3.0e-6 a step."""
    steps = 200 * (50_000 // 64)
    opt = CyclicalSampler().build([torch.nn.Parameter(torch.zeros(2))], total_steps=steps, dataset_size=50_000)
    expected = np.sqrt(2 * 0.5 * (np.cos(0.9 * np.pi) + 1) / 2 * 0.9 / 50_000**2)
    assert opt.peak_noise_std() == pytest.approx(expected, rel=1e-3) and 2.9e-6 < expected < 3.1e-6
