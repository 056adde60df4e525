"""The field's backbones (dbsn.nets.resnet, dbsn.nets.wideresnet): published parameter counts, the
CIFAR layout (no max pooling, 3x3 stem), WideResNet's dropout, and the Backbone interface with
per-group BatchNorm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dbsn.nets import Backbone, GroupBatchNorm2d, ResNet18, WideResNet
from tests.support.netutil import set_random_affine


def _count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_full_size_networks_have_the_published_parameter_counts():
    resnet, wrn = ResNet18(10), WideResNet(10, depth=28, widen_factor=10)  # constructed only, no forward
    assert _count(resnet) == 11_173_962  # ResNet-18 (CIFAR), 11.17 M
    assert _count(wrn) == 36_479_194  # WRN-28-10, 36.5 M
    assert _count(ResNet18(100)) == 11_173_962 + 513 * 90  # Linear(512, C): 513 per class
    for net, convs in ((resnet, 1 + 16 + 3), (wrn, 1 + 24 + 3)):  # stem, main path, 1x1 shortcuts
        assert len([m for m in net.modules() if isinstance(m, nn.Conv2d)]) == convs
        assert all(m.bias is None for m in net.modules() if isinstance(m, nn.Conv2d))
        assert not any(isinstance(m, nn.MaxPool2d) for m in net.modules())
        stem = next(m for m in net.modules() if isinstance(m, nn.Conv2d))
        assert (stem.kernel_size, stem.stride) == ((3, 3), (1, 1))
        assert isinstance(net.classifier, nn.Linear) and net.classifier.out_features == 10


def _stage_sizes(net, stages, x):
    sizes, hooks = (
        [],
        [getattr(net, s).register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[1:]))) for s in stages],
    )
    net(x)
    for h in hooks:
        h.remove()
    return sizes


@pytest.mark.parametrize("name", ["resnet18", "wide_resnet"])
def test_tiny_backbones_are_backbones_whose_grouped_forward_equals_separate_forwards(name):
    torch.manual_seed(0)
    if name == "resnet18":
        net, stages = ResNet18(10, width=4), ["layer1", "layer2", "layer3", "layer4"]
        sizes = [(4, 32, 32), (8, 16, 16), (16, 8, 8), (32, 4, 4)]  # stride-1 stem, no max pooling
    else:
        net, stages = WideResNet(10, depth=10, widen_factor=1), ["layer1", "layer2", "layer3"]
        sizes = [(16, 32, 32), (32, 16, 16), (64, 8, 8)]
    set_random_affine(net)
    assert isinstance(net, Backbone) and (net.num_edges, net.num_ops, net.edges, net.op_names) == (0, 0, [], [])
    norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(isinstance(m, GroupBatchNorm2d) for m in norms)
    x = torch.randn(4, 3, 32, 32)
    assert _stage_sizes(net, stages, x) == sizes
    assert net(x).shape == (4, 10) and net(x, torch.zeros(0, 0)).shape == (4, 10)

    # train mode: every group is normalised with its own statistics, so each of G = 3 groups of a
    # grouped forward equals a forward of x alone (the running statistics too)
    separate = net(x)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    grouped = net(x, torch.zeros(3, 0, 0), replicate=True)
    assert grouped.shape == (12, 10)
    for g in range(3):
        torch.testing.assert_close(grouped.view(4, 3, 10)[:, g], separate, rtol=1e-4, atol=1e-5)
    # eval mode: the running statistics, rows of one example alike in every group
    net.eval()
    rows = net(x, torch.zeros(2, 0, 0), replicate=True).view(4, 2, 10)
    torch.testing.assert_close(rows[:, 0], rows[:, 1])
    torch.testing.assert_close(rows[:, 0], net(x), rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items() if "running_mean" in k)
    with pytest.raises(ValueError, match="no structure"):
        net(x, torch.zeros(1, 2, 4))


def test_wide_resnet_dropout_sits_between_the_two_convolutions_of_every_block():
    torch.manual_seed(0)
    net = WideResNet(10, depth=16, widen_factor=1, dropout=0.3)  # n = 2 blocks per stage
    blocks = [b for s in (net.layer1, net.layer2, net.layer3) for b in s]
    dropouts = [m for m in net.modules() if isinstance(m, nn.Dropout)]
    assert len(blocks) == 6 and dropouts == [b.dropout for b in blocks] and all(d.p == 0.3 for d in dropouts)
    assert [b.shortcut is not None for b in blocks] == [False, False, True, False, True, False]  # 16 -> 16: identity
    # the layers exist at rate 0 as well (the identity), for MC dropout's placement=existing
    assert [m.p for m in WideResNet(10, depth=10, widen_factor=1).modules() if isinstance(m, nn.Dropout)] == [0.0] * 3

    # dropout acts on the input of the second convolution: its mask is what differs between passes
    block, inputs = blocks[0], []
    block.conv2.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    net.train()
    net(torch.randn(2, 3, 32, 32))
    assert (inputs[0] == 0).float().mean() > 0.2
    with pytest.raises(ValueError, match="6n \\+ 4"):
        WideResNet(10, depth=12)
    with pytest.raises(ValueError, match="width"):
        ResNet18(10, width=0)


def test_initialisation_follows_the_reference_code():
    torch.manual_seed(0)
    wrn = WideResNet(10, depth=10, widen_factor=4)
    conv = wrn.layer3[0].conv2  # He normal, fan-out: std sqrt(2 / (9 * 256))
    assert conv.weight.std().item() == pytest.approx((2 / (9 * 256)) ** 0.5, rel=0.05)
    assert torch.count_nonzero(wrn.classifier.bias) == 0
    resnet = ResNet18(10, width=8)  # PyTorch's default: Kaiming uniform (a = sqrt 5), bound 1 / sqrt(fan_in)
    conv = resnet.layer4[1].conv2
    assert conv.weight.abs().max().item() <= (1 / (9 * 64)) ** 0.5 and torch.count_nonzero(resnet.classifier.bias) > 0


def test_the_field_methods_on_wrn_28_10_have_the_published_parameter_counts():
    """uncertainty-baselines' table: BatchEnsemble (4) 36.6 M, MIMO 36.5 M on WideResNet-28-10 (Packed-Ensembles'
    counts: tests/methods/test_packed_ensemble.py)."""
    from dbsn.nets.batch_ensemble import batch_ensemble
    from dbsn.nets.mimo import mimo

    assert _count(batch_ensemble(WideResNet(10), 4)) == 36_557_548  # 36.6 M
    assert _count(mimo(WideResNet(10), 3)) == 36_492_878  # 36.5 M
    assert round(_count(batch_ensemble(ResNet18(10), 4)) / 1e6, 2) == 11.21
