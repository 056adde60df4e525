"""Tests of the sharpened concrete distribution (Eq. 4, 5), the prior, the KL and theta.

Reference densities here are written independently of dbsn.structure:
- the concrete density of Maddison et al. (2017) in numpy (for beta = 1 directly, and for
  any beta through (theta + beta g) / tau = (theta / beta + g) / (tau / beta));
- for K = 2, the density of alpha_1 = sigmoid((dtheta + beta L) / tau) with L = g_1 - g_2
  ~ Logistic(0, 1), derived by a change of variables.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate
from scipy.special import gammaln, log_softmax, logsumexp, softmax
from torch.distributions import Dirichlet, RelaxedOneHotCategorical

from dbsn.structure import SharpenedConcrete, StructureLogits, kl_estimate, uniform_prior
from tests.support.autocast import bf16_autocast

F64 = torch.float64


def concrete_log_density(a: np.ndarray, logits: np.ndarray, lam: float) -> np.ndarray:
    """Maddison et al. (2017), Concrete(pi = softmax(logits), lambda) on the simplex:
    log((K-1)!) + (K-1) log lam + sum log pi_k - (lam+1) sum log a_k - K log sum pi_k a_k^-lam.
    """
    k = a.shape[-1]
    log_pi = log_softmax(logits, axis=-1)
    log_a = np.log(a)
    return (
        gammaln(k)
        + (k - 1) * np.log(lam)
        + log_pi.sum(-1)
        - (lam + 1) * log_a.sum(-1)
        - k * logsumexp(log_pi - lam * log_a, axis=-1)
    )


def log_logistic_pdf(x):
    """log density of Logistic(0, 1): -x - 2 log(1 + e^-x), written symmetrically."""
    return -np.logaddexp(0.0, x) - np.logaddexp(0.0, -x)


def binary_log_density(a1, dtheta, beta, tau):
    """Density of alpha_1 for K = 2: x = logit(alpha_1) = (dtheta + beta L) / tau."""
    x = np.log(a1) - np.log1p(-a1)
    return np.log(tau / beta) + log_logistic_pdf((tau * x - dtheta) / beta) - np.log(a1) - np.log1p(-a1)


def numpy_sample(logits, beta, tau, n, rng):
    """Eq. 4 sampler written with numpy's Gumbel generator: (n, K) samples."""
    g = rng.gumbel(size=(n, len(logits)))
    return softmax((np.asarray(logits) + beta * g) / tau, axis=-1)


# --- Eq. 5 is a normalised density ------------------------------------------------------


@pytest.mark.parametrize(
    "logits, beta, tau, tol",
    [
        ([0.3, -0.2], 0.5, 1.0, 1e-7),
        ([1.0, -1.0], 0.7, 2.0, 1e-7),
        ([0.0, 0.0], 1.0, 3.0, 1e-7),
        ([2.0, 0.0], 0.3, 1.0, 1e-7),
        ([-0.5, 0.5], 1.0, 1.0, 1e-7),
        ([0.4, 0.0], 0.8, 3.0, 1e-7),
        # tau / beta < 1: the density has integrable singularities at both ends
        ([0.4, 0.0], 1.0, 0.5, 1e-5),
    ],
)
def test_log_prob_integrates_to_one_k2(logits, beta, tau, tol):
    dist = SharpenedConcrete(torch.tensor(logits, dtype=F64), beta, tau)

    def density(a):
        return math.exp(dist.log_prob(torch.tensor([a, 1.0 - a], dtype=F64)).item())

    total, _ = integrate.quad(density, 0.0, 1.0, limit=200)
    assert total == pytest.approx(1.0, abs=tol)


