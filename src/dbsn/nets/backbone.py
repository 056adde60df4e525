"""Networks without a structure to learn: the interface that lets every method which does not
need DBSN's cell (MAP-fixed α, MC dropout, BBB, deep ensembles, NEK-FAC, the post-hoc posteriors)
use them unchanged.

A method calls its network as `net(x, alpha, replicate=True)` with α of shape (G, E, K): G
structures (or Monte Carlo members), each example of the batch evaluated under every one, rows
interleaved (row i*G + g: example i, member g). A network without structure has E = K = 0: α only
says how many groups G the batch holds. `Backbone.forward` turns α into G, replicates the batch
when asked, and calls `logits(x, groups)`; a subclass defines that. Its BatchNorm layers may be
`GroupBatchNorm2d`, which normalise each group with its own statistics in training (as the
cells do); with one group per step (T = 1, every method but DBSN's) a plain `nn.BatchNorm2d`
behaves the same.
"""

from __future__ import annotations

from torch import Tensor, nn

from dbsn.nets.ops import expand_groups

__all__ = ["Backbone", "groups_of"]


def groups_of(alpha: Tensor | None) -> int:
    """G, the number of groups α (G, 0, 0) or (0, 0) gives a network without structure (1 for None)."""
    if alpha is None:
        return 1
    if alpha.dim() == 2:
        alpha = alpha.unsqueeze(0)
    if alpha.dim() != 3 or alpha.shape[1:] != (0, 0) or alpha.shape[0] == 0:
        raise ValueError(
            f"a network with no structure takes alpha of shape (G, 0, 0) or (0, 0), got {tuple(alpha.shape)}"
        )
    return alpha.shape[0]


class Backbone(nn.Module):
    """A classifier without a structure to learn (see the module docstring).

    Subclasses call `super().__init__(num_classes)`, build their layers and define
    `logits(x, groups)`. Name the last layer `classifier` (an `nn.Linear` on the features): the
    last-layer Laplace and the head-based post-hoc posteriors read it.
    """

    num_edges = 0
    num_ops = 0

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.edges: list[tuple[int, int]] = []
        self.op_names: list[str] = []

    def forward(self, x: Tensor, alpha: Tensor | None = None, replicate: bool = False) -> Tensor:
        """Logits (b·G, num_classes) of x under the G groups α gives (default 1); with
        `replicate`, every example of x is evaluated in every group."""
        groups = groups_of(alpha)
        if replicate and groups > 1:
            x = expand_groups(x, groups)
        elif x.shape[0] % groups != 0:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by the number of groups G = {groups}")
        return self.logits(x, groups)

    def logits(self, x: Tensor, groups: int) -> Tensor:
        """Logits (b, num_classes) of a batch holding `groups` interleaved groups."""
        raise NotImplementedError
