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
