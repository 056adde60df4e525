"""The fused cell: the same function as `dbsn.nets.cell.Cell`, in about a fifth of the operations.

In a DARTS-style cell every out-edge (i, j), j > i, of node i applies the same candidate ops to
the same input N^i, each with its own weights. `FusedCell` runs them together, source node by
source node (`SourceOps`):

- one normalisation of N^i serves the ``identity`` op of every out-edge and the first BatchNorm of
  every other op (the same input and batch statistics, so one set of running statistics,
  ``norm``); each op's first affine transform is then an `EdgeAffine`;
- each op's chain (ReLU, depthwise and 1×1 convolutions, BatchNorm) runs once on the n_i
  out-edges' n_i·C channels: grouped convolutions (edge t's block of channels is edge t's own
  convolution, in a form of `dbsn.nets.conv_forms`), one BatchNorm over all of them;
- the α-weighted sum of Eq. 1 over all out-edges is one multiply-add per op on a
  (b, G, n_i, C, H, W) view, and node j gathers its incoming edges with ``unbind``.

Parameters are stacked per source node (edge t = (i, i + 1 + t) is slot t); the state dict
converts both ways, so a checkpoint written with one cell loads into the other (`fused_state`,
`per_edge_state`). The reference `Cell` stays for the tests that hold this one to it (float64,
every gradient and running statistic) and for methods that need an op per edge (`refuse_fused`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from dbsn.nets.batchnorm import GroupBatchNorm2d, statistics_apart
from dbsn.nets.cell import Cell, CellBase
from dbsn.nets.cell_state import CHAINS, fused_state, per_edge_state
from dbsn.nets.conv_forms import StackedConv2d
from dbsn.nets.ops import GroupedSequential, expand_groups, memory_format

__all__ = [
    "CELLS",
    "FUSABLE_OPS",
    "EdgeAffine",
    "FusedCell",
    "SourceOps",
    "cell_class",
    "compiled_nodes",
    "fused_state",
    "per_edge_state",
    "unfuse",
]

#: the ops a `FusedCell` computes; any other op name needs the per-edge `Cell`
FUSABLE_OPS = ("zero", "identity", "sep_conv_3x3", "dil_conv_3x3")


class EdgeAffine(nn.Module):
    """The first BatchNorm's affine transform and the ReLU that follows it, of M chains (ops with
    weights) on n edges at once: from the (b, C, H, W) normalised input x̂ to M inputs of the
    chains' convolutions, each (b, n·C, H, W), edge t's block ``relu(x̂ · γ + β)`` with edge t's
    own γ and β of that op. ``weight`` and ``bias`` are (M·n, C, 1, 1), chain by chain, edge by
    edge (4-D, as `nn.Module.to(memory_format=...)` wants a network's parameters to be).

    Precision. With a 16-bit x̂ (under autocast the normalisation returns the activations' dtype)
    and float32 γ, β, the product and sum are computed in float32 and rounded once to x̂'s dtype,
    before the ReLU: the output equals ``relu(x̂.float() · γ + β)`` rounded to bfloat16, the value
    the convolutions' autocast cast would give, but the ReLU, its backward and everything the
    chains save run in the 16-bit dtype (type promotion alone would keep all of it in float32,
    and leave autocast one cast per chain). Casting γ and β down instead would round them to 8
    bits before the product: other values. The gradients of γ and β are reduced in float32
    (the backward of the float32 product) and land in the float32 parameters."""

    def __init__(self, chains: int, edges: int, channels: int):
        super().__init__()
        self.chains, self.edges, self.channels = chains, edges, channels
        self.weight = nn.Parameter(torch.ones(chains * edges, channels, 1, 1))
        self.bias = nn.Parameter(torch.zeros(chains * edges, channels, 1, 1))

    def forward(self, x: Tensor) -> list[Tensor]:
        m, n, c = self.chains, self.edges, self.channels
        b, _, h, w = x.shape
        if memory_format(x) == torch.channels_last:  # (b, H, W, C) in memory: keep channels innermost
            y = torch.addcmul(
                self.bias.view(m, 1, 1, 1, n, c),
                x.permute(0, 2, 3, 1).view(1, b, h, w, 1, c),
                self.weight.view(m, 1, 1, 1, n, c),
            )
            return [part.view(b, h, w, n * c).permute(0, 3, 1, 2) for part in torch.relu(_stored(y, x)).unbind(0)]
        y = torch.addcmul(
            self.bias.view(m, 1, n, c, 1, 1), x.view(1, b, 1, c, h, w), self.weight.view(m, 1, n, c, 1, 1)
        )
        return [part.view(b, n * c, h, w) for part in torch.relu(_stored(y, x)).unbind(0)]

    def extra_repr(self) -> str:
        return f"chains={self.chains}, edges={self.edges}, channels={self.channels}"


def _stored(y: Tensor, x: Tensor) -> Tensor:
    """`y`, computed from the 16-bit activations `x` with float32 parameters, rounded to `x`'s
    dtype; unchanged when `x` is not 16-bit (float32 and float64 runs compute in their own dtype)."""
    return y.to(x.dtype) if x.dtype in (torch.float16, torch.bfloat16) and y.dtype != x.dtype else y


def _stacked_conv(edges: int, channels: int, kernel: int, dilation: int = 1) -> StackedConv2d:
    """n edges' convolutions of C channels as one: depthwise (kernel 3) or 1×1 (edge t's block
    of channels to itself). ``stacked_edges`` tells the initialisation each edge's own fan-out;
    ``form`` how it computes (`dbsn.nets.conv_forms`: `F.conv2d` unless set otherwise)."""
    width = edges * channels
    return StackedConv2d(
        width,
        width,
        kernel,
        padding=dilation * (kernel // 2),
        dilation=dilation,
        groups=width if kernel > 1 else edges,
        bias=False,
        stacked_edges=edges,
    )


def _chain(name: str, edges: int, channels: int) -> GroupedSequential:
    """One op on n edges, laid out as the op's `GroupedSequential` in `dbsn.nets.ops` (index
    for index, so that state-dict keys convert), without its first BatchNorm and ReLU (two
    placeholders): `SourceOps` computes those of every chain at once (`EdgeAffine`)."""
    width = edges * channels
    layers: list[nn.Module] = []
    for s, dilation in enumerate(CHAINS[name]):
        layers += [
            nn.Identity() if s == 0 else GroupBatchNorm2d(width),
            nn.Identity() if s == 0 else nn.ReLU(),
            _stacked_conv(edges, channels, 3, dilation),
            _stacked_conv(edges, channels, 1),
        ]
    layers.append(GroupBatchNorm2d(width, affine=False))
    return GroupedSequential(*layers)


class SourceOps(nn.Module):
    """Every candidate op of the n out-edges of one node, stacked (see the module docstring).

    ``forward(node, weights, groups, shared)``: ``node`` (b·g, C, H, W) with g = 1 when ``shared``
    (b rows common to all G structures) else G; ``weights``, one (1, G, n, 1, 1, 1) tensor per op
    that is not ``zero`` (`present`, in the op list's order): α of this node's out-edges. Returns
    the weighted sums Σ_k α[g, t, k] op_k^(t)(node) as (b, G, n, C, H, W).

    Precision. The sums stay in the ops' dtype (bfloat16 under autocast): α is taken in that dtype,
    and each multiply-add computes in float32 and rounds once, k by k (a float32 accumulator would
    double the traffic of the largest tensors of the cell for one rounding less)."""

    def __init__(self, channels: int, edges: int, op_names: Sequence[str]):
        super().__init__()
        self.channels, self.edges, self.op_names = channels, edges, list(op_names)
        self.present = [name for name in op_names if name != "zero"]
        if self.present:
            self.norm = GroupBatchNorm2d(channels, affine=False)
        self.chains = nn.ModuleDict({name: _chain(name, edges, channels) for name in op_names if name in CHAINS})
        if self.chains:
            self.affine = EdgeAffine(len(self.chains), edges, channels)

    def forward(self, node: Tensor, weights: Sequence[Tensor], groups: int, shared: bool) -> Tensor:
        rows, c, h, w = node.shape
        g = 1 if shared else groups
        b, n = rows // g, self.edges
        normalised = self.norm(node, g) if self.present else None
        inputs = dict(zip(self.chains, self.affine(normalised))) if self.chains else {}
        out = None
        for name, weight in zip(self.present, weights):
            if name == "identity":
                term = normalised.view(b, g, 1, c, h, w)
            else:
                term = self.chains[name](inputs[name], g).view(b, g, n, c, h, w)
            weight = weight.to(term.dtype)  # the cell hands α over in the activations' dtype already
            out = term * weight if out is None else torch.addcmul(out, term, weight)
        if out is None:  # every op is zero
            return node.new_zeros(b, groups, n, c, h, w)
        if out.shape[2] != n:  # identity alone: one normalised input for every edge
            out = out.expand(b, groups, n, c, h, w)
        return out


class FusedCell(CellBase):
    """`dbsn.nets.cell.Cell`'s function (same arguments, same edge numbering, same state once
    converted), with the ops of each node's out-edges fused (see the module docstring)."""

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
        unknown = [name for name in op_names if name not in FUSABLE_OPS]
        if unknown:
            raise ValueError(
                f"the fused cell computes the ops {list(FUSABLE_OPS)}, not {unknown}: set model.net.cell=per_edge"
            )
        self.op_names = list(op_names)
        self.sources = nn.ModuleList(SourceOps(growth, num_nodes - 1 - i, op_names) for i in range(num_nodes - 1))
        # the entries of alpha (E, K) flattened that the ops use: edges source node by source node,
        # (0, 1), (0, 2), ..., (1, 2), ..., each edge's ops that are not zero
        present = [k for k, name in enumerate(op_names) if name != "zero"]
        order = [
            self.edge_index(i, j) * len(op_names) + k
            for i in range(num_nodes - 1)
            for j in range(i + 1, num_nodes)
            for k in present
        ]
        self.num_present = len(present)
        self.register_buffer("source_order", torch.tensor(order, dtype=torch.long), persistent=False)
        self._register_load_state_dict_pre_hook(_from_per_edge_state, with_module=True)
        #: `compile_nodes`'s options (sorted items), None: `nodes` runs eagerly
        self.nodes_compile: tuple | None = None

    def forward(self, x: Tensor, alpha: Tensor, expand: bool = False) -> Tensor:
        """As `Cell.forward`: ``x`` (b*G, C, H, W) or, with ``expand``, (b, C, H, W) shared by all
        G structures; ``alpha`` (G, E, K). The input projection, then the nodes (`nodes`), compiled
        where `compile_nodes` asked for it."""
        groups = alpha.shape[0]
        projected = self.preprocess(x, 1 if expand else groups)
        if self.nodes_compile is None:
            nodes = self.nodes(projected, alpha, expand)
        else:
            # the step's statistics lists stay out of the compiled region: dynamo guards a list's
            # length, and the step's grows cell by cell (one graph per cell instead of per shape)
            with statistics_apart(self._norms()):
                nodes = compiled_nodes(self.nodes_compile)(self, projected, alpha, expand)
        return self._output(x, nodes, groups, expand)

    def nodes(self, projected: Tensor, alpha: Tensor, expand: bool = False) -> list[Tensor]:
        """The cell's nodes from its input projection ``projected`` (b·G rows, or b shared rows with
        ``expand``, of ``num_nodes · growth`` channels): everything `forward` computes after the
        projection, up to the concatenation. The part that ``compile.scope=nodes`` compiles: its
        shapes are the same in every cell of a stage (the projection absorbs the growing input
        width), so the paper network's 12 cells make 4 graphs."""
        groups = alpha.shape[0]
        layout = memory_format(projected)
        slices = self._split_nodes(projected)
        rows, c, h, w = slices[0].shape
        b = rows if expand else rows // groups
        # α of the ops used, as (K', 1, G, E, 1, 1, 1), split by source node: one gather per cell
        kept = alpha.flatten(1).index_select(1, self.source_order).view(groups, -1, self.num_present)
        kept = kept.to(slices[0].dtype).permute(2, 0, 1).view(self.num_present, 1, groups, -1, 1, 1, 1)
        by_source = [part.unbind(0) for part in kept.split([source.edges for source in self.sources], dim=3)]
        incoming: list[list[Tensor]] = [[] for _ in slices]
        nodes: list[Tensor] = []
        for j, piece in enumerate(slices):
            # node 0 is a channel slice, which BatchNorm's grouped view and the ops want dense; the
            # others become dense in the sum with their incoming edges
            node, shared = piece.contiguous(memory_format=layout) if j == 0 else piece, expand
            if j > 0:
                total = incoming[j][0]
                for edge in incoming[j][1:]:
                    total = total + edge
                node = (node.view(b, 1 if shared else groups, c, h, w) + total).reshape(b * groups, c, h, w)
                shared = False
            if not isinstance(self.node_output, nn.Identity):
                if shared:  # per-row layers (dropout masks) must not be shared by the groups
                    node, shared = expand_groups(node, groups), False
                node = self.node_output(node)
            if j < len(self.sources):
                for t, edge in enumerate(self.sources[j](node, by_source[j], groups, shared).unbind(2)):
                    incoming[j + 1 + t].append(edge)
            nodes.append(expand_groups(node, groups) if shared else node)
        return nodes

    def compile_nodes(self, **options) -> None:
        """Compile `nodes` from now on with `torch.compile(**options)` (``nodes_compile = None`` runs it
        eagerly again). Every cell with the same options shares one compiled function, so cells of
        one shape share a graph. The options are kept, not the compiled function: the cell still
        pickles and copies."""
        self.nodes_compile = tuple(sorted(options.items()))

    def _norms(self) -> list[GroupBatchNorm2d]:
        return [m for m in self.modules() if isinstance(m, GroupBatchNorm2d)]