@pytest.mark.parametrize(
    "logits, beta, tau",
    [([0.5, -0.3, 0.0], 0.7, 2.0), ([1.0, 0.0, -0.5], 0.5, 1.0), ([0.0, 0.2, -0.2], 1.0, 1.0)],
)
def test_log_prob_matches_histogram_of_rsample_k3(logits, beta, tau):
    """Bin 400k samples on a 20 x 20 grid of (alpha_1, alpha_2) and compare each count in a
    well-populated bin fully inside the simplex with N * (density integrated over the bin,
    6 x 6 Gauss-Legendre). Counts are ~ Poisson(expected), so z = (obs - exp) / sqrt(exp) is
    ~ N(0, 1): we bound max |z| and the chi-square per bin."""
    torch.manual_seed(0)
    n, bins = 400_000, 20
    dist = SharpenedConcrete(torch.tensor(logits, dtype=F64), beta, tau)
    samples = dist.rsample((n,)).numpy()
    counts, _, _ = np.histogram2d(samples[:, 0], samples[:, 1], bins=bins, range=[[0, 1], [0, 1]])

    h = 1.0 / bins
    nodes, weights = np.polynomial.legendre.leggauss(6)
    offsets, w = (nodes + 1) * h / 2, weights * h / 2
    i, j = np.meshgrid(np.arange(bins), np.arange(bins), indexing="ij")
    inside = (i + j + 2) * h <= 1.0 + 1e-12
    i, j = i[inside], j[inside]
    a1 = i[:, None, None] * h + offsets[None, :, None]
    a2 = j[:, None, None] * h + offsets[None, None, :]
    a1, a2 = np.broadcast_arrays(a1, a2)
    points = torch.tensor(np.stack([a1, a2, 1.0 - a1 - a2], axis=-1), dtype=F64)
    density = dist.log_prob(points).exp().numpy()
    expected = n * np.einsum("bij,i,j->b", density, w, w)
    observed = counts[i, j]

    keep = expected > 500
    assert expected[keep].sum() > 0.5 * n, "the test should cover most of the mass"
    z = (observed[keep] - expected[keep]) / np.sqrt(expected[keep])
    assert np.abs(z).max() < 5.0
    assert np.mean(z**2) < 1.5


# --- Eq. 5 against independent formulas -------------------------------------------------


@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0, 3.0])
def test_beta_one_is_maddison_concrete(tau):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 4))
    points = rng.dirichlet(np.ones(4), size=(10, 3))
    ours = SharpenedConcrete(torch.tensor(logits), 1.0, tau).log_prob(torch.tensor(points))
    np.testing.assert_allclose(ours.numpy(), concrete_log_density(points, logits, tau), rtol=1e-10)
    # torch's RelaxedOneHotCategorical is the same density (its log_prob subtracts
    # sum_k log a_k, the Jacobian of exp, so no extra term is left between the two).
    relaxed = RelaxedOneHotCategorical(torch.tensor(tau, dtype=F64), logits=torch.tensor(logits))
    torch.testing.assert_close(ours, relaxed.log_prob(torch.tensor(points)), rtol=1e-10, atol=0)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.8, 1.5])
@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_sharpened_is_concrete_with_scaled_logits_and_temperature(beta, tau):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 4))
    points = rng.dirichlet(np.ones(4), size=(10, 3))
    ours = SharpenedConcrete(torch.tensor(logits), beta, tau).log_prob(torch.tensor(points))
    reference = concrete_log_density(points, logits / beta, tau / beta)
    np.testing.assert_allclose(ours.numpy(), reference, rtol=1e-10)


@pytest.mark.parametrize("beta, tau", [(0.5, 1.0), (1.0, 3.0), (0.3, 2.0), (1.0, 0.5)])
def test_k2_matches_logistic_change_of_variables(beta, tau):
    logits = torch.tensor([0.7, -0.6], dtype=F64)
    a1 = np.linspace(0.01, 0.99, 25)
    ours = SharpenedConcrete(logits, beta, tau).log_prob(torch.tensor(np.stack([a1, 1 - a1], -1)))
    reference = binary_log_density(a1, 1.3, beta, tau)
    np.testing.assert_allclose(ours.numpy(), reference, rtol=1e-10)


def test_per_edge_beta_broadcasts():
    logits = torch.randn(5, 4, dtype=F64)
    beta = torch.tensor([0.3, 0.5, 0.7, 1.0, 1.2], dtype=F64)
    dist = SharpenedConcrete(logits, beta, 2.0)
    assert dist.batch_shape == (5,) and dist.event_shape == (4,)
    alpha = dist.rsample((3,))
    assert alpha.shape == (3, 5, 4)
    log_q = dist.log_prob(alpha)
    assert log_q.shape == (3, 5)
    for e in range(5):
        single = SharpenedConcrete(logits[e], beta[e].item(), 2.0).log_prob(alpha[:, e])
        torch.testing.assert_close(log_q[:, e], single)


def test_probs_is_softmax_of_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    expected = np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum()
    np.testing.assert_allclose(SharpenedConcrete(logits).probs[0].numpy(), expected)


def test_invalid_arguments_raise():
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError):
        SharpenedConcrete(logits, beta=1.0, tau=0.0)
    with pytest.raises(ValueError):
        SharpenedConcrete(logits, beta=-0.5, tau=1.0)
    with pytest.raises(ValueError):
        SharpenedConcrete(logits, beta=torch.tensor([1.0, 0.0, 1.0]), tau=1.0)
    with pytest.raises(ValueError):
        SharpenedConcrete(torch.tensor(1.0))
    dist = SharpenedConcrete(logits, validate_args=True)
    with pytest.raises(ValueError):
        dist.log_prob(torch.full((3, 4), 0.5))  # not on the simplex


# --- Eq. 4 sampling ----------------------------------------------------------------------


