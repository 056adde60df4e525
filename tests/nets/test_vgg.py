"""VGG16-BN (dbsn.nets.vgg), NEK-FAC's network: 3.7M parameters and the network interface."""

from __future__ import annotations

import pytest
import torch

from dbsn.nets import VGG16BN


def test_vgg16_bn_has_3_7m_parameters_and_the_network_interface():
    count = sum(p.numel() for p in VGG16BN(10).parameters())
    print(f"VGG16BN(10): {count:,} parameters")
    assert count == pytest.approx(3.7e6, rel=0.1)
    assert count == 3_686_954  # 13 convs (with bias) 3,680,160 + BN 4,224 + Linear(256, 10) 2,570

    torch.manual_seed(0)
    net = VGG16BN(10, width=0.25)
    assert (net.num_edges, net.num_ops, net.op_names, net.edges, net.num_classes) == (0, 0, [], [], 10)
    assert [m.out_channels for m in net.modules() if isinstance(m, torch.nn.Conv2d)] == [8] * 2 + [16] * 2 + [
        32
    ] * 3 + [64] * 6
    x = torch.randn(4, 3, 32, 32)
    assert net(x).shape == (4, 10) and net(x, torch.zeros(0, 0)).shape == (4, 10)
    grouped = net(x, torch.zeros(3, 0, 0), replicate=True)  # every example under each of G = 3 groups
    assert grouped.shape == (12, 10)
    for g in range(3):  # train mode: per-group BatchNorm statistics, so each group equals one forward of x
        torch.testing.assert_close(grouped.view(4, 3, 10)[:, g], net(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no structure"):
        net(x, torch.zeros(1, 2, 4))
