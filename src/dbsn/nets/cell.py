"""The structure-learnable cell (paper Eq. 1)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from dbsn.nets.ops import OPS, GroupBatchNorm2d, GroupedSequential, Zero


class Cell(nn.Module):
    """A DenseNet-like cell of ``num_nodes`` nodes whose edges mix K candidate ops.

    The input is projected (BN-ReLU-1x1 conv-BN, last BN non-affine) to
    ``num_nodes * growth`` channels and split into one slice per node. Node 0 is
    slice 0; node j is slice j plus, over every predecessor i < j (Eq. 1),

        N^(i,j) = sum_k alpha[e(i, j), k] * op_k^(i,j)(N^i).

    Edges are numbered j-major: ``edges = [(0,1), (0,2), (1,2), (0,3), ...]``,
    i.e. e(i, j) = j(j-1)/2 + i, and every edge has its own op weights. The
    output is concat(input, node 0, ..., node B-1): the cell adds
    ``num_nodes * growth`` channels.
    """

    def __init__(self, in_channels: int, num_nodes: int, growth: int, op_names: Sequence[str]):
        super().__init__()
        self.num_nodes, self.growth = num_nodes, growth
        self.out_channels = in_channels + num_nodes * growth
        self.edges = [(i, j) for j in range(1, num_nodes) for i in range(j)]
        self.preprocess = GroupedSequential(
            GroupBatchNorm2d(in_channels), nn.ReLU(),
            nn.Conv2d(in_channels, num_nodes * growth, 1, bias=False),
            GroupBatchNorm2d(num_nodes * growth, affine=False),
        )
        self.edge_ops = nn.ModuleList(
            nn.ModuleList(OPS[name](growth) for name in op_names) for _ in self.edges
        )

    def forward(self, x: Tensor, alpha: Tensor, expand: bool = False) -> Tensor:
        """``x``: (b*G, C, H, W); ``alpha``: (G, E, K); row r uses alpha[r mod G].

        ``expand=True``: ``x`` is (b, C, H, W), the same for every structure. The input
        projection does not depend on alpha (and per-group BatchNorm of G identical groups
        is BatchNorm of one), so it runs once and both x and it are replicated afterwards.
        """
        groups = alpha.shape[0]
        projected = self.preprocess(x, 1 if expand else groups)
        if expand:
            x, projected = x.repeat_interleave(groups, 0), projected.repeat_interleave(groups, 0)
        slices = projected.split(self.growth, dim=1)
        nodes: list[Tensor] = []
        for j, node in enumerate(slices):
            for i in range(j):
                e = j * (j - 1) // 2 + i
                node = node + self._mixed_edge(nodes[i], alpha[:, e], self.edge_ops[e])
            nodes.append(node.contiguous())  # node 0 is a channel slice; its ops want a dense tensor
        return torch.cat([x, *nodes], dim=1)

    @staticmethod
    def _mixed_edge(node: Tensor, alpha_e: Tensor, ops: nn.ModuleList) -> Tensor:
        """sum_k alpha_e[g, k] * op_k(node) per group g; ``zero`` ops are skipped."""
        groups = alpha_e.shape[0]
        n, c, h, w = node.shape
        weights = alpha_e.to(node.dtype).t().reshape(-1, 1, groups, 1, 1, 1)  # (K, 1, G, 1, 1, 1)
        out = None
        for k, op in enumerate(ops):
            if isinstance(op, Zero):
                continue
            term = op(node, groups).view(n // groups, groups, c, h, w) * weights[k]
            out = term if out is None else out + term
        if out is None:  # every op is zero
            return torch.zeros_like(node)
        return out.view(n, c, h, w)