def test_rsample_gradients_reach_logits():
    logits = torch.randn(3, 4, dtype=F64, requires_grad=True)
    alpha = SharpenedConcrete(logits, 0.7, 1.5).rsample((8,))
    (alpha * torch.randn_like(alpha)).sum().backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0

    def sample_with_fixed_noise(theta):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return SharpenedConcrete(theta, 0.7, 1.5).rsample((5,))

    assert torch.autograd.gradcheck(sample_with_fixed_noise, (logits.detach().requires_grad_(),))


def test_small_beta_concentrates_on_softmax_of_logits_over_tau():
    torch.manual_seed(0)
    logits, tau = torch.tensor([1.0, 0.2, -0.5, 0.0], dtype=F64), 1.5
    target = np.exp(logits.numpy() / tau) / np.exp(logits.numpy() / tau).sum()
    spreads = []
    for beta in [1.0, 0.5, 0.2, 0.05, 0.005]:
        alpha = SharpenedConcrete(logits, beta, tau).rsample((20_000,)).numpy()
        spreads.append(((alpha - target) ** 2).sum(-1).mean())
    assert all(a > b for a, b in zip(spreads, spreads[1:]))
    assert spreads[-1] < 1e-4
    np.testing.assert_allclose(alpha.mean(0), target, atol=1e-3)


def test_float32_underflow_gives_finite_log_prob_and_gradients():
    logits = torch.tensor([[60.0, -60.0, 0.0, 0.0]], requires_grad=True)
    dist = SharpenedConcrete(logits, 0.5, 1.0)
    alpha = dist.rsample((16,))
    assert (alpha == 0).any(), "the test needs a weight that underflows to exactly 0"
    kl = kl_estimate(alpha, dist, uniform_prior(1, 4, 1.0))
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logits.grad).all()


# --- KL(q || p) ---------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [1.0, 2.7])
def test_kl_is_zero_when_posterior_is_the_prior(tau):
    alpha = Dirichlet(torch.ones(5, 4, dtype=F64)).sample((7,))
    posterior = SharpenedConcrete(torch.zeros(5, 4, dtype=F64), 1.0, tau)
    kl = kl_estimate(alpha, posterior, uniform_prior(5, 4, tau, dtype=F64))
    assert kl.shape == (7,)
    assert torch.equal(kl, torch.zeros(7, dtype=F64))

    model = StructureLogits(5, 4).double()
    with torch.no_grad():
        model.theta.zero_()
    assert torch.equal(model.kl(alpha, 1.0, tau), torch.zeros(7, dtype=F64))


def binary_kl_by_quadrature(dtheta, beta, tau):
    """KL(q || p) for K = 2 by quadrature over L ~ Logistic(0, 1), where
    x = logit(alpha_1) = (dtheta + beta L) / tau under q and x = L' / tau under the prior.
    The log-density ratio is the same in x and in alpha_1 (the Jacobian cancels)."""

    def integrand(l):
        x = (dtheta + beta * l) / tau
        log_q = np.log(tau / beta) + log_logistic_pdf(l)
        log_p = np.log(tau) + log_logistic_pdf(tau * x)
        return np.exp(log_logistic_pdf(l)) * (log_q - log_p)

    value, _ = integrate.quad(integrand, -np.inf, np.inf, limit=200)
    return value


@pytest.mark.parametrize("tau", [1.0, 2.0, 3.0])
def test_kl_estimate_matches_quadrature_k2(tau):
    torch.manual_seed(0)
    logits = torch.tensor([[0.8, -0.4], [0.0, 0.0], [-1.5, 0.5]], dtype=F64)
    beta = torch.tensor([0.5, 0.8, 1.0], dtype=F64)
    reference = sum(
        binary_kl_by_quadrature((logits[e, 0] - logits[e, 1]).item(), beta[e].item(), tau) for e in range(3)
    )
    posterior = SharpenedConcrete(logits, beta, tau)
    alpha = posterior.rsample((200_000,))
    kl = kl_estimate(alpha, posterior, uniform_prior(3, 2, tau, dtype=F64)).numpy()
    stderr = kl.std() / np.sqrt(len(kl))
    assert reference > 0 and kl.mean() > 0
    assert abs(kl.mean() - reference) < 5 * stderr + 1e-6