_COMPILED_NODES: dict[tuple, Callable] = {}


def compiled_nodes(options: tuple) -> Callable:
    """`FusedCell.nodes` compiled with `options` (sorted items of `torch.compile`'s keywords), one
    compiled function per set of options in the process: dynamo then keeps one cache of graphs for
    all cells, a graph per distinct cell shape (and mode, autocast state)."""
    compiled = _COMPILED_NODES.get(options)
    if compiled is None:
        compiled = _COMPILED_NODES[options] = torch.compile(FusedCell.nodes, **dict(options))
    return compiled


#: the networks' ``cell`` choice: the fused cell (the default) or the per-edge reference
CELLS: dict[str, type[CellBase]] = {"fused": FusedCell, "per_edge": Cell}


def cell_class(kind: str) -> type[CellBase]:
    """The cell class of a network's ``cell`` setting."""
    if kind not in CELLS:
        raise ValueError(f"cell must be one of {list(CELLS)}, got {kind!r}")
    return CELLS[kind]


def unfuse(net: nn.Module) -> nn.Module:
    """`net` with every `FusedCell` replaced by the per-edge `Cell` of the same function and state
    (in place; returned): for the methods that transform each edge's layers (Packed-Ensembles'
    channel groups, VOGN's per-example statistics of every BatchNorm)."""
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, FusedCell):
                continue
            conv = child.preprocess[2]
            cell = Cell(
                child.preprocess[0].num_features,
                child.num_nodes,
                child.growth,
                child.op_names,
                projection_kernel=conv.kernel_size[0],
                keep_input=child.keep_input,
            )
            reference = conv.weight
            layout = (
                torch.channels_last
                if reference.is_contiguous(memory_format=torch.channels_last) and not reference.is_contiguous()
                else torch.contiguous_format
            )
            cell.to(device=reference.device, dtype=reference.dtype, memory_format=layout)
            cell.load_state_dict(child.state_dict())
            cell.node_output, cell.channel_groups = child.node_output, child.channel_groups
            cell.train(child.training)
            setattr(parent, name, cell)
    if getattr(net, "cell", None) == "fused":
        net.cell = "per_edge"
    return net


def _from_per_edge_state(cell: FusedCell, state_dict: dict, prefix: str, *args) -> None:
    fused_state(cell, state_dict, prefix)
