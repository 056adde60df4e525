"""The structure-learnable cell (paper Eq. 1): `Cell`, which runs every edge's ops one by one
(the reference), and what it shares with `dbsn.nets.fused_cell.FusedCell`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dbsn.nets.cell_state import per_edge_state
from dbsn.nets.ops import OPS, GroupBatchNorm2d, GroupedSequential, Zero, expand_groups, memory_format


class CellBase(nn.Module):
    """What the per-edge `Cell` and the `FusedCell` share: the input projection split into one
    slice per node, the node outputs, the output's concatenation, and the edge numbering
    (see `Cell`). Subclasses compute the nodes."""

    def __init__(
        self, in_channels: int, num_nodes: int, growth: int, projection_kernel: int = 1, keep_input: bool = True
    ):
        super().__init__()
        self.num_nodes, self.growth, self.keep_input = num_nodes, growth, keep_input
        self.out_channels = (in_channels if keep_input else 0) + num_nodes * growth
        self.edges = [(i, j) for j in range(1, num_nodes) for i in range(j)]
        self.preprocess = GroupedSequential(
            GroupBatchNorm2d(in_channels),
            nn.ReLU(),
            nn.Conv2d(in_channels, num_nodes * growth, projection_kernel, padding=projection_kernel // 2, bias=False),
            GroupBatchNorm2d(num_nodes * growth, affine=False),
        )
        self.node_output: nn.Module = nn.Identity()
        self.channel_groups = 1

    @staticmethod
    def edge_index(i: int, j: int) -> int:
        """The row of alpha of edge (i, j), i < j (edges are numbered j-major)."""
        return j * (j - 1) // 2 + i

    def _output(self, x: Tensor, nodes: list[Tensor], groups: int, expand: bool) -> Tensor:
        if not self.keep_input:
            return self._concatenate(nodes)
        return self._concatenate([expand_groups(x, groups) if expand else x, *nodes])

    def _split_nodes(self, projected: Tensor) -> list[Tensor]:
        """The projection's one slice per node (of each member, with ``channel_groups``)."""
        if self.channel_groups == 1:
            return list(projected.split(self.growth, dim=1))
        b, c, h, w = projected.shape
        members, width = self.channel_groups, c // self.num_nodes
        if c % (members * self.num_nodes):
            raise ValueError(
                f"a cell's {c} projected channels do not split into {self.num_nodes} nodes of each of {members} members"
            )
        parts = projected.reshape(b, members, self.num_nodes, width // members, h, w)
        return [parts[:, :, j].reshape(b, width, h, w) for j in range(self.num_nodes)]

    def _concatenate(self, parts: list[Tensor]) -> Tensor:
        """``parts`` joined along channels (member by member, with ``channel_groups``)."""
        if self.channel_groups == 1:
            return torch.cat(parts, dim=1)
        b, _, h, w = parts[0].shape
        members = self.channel_groups
        joined = torch.cat([p.reshape(b, members, p.shape[1] // members, h, w) for p in parts], dim=2)
        return joined.flatten(1, 2).contiguous(memory_format=memory_format(parts[0]))


class Cell(CellBase):
    """A DenseNet-like cell of ``num_nodes`` nodes whose edges mix K candidate ops.

    The input is projected (BN-ReLU-1x1 conv-BN, last BN non-affine) to
    ``num_nodes * growth`` channels and split into one slice per node. Node 0 is
    slice 0; node j is slice j plus, over every predecessor i < j (Eq. 1),

        N^(i,j) = sum_k alpha[e(i, j), k] * op_k^(i,j)(N^i).

    Edges are numbered j-major: ``edges = [(0,1), (0,2), (1,2), (0,3), ...]``,
    i.e. e(i, j) = j(j-1)/2 + i, and every edge has its own op weights. The
    output is concat(input, node 0, ..., node B-1): the cell adds
    ``num_nodes * growth`` channels.

    ``projection_kernel``: kernel size of the input projection conv (padding k//2); the
    segmentation cells use 3. ``keep_input=False``: output only concat(node 0..B-1), as the
    dense blocks of the FC-DenseNet bottleneck and up path do (only new features go up).

    ``node_output`` (identity) is applied to every node's value, as its successors and the
    output see it: a place for methods to put a layer there (MC dropout on every node output,
    as the DBSN research code's baseline does). It acts per row: shared rows are expanded first.

    ``channel_groups`` (1): the number of ensemble members whose channels lie side by side in
    every tensor, member m's the m-th of ``channel_groups`` equal blocks (Packed-Ensembles,
    `dbsn.nets.packed.pack`, sets it). The split into nodes and the concatenation then go
    member by member, so that each member's channels stay together.
    """

    def __init__(
        self,
        in_channels: int,
        num_nodes: int,
        growth: int,
        op_names: Sequence[str],
        projection_kernel: int = 1,
        keep_input: bool = True,
    ):
        super().__init__(in_channels, num_nodes, growth, projection_kernel, keep_input)
        self.op_names = list(op_names)
        self.edge_ops = nn.ModuleList(nn.ModuleList(OPS[name](growth) for name in op_names) for _ in self.edges)
        self._register_load_state_dict_pre_hook(_from_fused_state, with_module=True)

    def forward(self, x: Tensor, alpha: Tensor, expand: bool = False) -> Tensor:
        """``x``: (b*G, C, H, W); ``alpha``: (G, E, K); row r uses alpha[r mod G].

        ``expand=True``: ``x`` is (b, C, H, W), the same for every structure. Everything that
        does not depend on alpha then runs once on the b rows: the input projection and the
        ops on node 0 (a slice of it); per-group BatchNorm of G identical groups is BatchNorm
        of one, so this equals the forward of the replicated input. Only the alpha-weighted
        sums create the G groups.
        """
        groups = alpha.shape[0]
        projected = self.preprocess(x, 1 if expand else groups)
        layout = memory_format(projected)  # contiguous, or channels-last: the ops keep it
        slices = self._split_nodes(projected)
        shared = [expand] * len(slices)  # whether a node still holds b rows shared by all groups
        nodes: list[Tensor] = []
        for j in range(len(slices)):
            node = slices[j].contiguous(memory_format=layout)  # a channel slice; its ops want a dense tensor
            if j > 0:
                first = j * (j - 1) // 2  # edges (0, j), (1, j), ... are first, first + 1, ...
                edges = [
                    self._mixed_edge(nodes[i], alpha[:, first + i], self.edge_ops[first + i], shared[i])
                    for i in range(j)
                ]
                node = expand_groups(node, groups) if shared[j] else node
                node = node + sum(edges)
                shared[j] = False
            if not isinstance(self.node_output, nn.Identity):
                if shared[j]:  # per-row layers (dropout masks) must not be shared by the groups
                    node, shared[j] = expand_groups(node, groups), False
                node = self.node_output(node)
            nodes.append(node)
        if expand:
            nodes = [expand_groups(n, groups) if s else n for n, s in zip(nodes, shared)]
        return self._output(x, nodes, groups, expand)

    @staticmethod
    def _mixed_edge(node: Tensor, alpha_e: Tensor, ops: nn.ModuleList, shared: bool = False) -> Tensor:
        """sum_k alpha_e[g, k] * op_k(node) for every group g, as (b*G, C, H, W); ``zero`` ops
        are skipped. A ``shared`` node holds b rows common to all groups: its ops run once and
        only the weighting is per group."""
        groups = alpha_e.shape[0]
        n, c, h, w = node.shape
        b = n if shared else n // groups
        weights = alpha_e.to(node.dtype).t().reshape(-1, 1, groups, 1, 1, 1)  # (K, 1, G, 1, 1, 1)
        out = None
        for k, op in enumerate(ops):
            if isinstance(op, Zero):
                continue
            term = op(node, 1 if shared else groups).view(b, 1 if shared else groups, c, h, w) * weights[k]
            out = term if out is None else out + term
        if out is None:  # every op is zero
            return node.new_zeros(b * groups, c, h, w).contiguous(memory_format=memory_format(node))
        return out.reshape(b * groups, c, h, w)


def _from_fused_state(cell: Cell, state_dict: dict, prefix: str, *args) -> None:
    """A `FusedCell`'s state loads into a `Cell` (and back: `FusedCell` converts the other way)."""
    per_edge_state(cell, state_dict, prefix)