def test_kl_estimate_matches_monte_carlo_reference_k3():
    logits = np.array([[1.0, -0.5, 0.2], [0.0, 0.3, -0.3]])
    betas, tau = [0.6, 0.9], 1.5
    rng = np.random.default_rng(3)
    per_edge = []
    for theta, beta in zip(logits, betas):
        a = numpy_sample(theta, beta, tau, 1_000_000, rng)
        log_q = concrete_log_density(a, theta / beta, tau / beta)
        log_p = concrete_log_density(a, np.zeros(3), tau)
        per_edge.append(log_q - log_p)
    reference = np.sum(per_edge, axis=0)

    torch.manual_seed(0)
    posterior = SharpenedConcrete(torch.tensor(logits), torch.tensor(betas), tau)
    kl = kl_estimate(posterior.rsample((200_000,)), posterior, uniform_prior(2, 3, tau, dtype=F64))
    kl = kl.numpy()
    stderr = np.hypot(reference.std() / np.sqrt(len(reference)), kl.std() / np.sqrt(len(kl)))
    assert reference.mean() > 0 and kl.mean() > 0
    assert abs(kl.mean() - reference.mean()) < 5 * stderr


# --- StructureLogits ---------------------------------------------------------------------


def test_structure_logits_shapes_and_init():
    torch.manual_seed(0)
    model = StructureLogits(21, 4)
    assert isinstance(model.theta, torch.nn.Parameter) and model.theta.shape == (21, 4)
    assert 5e-4 < model.theta.std().item() < 1.5e-3
    assert model.theta.abs().max().item() < 1e-2
    assert torch.equal(StructureLogits(3, 2, init_std=0.0).theta, torch.zeros(3, 2))

    alpha = model.sample(6, beta=0.7, tau=3.0)
    assert alpha.shape == (6, 21, 4)
    assert (alpha >= 0).all()
    torch.testing.assert_close(alpha.sum(-1), torch.ones(6, 21))
    assert model.probs().shape == (21, 4)
    torch.testing.assert_close(model.probs().sum(-1), torch.ones(21))

    kl = model.kl(alpha, beta=0.7, tau=3.0)
    assert kl.shape == (6,)
    kl.mean().backward()
    assert model.theta.grad is not None and model.theta.grad.abs().sum() > 0

    posterior, prior = model.posterior(0.7, 3.0), model.prior(3.0)
    assert posterior.batch_shape == prior.batch_shape == (21,)
    assert torch.equal(prior.logits, torch.zeros(21, 4))


def test_structure_logits_most_likely_and_probs():
    model = StructureLogits(3, 4)
    with torch.no_grad():
        model.theta.copy_(torch.tensor([[0, 2.0, 1, 0], [3.0, 0, 0, 0], [0, 0, 0, 1.0]]))
    assert model.most_likely().tolist() == [1, 0, 3]
    expected = np.exp([3.0, 0, 0, 0]) / np.exp([3.0, 0, 0, 0]).sum()
    np.testing.assert_allclose(model.probs()[1].detach().numpy(), expected, rtol=1e-6)


def test_structure_logits_rejects_bad_sizes():
    with pytest.raises(ValueError):
        StructureLogits(0, 4)
    with pytest.raises(ValueError):
        StructureLogits(3, 4, init_std=-1.0)


# ---------------------------------------------------------------------- mixed precision
# The structure distribution's density and KL are float32 islands (dbsn.precision).


def test_structure_density_and_kl_are_float32_under_autocast():
    torch.manual_seed(0)
    structure = StructureLogits(14, 4, init_std=1.0)  # θ spread about 1: far from the uniform prior
    beta, tau = torch.tensor(0.7), 2.3
    torch.manual_seed(1)
    alpha = structure.sample(6, beta, tau)
    reference = structure.kl(alpha, beta, tau)
    log_q = structure.posterior(beta, tau).log_prob(alpha)
    with bf16_autocast():
        torch.manual_seed(1)
        alpha_mixed = structure.sample(6, beta, tau)
        kl_mixed = structure.kl(alpha_mixed, beta, tau)
        log_q_mixed = structure.posterior(beta, tau).log_prob(alpha_mixed)
    assert alpha_mixed.dtype == kl_mixed.dtype == log_q_mixed.dtype == torch.float32
    assert torch.equal(alpha_mixed, alpha)  # the same Gumbel noise and softmax
    torch.testing.assert_close(kl_mixed, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_q_mixed, log_q, rtol=1e-6, atol=1e-6)
    assert reference.abs().min() > 1.0  # a KL that matters: θ is far from the prior


def test_structure_in_float32_even_from_16_bit_logits():
    """bf16-true would hand the distribution 16-bit θ (it is refused at config time); the
    density is still computed in float32 from them."""
    torch.manual_seed(0)
    logits = torch.randn(5, 4).bfloat16()
    structure = StructureLogits(5, 4)
    structure.theta.data = logits.float()
    alpha = structure.sample(3, 0.8, 1.5)
    from dbsn.structure import SharpenedConcrete

    low = SharpenedConcrete(logits, 0.8, 1.5).log_prob(alpha)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, structure.posterior(0.8, 1.5).log_prob(alpha), rtol=1e-6, atol=1e-6)
