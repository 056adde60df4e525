"""Masksembles' masks (dbsn.nets.masksembles): the draw against closed forms (each mask's ones, the expected
pairwise intersection m²/N and union N(1 − (1 − m/N)ⁿ)), the authors' union size kept exactly, masks over exactly
c channels with the authors' number of ones, the overlap the scale sets against the authors' generation_wrapper
re-implemented here with numpy, the rows of a masked layer interleaved by member, and the layers the transform
masks (all but the stem)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from dbsn.nets import ResNet18, StructureNet
from dbsn.nets.masksembles import (
    MaskedConv2d,
    MaskedLinear,
    draw_masks,
    generate_masks,
    mask_overlap,
    masked_layers,
    masks_for_channels,
    masksembles,
    union_size,
)


def _pairwise(masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(intersection, IoU) of every pair of masks."""
    pairs = list(itertools.combinations(range(masks.shape[0]), 2))
    both = torch.stack([(masks[i] * masks[j]).sum() for i, j in pairs])
    either = torch.stack([((masks[i] + masks[j]) > 0).sum() for i, j in pairs]).double()
    return both, both / either


def test_draws_have_m_ones_and_the_hypergeometric_intersection_and_union():
    """n m-subsets of N = ⌊m·s⌋ positions drawn uniformly without replacement: two share m²/N positions in
    expectation, and n of them cover N(1 − (1 − m/N)ⁿ) (each position missed by each with probability 1 − m/N).
    Drawn with replacement, or from another N, both means move by many standard errors."""
    generator = torch.Generator().manual_seed(0)
    m, n, s, draws = 20, 4, 2.0, 3000
    N = int(m * s)
    intersections, unions = [], []
    for _ in range(draws):
        masks = draw_masks(m, n, s, generator)
        assert (masks.sum(1) == m).all() and masks.any(0).all()  # m ones each; unused positions dropped
        intersections.append(_pairwise(masks)[0].double().mean())
        unions.append(masks.shape[1])
    intersections, unions = torch.stack(intersections), torch.tensor(unions, dtype=torch.float64)
    for values, expected in ((intersections, m * m / N), (unions, N * (1 - (1 - m / N) ** n))):
        assert abs(values.mean().item() - expected) < 4 * values.std().item() / draws**0.5, (values.mean(), expected)


def test_generated_masks_keep_exactly_the_authors_union_size():
    generator = torch.Generator().manual_seed(1)
    for m, n, s in ((20, 4, 2.0), (34, 4, 2.03), (12, 3, 1.5), (8, 5, 3.0)):
        masks = generate_masks(m, n, s, generator)
        assert masks.shape == (n, union_size(m, n, s)) == (n, int(m * s * (1 - (1 - 1 / s) ** n)))
        assert (masks.sum(1) == m).all()


@pytest.mark.parametrize(
    "channels, n, scale", [(10, 4, 2.0), (64, 4, 2.0), (640, 4, 2.0), (96, 3, 1.5), (128, 4, 4.0), (33, 2, 6.0)]
)
def test_masks_cover_exactly_c_channels_with_the_authors_ones_per_mask(channels, n, scale):
    masks = masks_for_channels(channels, n, scale, torch.Generator().manual_seed(2))
    ones = int(channels / (scale * (1 - (1 - 1 / scale) ** n)))  # their inverse formula
    assert masks.shape == (n, channels) and set(masks.unique().tolist()) <= {0.0, 1.0}
    assert (masks.sum(1) == ones).all() and masks.any(0).all()  # every member keeps m; every channel is used


def test_scale_one_gives_masks_of_ones_and_the_authors_limits_are_refused():
    assert torch.equal(masks_for_channels(64, 4, 1.0), torch.ones(4, 64))
    with pytest.raises(ValueError, match="at least 10 channels"):
        masks_for_channels(9, 4, 2.0)
    with pytest.raises(ValueError, match=r"scale must be in \[1, 6\]"):
        masks_for_channels(64, 4, 6.5)
    with pytest.raises(ValueError, match=r"scale must be in \[1, 6\]"):
        masks_for_channels(64, 4, 0.9)


