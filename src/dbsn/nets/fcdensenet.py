"""Segmentation networks for CamVid: FC-DenseNet67 (Tiramisu) and its DBSN version.

Both follow the skeleton of Jégou et al. 2017 ("The One Hundred Layers Tiramisu"):
first conv 3x3 -> ``num_down`` x [dense block -> skip -> transition down] -> bottleneck
block -> ``num_down`` x [transition up (on the previous block's *new* features only) ->
concat with the skip -> dense block] -> 1x1 conv to the classes. Down-path blocks output
concat(input, new features); the bottleneck and up-path blocks pass only their new features
up, except the last up block, whose output includes its input.

Both take the classifier's interface, ``forward(x, alpha, replicate=False)`` with row r of
the batch under ``alpha[r mod G]``, and return logits (N, num_classes, H, W). Inputs whose
height/width are not multiples of 2**num_down are padded to the next multiple (reflect
padding split evenly between the two sides; zero padding where the image is too small to
reflect) and the logits are cropped back, so the output has the input's spatial size
(CamVid's 360 x 480 runs at 384 x 480).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.nets.cell import CellBase
from dbsn.nets.fused_cell import cell_class
from dbsn.nets.ops import OPS, GroupBatchNorm2d, GroupedSequential, expand_groups, research_init_


def _check_alpha(net: nn.Module, x: Tensor, alpha: Tensor, replicate: bool) -> Tensor:
    """``alpha`` as (G, E, K), checked against ``net.num_edges``/``num_ops`` and the batch."""
    if alpha.dim() == 2:
        alpha = alpha.unsqueeze(0)
    expected = (net.num_edges, net.num_ops)
    if alpha.dim() != 3 or tuple(alpha.shape[1:]) != expected:
        raise ValueError(
            f"alpha must have shape (G, {expected[0]}, {expected[1]}) or {expected} "
            f"(edges x ops {net.op_names}), got {tuple(alpha.shape)}"
        )
    if alpha.shape[0] == 0 or (not replicate and x.shape[0] % alpha.shape[0] != 0):
        raise ValueError(
            f"batch size {x.shape[0]} is not divisible by the number of structures "
            f"G = {alpha.shape[0]} (alpha of shape {tuple(alpha.shape)})"
        )
    return alpha


def _pad_to_multiple(x: Tensor, multiple: int) -> tuple[Tensor, tuple[slice, slice]]:
    """Pad H and W up to multiples of ``multiple``; returns the padded x and the crop back."""
    h, w = x.shape[-2:]
    ph, pw = -h % multiple, -w % multiple
    top, left = ph // 2, pw // 2
    crop = (slice(top, top + h), slice(left, left + w))
    if ph == 0 and pw == 0:
        return x, crop
    pad = (left, pw - left, top, ph - top)
    mode = "reflect" if max(pad[:2]) < w and max(pad[2:]) < h else "constant"
    return F.pad(x, pad, mode=mode), crop


def _transition_up(channels: int, bias: bool) -> nn.ConvTranspose2d:
    """Transposed conv 3x3 stride 2, exactly doubling H and W."""
    return nn.ConvTranspose2d(channels, channels, 3, stride=2, padding=1, output_padding=1, bias=bias)


# --- FC-DenseNet67 ---------------------------------------------------------------------


def _bn_relu_conv(in_channels: int, out_channels: int, kernel: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.BatchNorm2d(in_channels),
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, kernel, padding=kernel // 2),
        nn.Dropout(dropout),
    )


class DenseBlock(nn.Module):
    """``num_layers`` layers BN-ReLU-conv3x3(growth)-Dropout, each fed the concat of all before.

    Output: concat(input, new features) if ``keep_input``, else the new features only.
    """

    def __init__(self, in_channels: int, growth: int, num_layers: int, dropout: float, keep_input: bool):
        super().__init__()
        self.keep_input = keep_input
        self.layers = nn.ModuleList(
            _bn_relu_conv(in_channels + i * growth, growth, 3, dropout) for i in range(num_layers)
        )
        self.out_channels = (in_channels if keep_input else 0) + num_layers * growth

    def forward(self, x: Tensor) -> Tensor:
        new = []
        for layer in self.layers:
            new.append(layer(x))
            x = torch.cat([x, new[-1]], dim=1)
        return x if self.keep_input else torch.cat(new, dim=1)


class FCDenseNet(nn.Module):
    """FC-DenseNet67 (Tiramisu), the segmentation baseline; about 3.5M parameters by default.

    No structure: ``num_edges = num_ops = 0``. ``alpha`` of shape (G, 0, 0) (or None for
    G = 1) only gives the number of ensemble members G: ``replicate=True`` evaluates each
    of the b input examples G times (= ``forward(x.repeat_interleave(G, 0))``, distinct
    dropout masks per copy); ``replicate=False`` uses the batch as is. Plain
    ``nn.BatchNorm2d`` (no structure groups): in training mode with G > 1 it sees the whole
    replicated batch; its mean and biased variance equal the original batch's up to the
    per-copy dropout masks, and only the unbiased running-variance correction differs.
    Baseline training uses G = 1, so this is acceptable.
    Dropout is elementwise (``nn.Dropout``) after every conv except the first and last,
    as in the paper's Lasagne code; convs have biases; init He-uniform, biases zero.
    """

    num_edges, num_ops = 0, 0

    def __init__(
        self,
        num_classes: int = 11,
        in_channels: int = 3,
        first_channels: int = 48,
        growth: int = 16,
        layers_per_block: int = 5,
        num_down: int = 5,
        dropout: float = 0.2,
    ):
        super().__init__()
        self.num_classes, self.num_down = num_classes, num_down
        self.op_names: list[str] = []
        self.edges: list[tuple[int, int]] = []
        self.first_conv = nn.Conv2d(in_channels, first_channels, 3, padding=1)
        channels, skips = first_channels, []
        self.down_blocks, self.down_transitions = nn.ModuleList(), nn.ModuleList()
        for _ in range(num_down):
            self.down_blocks.append(DenseBlock(channels, growth, layers_per_block, dropout, keep_input=True))
            channels = self.down_blocks[-1].out_channels
            skips.append(channels)
            self.down_transitions.append(nn.Sequential(_bn_relu_conv(channels, channels, 1, dropout), nn.MaxPool2d(2)))
        self.bottleneck = DenseBlock(channels, growth, layers_per_block, dropout, keep_input=False)
        channels = self.bottleneck.out_channels
        self.up_transitions, self.up_blocks = nn.ModuleList(), nn.ModuleList()
        for i, skip in enumerate(reversed(skips)):
            self.up_transitions.append(_transition_up(channels, bias=True))
            last = i == num_down - 1
            self.up_blocks.append(DenseBlock(channels + skip, growth, layers_per_block, dropout, keep_input=last))
            channels = self.up_blocks[-1].out_channels
        self.final_conv = nn.Conv2d(channels, num_classes, 1)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor, alpha: Tensor | None = None, replicate: bool = False) -> Tensor:
        groups = 1 if alpha is None else _check_alpha(self, x, alpha, replicate).shape[0]
        if replicate and groups > 1:
            x = expand_groups(x, groups)
        x, crop = _pad_to_multiple(x, 2**self.num_down)
        x = self.first_conv(x)
        skips = []
        for block, down in zip(self.down_blocks, self.down_transitions):
            x = block(x)
            skips.append(x)
            x = down(x)
        x = self.bottleneck(x)
        for up, block, skip in zip(self.up_transitions, self.up_blocks, reversed(skips)):
            x = block(torch.cat([up(x), skip], dim=1))
        return self.final_conv(x)[..., crop[0], crop[1]]


# --- DBSN segmentation network --------------------------------------------------------


class DBSNSegNet(nn.Module):
    """FC-DenseNet67 with every dense block replaced by one structure-learnable ``Cell``.

    Cells of ``num_nodes`` nodes (B = 5, 10 edges), growth 16, 3x3 input projection, K ops
    (no ``zero`` by default). Two structures: one shared by the down-path and bottleneck
    cells, one by the up-path cells, exposed as ONE alpha of shape (G, 2E, K):
    ``alpha[:, structure_slices["down"]]`` (edges 0..E-1) and ``alpha[:, structure_slices["up"]]``
    (edges E..2E-1). Rows of the batch are interleaved groups as in ``StructureNet``; every
    BatchNorm (cells and transitions down) is a ``GroupBatchNorm2d``, so a grouped forward
    equals G separate forwards in training mode too. ``replicate=True`` runs the
    structure-independent prefix (padding, first conv, first cell's projection) once.
    No dropout; convs without bias except the final classifier; init as ``StructureNet``.
    ``cell``: "fused" or "per_edge", as ``StructureNet``'s.
    """

    def __init__(
        self,
        num_classes: int = 11,
        in_channels: int = 3,
        first_channels: int = 48,
        growth: int = 16,
        num_nodes: int = 5,
        num_down: int = 5,
        ops: Sequence[str] = ("identity", "sep_conv_3x3", "dil_conv_3x3"),
        cell: str = "fused",
    ):
        super().__init__()
        self.cell = cell
        make_cell = cell_class(cell)
        unknown = [name for name in ops if name not in OPS]
        if unknown:
            raise ValueError(f"unknown op name(s) {unknown}; valid names are {list(OPS)}")
        self.num_classes, self.num_down = num_classes, num_down
        self.op_names = list(ops)
        self.num_ops = len(self.op_names)
        cell_edges = num_nodes * (num_nodes - 1) // 2
        self.num_edges = 2 * cell_edges
        self.structure_slices = {"down": slice(0, cell_edges), "up": slice(cell_edges, 2 * cell_edges)}

        def new_cell(channels: int, keep_input: bool) -> CellBase:
            return make_cell(channels, num_nodes, growth, self.op_names, projection_kernel=3, keep_input=keep_input)

        self.first_conv = nn.Conv2d(in_channels, first_channels, 3, padding=1, bias=False)
        channels, skips = first_channels, []
        self.down_cells, self.down_transitions = nn.ModuleList(), nn.ModuleList()
        for _ in range(num_down):
            self.down_cells.append(new_cell(channels, keep_input=True))
            channels = self.down_cells[-1].out_channels
            skips.append(channels)
            self.down_transitions.append(
                GroupedSequential(
                    GroupBatchNorm2d(channels),
                    nn.ReLU(),
                    nn.Conv2d(channels, channels, 1, bias=False),
                    nn.MaxPool2d(2),
                )
            )
        self.bottleneck = new_cell(channels, keep_input=False)
        channels = self.bottleneck.out_channels
        self.up_transitions, self.up_cells = nn.ModuleList(), nn.ModuleList()
        for i, skip in enumerate(reversed(skips)):
            self.up_transitions.append(_transition_up(channels, bias=False))
            self.up_cells.append(new_cell(channels + skip, keep_input=i == num_down - 1))
            channels = self.up_cells[-1].out_channels
        self.final_conv = nn.Conv2d(channels, num_classes, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init (fan-out) for convs as in the research code; BN to identity; zero bias."""
        research_init_(self)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """(i, j) of each row of alpha: the cell's edges for the down, then the up structure."""
        return self.bottleneck.edges * 2

    def edge_names(self) -> list[str]:
        """Labels of the rows of alpha, e.g. "down 0→1", ..., "up 3→4"."""
        return [f"{part} {i}→{j}" for part in ("down", "up") for i, j in self.bottleneck.edges]

    def forward(self, x: Tensor, alpha: Tensor, replicate: bool = False) -> Tensor:
        """Logits (b*G, num_classes, H, W); row r uses ``alpha[r mod G]`` ((G, 2E, K) or (2E, K)).

        ``replicate=True``: ``x`` holds b examples, each evaluated under every structure;
        equals ``forward(x.repeat_interleave(G, 0), alpha)``.
        """
        alpha = _check_alpha(self, x, alpha, replicate)
        groups = alpha.shape[0]
        down, up = alpha[:, self.structure_slices["down"]], alpha[:, self.structure_slices["up"]]
        x, crop = _pad_to_multiple(x, 2**self.num_down)
        x = self.first_conv(x)
        skips, expand = [], replicate
        for cell, transition in zip(self.down_cells, self.down_transitions):
            x = cell(x, down, expand=expand)
            expand = False
            skips.append(x)
            x = transition(x, groups)
        x = self.bottleneck(x, down, expand=expand)
        for transition, cell, skip in zip(self.up_transitions, self.up_cells, reversed(skips)):
            x = cell(torch.cat([transition(x), skip], dim=1), up)
        return self.final_conv(x)[..., crop[0], crop[1]]
