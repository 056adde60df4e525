"""Helpers shared by the network tests: random structures, grouped batches, small networks."""

from __future__ import annotations

import torch
from torch import nn

from dbsn.nets import StructureNet

SEG_OPS = ("identity", "sep_conv_3x3", "dil_conv_3x3")  # the segmentation network's ops (no zero)


def tiny_structure_net(num_classes: int = 10, cell: str = "fused") -> StructureNet:
    """A StructureNet that trains in seconds on a CPU: 3 nodes, one cell per stage, growth 4."""
    return StructureNet(num_classes=num_classes, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8, cell=cell)


def soft_alpha(groups, net_or_edges, num_ops=None, seed=0):
    """(groups, E, K) random soft structures; E and K from a network, or given."""
    if isinstance(net_or_edges, int):
        edges, num_ops = net_or_edges, 4 if num_ops is None else num_ops
    else:
        edges, num_ops = net_or_edges.num_edges, num_ops or net_or_edges.num_ops
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(groups, edges, num_ops, generator=g), dim=-1)


def split_groups(x, groups):
    """The G groups of a grouped batch: row r belongs to group r mod G."""
    return [x[g::groups] for g in range(groups)]


def join_groups(parts):
    """Inverse of split_groups."""
    return torch.stack(parts, dim=1).flatten(0, 1)


def set_random_affine(model, seed=0):
    """BatchNorm affine parameters away from (1, 0), so tests see them."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d) and m.affine:
            m.weight.data = 1 + 0.3 * torch.randn(m.weight.shape, generator=g)
            m.bias.data = 0.3 * torch.randn(m.bias.shape, generator=g)