def _authors_generation_wrapper(c: int, n: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """nikitadurasov/masksembles masksembles/common.py, generation_wrapper with generate_masks and
    generate_masks_, re-implemented with numpy as written there: a draw at every step of the bisection."""

    def draw(m, s):
        total = int(m * s)
        masks = np.zeros((n, total))
        for row in masks:
            row[rng.choice(range(total), m, replace=False)] = 1
        return masks[:, ~np.all(masks == 0, axis=0)]

    def generate(m, s):
        masks = draw(m, s)
        while masks.shape[1] != int(m * s * (1 - (1 - 1 / s) ** n)):
            masks = draw(m, s)
        return masks

    active = int(int(c) / (scale * (1 - (1 - 1 / scale) ** n)))
    low, high = scale * 0.8, scale * 1.2
    for _ in range(1000):
        mid = (low + high) / 2
        masks = generate(active, mid)
        if masks.shape[-1] == c:
            return masks
        if masks.shape[-1] > c:
            high = mid
        else:
            low = mid
    raise AssertionError("their bisection failed")


@pytest.mark.parametrize("scale", [1.5, 2.0, 3.0])
def test_the_overlap_is_the_authors_and_about_one_over_two_s_minus_one(scale):
    """The mean IoU of a pair of masks over 150 mask sets of 64 channels, here and by the authors' code: the
    same within Monte Carlo error, and within 0.03 of 1/(2s − 1) (the bisection moves s a little)."""
    channels, n, sets = 64, 4, 150
    generator, rng = torch.Generator().manual_seed(3), np.random.default_rng(3)
    ours = torch.stack([_pairwise(masks_for_channels(channels, n, scale, generator))[1].mean() for _ in range(sets)])
    theirs = torch.stack(
        [
            _pairwise(torch.from_numpy(_authors_generation_wrapper(channels, n, scale, rng)))[1].mean()
            for _ in range(sets)
        ]
    )
    error = (ours.var() / sets + theirs.var() / sets).sqrt().item()
    assert abs(ours.mean().item() - theirs.mean().item()) < 4 * error
    assert abs(ours.mean().item() - 1 / (2 * scale - 1)) < 0.03
    assert mask_overlap(masks_for_channels(channels, n, scale, generator)) == pytest.approx(
        ours.mean().item(), abs=0.08
    )  # the same statistic, one set


def test_a_masked_layer_masks_row_r_with_member_r_mod_m():
    torch.manual_seed(0)
    masks = masks_for_channels(12, 3, 2.0)
    conv, linear = nn.Conv2d(12, 5, 3, padding=1), nn.Linear(12, 4)
    x, features = torch.randn(2 * 3, 12, 6, 6), torch.randn(2 * 3, 12)
    masked_conv, masked_linear = MaskedConv2d(conv, masks), MaskedLinear(linear, masks)
    for r in range(6):
        torch.testing.assert_close(masked_conv(x)[r], conv(x[r : r + 1] * masks[r % 3, :, None, None])[0])
        torch.testing.assert_close(masked_linear(features)[r], linear(features[r] * masks[r % 3]))
    torch.testing.assert_close(masked_conv(x.contiguous(memory_format=torch.channels_last)), masked_conv(x))
    with pytest.raises(ValueError, match="whole member groups"):
        masked_conv(x[:5])


def test_every_convolution_but_the_stem_and_the_head_are_masked():
    torch.manual_seed(0)
    net = ResNet18(10, width=16)
    convs = [name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    masksembles(net, 4, 2.0)
    masked = {name for name, m in net.named_modules() if isinstance(m, (MaskedConv2d, MaskedLinear))}
    assert type(net.conv1) is nn.Conv2d and masked == set(convs[1:]) | {"classifier"}  # conv1: the stem
    assert all(layer.masks.shape == (4, layer.layer.weight.shape[1]) for layer in masked_layers(net))
    cells = masksembles(StructureNet(10, num_nodes=3, cells_per_stage=1, growth=10, stem_channels=16), 2, 2.0)
    assert (
        type(cells.stem) is nn.Conv2d and len(masked_layers(cells)) > 10 and isinstance(cells.classifier, MaskedLinear)
    )
    with pytest.raises(ValueError, match="masksembles: layer1.0.conv1 of ResNet18: .*at least 10 channels.*got 8"):
        masksembles(ResNet18(10, width=8), 4, 2.0)
