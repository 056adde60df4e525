"""The structure-learnable classification network of DBSN (paper Appendix B)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn

from dbsn.nets.fused_cell import cell_class
from dbsn.nets.ops import OPS, GroupBatchNorm2d, GroupedSequential, research_init_


class StructureNet(nn.Module):
    """Stem, ``num_stages`` stages of cells with transitions between, and a linear head.

    The network knows nothing about distributions: ``forward(x, alpha)`` takes
    the structure explicitly. ``alpha`` of shape (G, E, K) holds G structures,
    each one (E, K) matrix shared by all cells; the batch is split into G
    interleaved groups, row r computed under ``alpha[r mod G]`` (so
    ``net(x.repeat_interleave(G, 0), alpha)`` runs every example under every
    structure, and ``.view(b, G, -1)`` separates them again), so one
    forward evaluates G structure samples with shared weights. In training mode
    every BatchNorm uses per-group statistics, so this equals G separate
    forwards.

    Defaults are the paper's CIFAR model (B = 7, 3 x 4 cells, about 1.0M
    parameters for 10 classes). ``num_nodes=4, cells_per_stage=1`` is the
    small model of the VOGN comparison (about 41K parameters).

    ``cell``: "fused" (`dbsn.nets.fused_cell.FusedCell`, the default: the ops of each node's
    out-edges run together, about a fifth of the operations) or "per_edge" (`dbsn.nets.cell.Cell`,
    every edge's ops one by one: the reference, and what methods that transform every edge's
    layers need). Both compute the same function and load each other's checkpoints.
    """

    def __init__(
        self,
        num_classes: int,
        num_nodes: int = 7,
        cells_per_stage: int = 4,
        num_stages: int = 3,
        growth: int = 16,
        stem_channels: int = 32,
        compression: float = 0.4,
        ops: Sequence[str] = ("zero", "identity", "sep_conv_3x3", "dil_conv_3x3"),
        in_channels: int = 3,
        cell: str = "fused",
    ):
        super().__init__()
        unknown = [name for name in ops if name not in OPS]
        if unknown:
            raise ValueError(f"unknown op name(s) {unknown}; valid names are {list(OPS)}")
        self.num_classes = num_classes
        self.op_names = list(ops)
        self.num_ops = len(self.op_names)
        self.num_edges = num_nodes * (num_nodes - 1) // 2
        self.cell = cell
        make_cell = cell_class(cell)

        self.stem = nn.Conv2d(in_channels, stem_channels, 3, padding=1, bias=False)
        channels = stem_channels
        self.stages = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for s in range(num_stages):
            if s > 0:
                reduced = int(math.floor(compression * channels))
                self.transitions.append(
                    GroupedSequential(
                        GroupBatchNorm2d(channels),
                        nn.ReLU(),
                        nn.Conv2d(channels, reduced, 1, bias=False),
                        nn.AvgPool2d(2),
                    )
                )
                channels = reduced
            stage = nn.ModuleList()
            for _ in range(cells_per_stage):
                stage.append(make_cell(channels, num_nodes, growth, self.op_names))
                channels = stage[-1].out_channels
            self.stages.append(stage)
        self.head = GroupedSequential(
            GroupBatchNorm2d(channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(channels, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init (fan-out) for convs as in the research code; BN to identity; zero bias."""
        research_init_(self)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """(i, j) of each row of alpha, in order (the same for every cell)."""
        return self.stages[0][0].edges

    def forward(self, x: Tensor, alpha: Tensor, replicate: bool = False) -> Tensor:
        """Logits (b*G, num_classes) for ``x`` (b*G, C, H, W); row r uses ``alpha[r mod G]``.

        ``alpha`` is (G, E, K), or (E, K) for a single structure. With ``replicate=True``,
        ``x`` holds b examples and each is evaluated under every structure: the result equals
        ``forward(x.repeat_interleave(G, 0), alpha)``, but the structure-independent prefix
        (stem and the first cell's input projection) runs once instead of G times.
        """
        alpha = self._check_alpha(x, alpha, replicate)
        groups = alpha.shape[0]
        x = self.stem(x)
        expand = replicate
        for s, stage in enumerate(self.stages):
            if s > 0:
                x = self.transitions[s - 1](x, groups)
            for cell in stage:
                x = cell(x, alpha, expand=expand)
                expand = False
        return self.classifier(self.head(x, groups))

    def _check_alpha(self, x: Tensor, alpha: Tensor, replicate: bool = False) -> Tensor:
        if alpha.dim() == 2:
            alpha = alpha.unsqueeze(0)
        expected = (self.num_edges, self.num_ops)
        if alpha.dim() != 3 or tuple(alpha.shape[1:]) != expected:
            raise ValueError(
                f"alpha must have shape (G, {expected[0]}, {expected[1]}) or {expected} "
                f"(edges x ops {self.op_names}), got {tuple(alpha.shape)}"
            )
        if alpha.shape[0] == 0 or (not replicate and x.shape[0] % alpha.shape[0] != 0):
            raise ValueError(
                f"batch size {x.shape[0]} is not divisible by the number of structures "
                f"G = {alpha.shape[0]} (alpha of shape {tuple(alpha.shape)})"
            )
        return alpha
