"""GroupBatchNorm2d (dbsn.nets.batchnorm): G groups in one batch normalise, update running
statistics and receive gradients as G separate BatchNorms.
"""

import pytest
import torch
from torch import nn

from dbsn.nets import GroupBatchNorm2d
from tests.support.netutil import join_groups, set_random_affine, split_groups


@pytest.mark.parametrize("momentum", [0.1, None])
def test_group_bn_training_equals_separate_batchnorms(momentum):
    torch.manual_seed(0)
    groups, b, c = 3, 4, 5
    gbn = GroupBatchNorm2d(c, momentum=momentum)
    set_random_affine(gbn)
    separate = [nn.BatchNorm2d(c, momentum=momentum) for _ in range(groups)]
    for bn in separate:
        bn.load_state_dict(gbn.state_dict())

    for step in range(2):  # two steps: the running-stat update must compose too
        x = torch.randn(groups * b, c, 6, 6) * torch.arange(1, c + 1).view(1, c, 1, 1) + step
        y = gbn(x, groups)
        y_ref = join_groups([bn(xg) for bn, xg in zip(separate, split_groups(x, groups))])
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)

    # Running stats: the average of the G copies; step count as for one BN.
    for name in ("running_mean", "running_var"):
        mean_of_copies = torch.stack([getattr(bn, name) for bn in separate]).mean(0)
        torch.testing.assert_close(getattr(gbn, name), mean_of_copies, rtol=1e-5, atol=1e-6)
    assert int(gbn.num_batches_tracked) == 2

    # Gradients: grouped loss gradient = sum of the separate copies' gradients.
    gbn.zero_grad()
    w = torch.randn(groups * b, c, 6, 6)
    (gbn(x, groups) * w).sum().backward()
    for bn, xg, wg in zip(separate, split_groups(x, groups), split_groups(w, groups)):
        (bn(xg) * wg).sum().backward()
    torch.testing.assert_close(gbn.weight.grad, sum(bn.weight.grad for bn in separate))
    torch.testing.assert_close(gbn.bias.grad, sum(bn.bias.grad for bn in separate))


def test_group_bn_is_batchnorm_for_one_group_and_in_eval():
    torch.manual_seed(0)
    gbn, bn = GroupBatchNorm2d(4), nn.BatchNorm2d(4)
    set_random_affine(gbn)
    bn.load_state_dict(gbn.state_dict())
    x = torch.randn(6, 4, 5, 5) * 3 + 1
    torch.testing.assert_close(gbn(x, 1), bn(x))
    torch.testing.assert_close(gbn.running_var, bn.running_var)
    gbn.eval(), bn.eval()
    torch.testing.assert_close(gbn(x, 3), bn(x))  # eval: running stats, whatever the groups
    assert int(gbn.num_batches_tracked) == 1


def test_statistics_under_cpu_bfloat16_autocast_stay_float32():
    """A CPU computes a bfloat16 batch's BatchNorm statistics in bfloat16 unless a float32 parameter
    makes it mix: the collected per-structure statistics, and the running statistics, stay float32
    and serve a later float32 forward."""
    from dbsn.nets import StructureNet
    from dbsn.nets.batchnorm import accumulated_running_statistics, structure_statistics, using_statistics
    from tests.support.netutil import soft_alpha

    torch.manual_seed(0)
    net = StructureNet(num_classes=3, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)
    alpha, x = soft_alpha(2, net), torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        statistics = structure_statistics(lambda b: net(b, alpha, replicate=True), net, [x], 2)
        with accumulated_running_statistics(net):
            net(x, alpha, replicate=True)
    assert all(m.dtype == v.dtype == torch.float32 for m, v in statistics.values())
    assert all(b.dtype == torch.float32 for name, b in net.named_buffers() if "running_" in name)
    net.eval()
    with torch.no_grad(), using_statistics(net, statistics):
        assert torch.isfinite(net(x, alpha, replicate=True)).all()
