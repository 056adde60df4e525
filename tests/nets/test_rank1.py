"""The rank-1 BNN's layers (dbsn.nets.rank1): BatchEnsemble's layers whose factors are drawn, a draw
per row from its component's posterior (or a held draw per member, the same for every example);
the authors' initialisation; draws clipped to [-10, 10]; every conv and linear transformed."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dbsn.bayes.rank1 import FactorDistribution
from dbsn.nets import VGG16BN
from dbsn.nets.batch_ensemble import BatchEnsembleLinear
from dbsn.nets.rank1 import Rank1Conv2d, Rank1Linear, draw_members, holding, rank1, rank1_layers, scale_parameters

NORMAL = FactorDistribution("normal", 1.0, 0.1)
SIGMA0 = math.sqrt(1e-3 / (1 - 1e-3))  # the authors' dropout_rate 1e-3


def test_the_factors_start_as_the_authors_do():
    """Locations: random signs, P(+1) = 0.5 (random_sign_init 0.5); raw scales: softplus⁻¹(σ₀) with a
    N(0, 0.1²) jitter truncated at ±0.2 for the normal family, the constant for the Cauchy."""
    torch.manual_seed(0)
    layer = Rank1Conv2d(nn.Conv2d(300, 400, 3), 4, NORMAL, 0.5, SIGMA0)
    assert set(layer.r.unique().tolist()) == {-1.0, 1.0} and (layer.s == 1).float().mean().item() == pytest.approx(
        0.5, abs=0.03
    )
    mean = math.log(math.expm1(SIGMA0))
    for rho in (layer.r_rho, layer.s_rho):
        assert rho.shape in ((4, 300), (4, 400)) and ((rho - mean).abs() <= 0.2).all()
        assert rho.mean().item() == pytest.approx(mean, abs=0.01) and rho.std().item() == pytest.approx(
            0.088, abs=0.005
        )
    assert F.softplus(torch.tensor(mean)).item() == pytest.approx(0.0316, abs=1e-4)
    cauchy = Rank1Linear(nn.Linear(30, 20), 4, FactorDistribution("cauchy"), -0.5, SIGMA0)
    assert torch.equal(cauchy.r_rho, torch.full((4, 30), mean)) and cauchy.bias.shape == (4, 20)
    assert cauchy.layer.bias is None and cauchy.r.std().item() == pytest.approx(0.5, abs=0.1)  # N(1, 0.5²) locations


def test_every_row_draws_its_own_factors_and_held_members_one_each():
    """Training and prediction: row r is component r mod M with a draw of its own, so one example's rows
    under one component differ; held members (`draw_members`, `holding`) give every example member k's
    one draw, whose mean over many members is its component's location."""
    torch.manual_seed(0)
    layer = Rank1Linear(nn.Linear(5, 3), 2, NORMAL, 0.5, 0.3)
    x = torch.randn(1, 5).expand(4, -1)  # one example, rows: components 0, 1, 0, 1
    y = layer(x)
    assert not torch.allclose(y[0], y[2]) and not torch.allclose(y[1], y[3])
    draws = draw_members(layer, 6)
    with holding(draws, slice(0, 2)):  # rows i·2 + k: members 0 and 1 for every example
        held = layer(x)
    torch.testing.assert_close(held[0], held[2])
    torch.testing.assert_close(held[1], held[3])
    r, s, bias = draws[layer]
    expected = F.linear(x[0] * r[0], layer.layer.weight) * s[0] + bias[0]
    torch.testing.assert_close(held[0], expected)
    assert layer.members is None  # fresh draws again after the block
    many = draw_members(layer, 20_000)[layer]
    torch.testing.assert_close(
        many[0][0::2].mean(0), layer.r[0].detach(), atol=0.01, rtol=0
    )  # member k: component k mod 2
    torch.testing.assert_close(many[0][1::2].std(0), layer.scales()[0][1].detach(), atol=0.01, rtol=0)


def test_draws_are_clipped_to_the_authors_range():
    torch.manual_seed(0)
    layer = Rank1Linear(nn.Linear(50, 40), 2, FactorDistribution("cauchy"), 0.5, 3.0)  # wide: many draws beyond 10
    r, s, _ = draw_members(layer, 500)[layer]
    assert r.abs().max().item() == 10.0 and s.abs().max().item() == 10.0


def test_scales_at_zero_give_the_batch_ensemble_layer_of_the_locations():
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    ensemble = BatchEnsembleLinear(copy.deepcopy(linear), 3, -0.5)
    layer = Rank1Linear(copy.deepcopy(linear), 3, NORMAL, 0.5, SIGMA0)
    layer.load_state_dict(ensemble.state_dict(), strict=False)
    with torch.no_grad():
        for rho in (layer.r_rho, layer.s_rho):
            rho.fill_(-math.inf)
    x = torch.randn(9, 6)
    torch.testing.assert_close(layer(x), ensemble(x), rtol=0, atol=0)


def test_every_conv_and_linear_becomes_a_rank1_layer():
    net = rank1(VGG16BN(num_classes=10, width=0.25), 2, NORMAL, 0.5, SIGMA0)
    layers = rank1_layers(net)
    assert len(layers) == 14 and {type(m) for m in layers} == {Rank1Conv2d, Rank1Linear}
    assert not any(type(m) in (nn.Conv2d, nn.Linear) for m in net.modules() if m not in {l.layer for l in layers})
    assert len(scale_parameters(net)) == 28
    assert net(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    with pytest.raises(ValueError, match="whole member groups"):
        net(torch.randn(3, 3, 32, 32))
    with pytest.raises(ValueError, match="no nn.Conv2d or nn.Linear"):
        rank1(nn.Sequential(nn.ReLU()), 2, NORMAL, 0.5, SIGMA0)
