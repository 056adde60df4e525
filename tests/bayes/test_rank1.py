"""The rank-1 BNN's factor distributions (dbsn.bayes.rank1): the normal KL is the closed form and a
Monte Carlo estimate agrees with it; the Cauchy KL's one-draw estimate is unbiased, in value and
gradient, for the closed form, which a numerical integral confirms."""

from __future__ import annotations

import math

import pytest
import torch

from dbsn.bayes.rank1 import FactorDistribution, cauchy_log_prob


def _normal_kl(mu, sigma, mu_p, sigma_p):
    """KL(N(mu, sigma²) || N(mu_p, sigma_p²)) per element, written out."""
    return math.log(sigma_p / sigma) + (sigma**2 + (mu - mu_p) ** 2) / (2 * sigma_p**2) - 0.5


def _cauchy_kl(loc, scale, loc_p, scale_p):
    """KL between two Cauchy distributions (Chyzak & Nielsen 2019), per element."""
    return torch.log(((scale + scale_p) ** 2 + (loc - loc_p) ** 2) / (4 * scale * scale_p))


def test_the_normal_kl_is_the_closed_form_and_a_monte_carlo_estimate_agrees():
    prior = FactorDistribution("normal", prior_mean=1.0, prior_stddev=0.1)
    loc = torch.tensor([[1.0, -1.0, 0.9], [1.2, 0.0, 1.0]], dtype=torch.float64)
    scale = torch.tensor([[0.03, 0.05, 0.1], [0.2, 0.01, 0.1]], dtype=torch.float64)
    expected = sum(_normal_kl(m, s, 1.0, 0.1) for m, s in zip(loc.flatten().tolist(), scale.flatten().tolist()))
    kl = prior.kl(loc, scale)
    assert kl.dtype == torch.float64 and kl.item() == pytest.approx(expected, rel=1e-12)
    assert prior.kl(torch.ones(3), torch.full((3,), 0.1)).item() == pytest.approx(0.0, abs=1e-6)  # q = p
    # Monte Carlo: E_q[log q(z) - log p(z)] over 200,000 draws of every entry
    torch.manual_seed(0)
    z = prior.draw(loc.expand(200_000, -1, -1), scale.expand(200_000, -1, -1))
    q = torch.distributions.Normal(loc, scale)
    p = torch.distributions.Normal(1.0, 0.1)
    estimate = (q.log_prob(z) - p.log_prob(z)).mean(0).sum().item()
    assert estimate == pytest.approx(expected, rel=5e-3)


def test_the_cauchy_closed_form_is_the_numerical_integral():
    """∫ q log(q / p) over z = l + s tan(θ), θ in (-π/2, π/2): a bounded integrand, q dz = dθ / π."""
    loc, scale, loc_p, scale_p = 0.3, 0.2, 1.0, 0.1
    theta = torch.linspace(-math.pi / 2, math.pi / 2, 400_001, dtype=torch.float64)[1:-1]
    z = loc + scale * torch.tan(theta)
    integrand = (cauchy_log_prob(z, loc, scale) - cauchy_log_prob(z, loc_p, scale_p)) / math.pi
    integral = torch.trapezoid(integrand, theta).item()
    closed = _cauchy_kl(*(torch.tensor(v, dtype=torch.float64) for v in (loc, scale, loc_p, scale_p))).item()
    assert integral == pytest.approx(closed, rel=1e-5)
    assert cauchy_log_prob(torch.tensor(1.0), 1.0, 0.5).item() == pytest.approx(-math.log(math.pi * 0.5))


def test_the_cauchy_kl_is_one_unbiased_draw_in_value_and_gradient():
    """Each call draws afresh (edward2's `CauchyKLDivergence`): its mean over many calls, and the mean of its
    reparameterised gradients, are the closed form's."""
    prior = FactorDistribution("cauchy", prior_mean=1.0, prior_stddev=0.1)
    loc = torch.tensor([0.3, 1.0, -1.0, 1.1], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.2, 0.05, 0.03, 0.1], dtype=torch.float64, requires_grad=True)
    closed = _cauchy_kl(
        loc, scale, torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64)
    ).sum()
    closed_grads = torch.autograd.grad(closed, (loc, scale))
    torch.manual_seed(0)
    draws = 200_000
    batch_loc, batch_scale = loc.expand(draws, -1), scale.expand(draws, -1)
    estimates = prior.kl(batch_loc, batch_scale) / draws  # the mean of `draws` one-draw estimates
    grads = torch.autograd.grad(estimates, (loc, scale))
    assert estimates.item() == pytest.approx(closed.item(), rel=2e-3)
    for grad, reference in zip(grads, closed_grads):
        torch.testing.assert_close(grad, reference, rtol=2e-2, atol=0.1)
    assert prior.kl(loc, scale).item() != prior.kl(loc, scale).item()  # a new draw at every call


def test_draws_are_reparameterised_and_of_the_family():
    torch.manual_seed(0)
    loc = torch.full((100_000,), 1.0, requires_grad=True)
    scale = torch.full((100_000,), 0.5, requires_grad=True)
    normal = FactorDistribution("normal").draw(loc, scale)
    assert normal.std().item() == pytest.approx(0.5, rel=0.02)
    normal.sum().backward()
    assert torch.equal(loc.grad, torch.ones_like(loc))  # ∂(l + s·ε)/∂l = 1
    cauchy = FactorDistribution("cauchy").draw(loc, scale).detach()
    quartiles = torch.quantile(cauchy[:50_000], torch.tensor([0.25, 0.5, 0.75]))
    torch.testing.assert_close(quartiles, torch.tensor([0.5, 1.0, 1.5]), atol=0.02, rtol=0)  # l ± s at the quartiles
    with pytest.raises(ValueError, match="prior must be one of normal, cauchy, got 'laplace'"):
        FactorDistribution("laplace")
    with pytest.raises(ValueError, match="prior_stddev must be > 0"):
        FactorDistribution("normal", prior_stddev=0.0)
