"""The search space (dbsn.nets.ops): every op keeps the shape and ends in a non-affine BatchNorm."""

import torch
from torch import nn

from dbsn.nets import OPS


def test_ops_table_shapes_and_final_non_affine_bn():
    x = torch.randn(4, 6, 8, 8)
    for name, make in OPS.items():
        op = make(6)
        assert op(x, 1).shape == x.shape, name
        if name != "zero":
            last_bn = [m for m in op.modules() if isinstance(m, nn.BatchNorm2d)][-1]
            assert not last_bn.affine, f"{name} must end in a non-affine BN"
    assert sum(p.numel() for p in OPS["identity"](6).parameters()) == 0
    assert sum(p.numel() for p in OPS["zero"](6).parameters()) == 0
