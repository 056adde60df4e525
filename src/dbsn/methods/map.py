"""Point-estimate structure baselines (paper, Appendix B.2): MAP and MAP-fixed α.

- MAP: α = softmax(θ), θ learned jointly with the weights (Adam, as DBSN's θ), L2 on weights.
- MAP-fixed α: α = 1/K on every edge; no θ.

With a stochastic weight posterior these are the paper's MC dropout and BBB (Gaussian weights,
MAP structure) baselines. MC dropout is "a variant of MAP" (learned θ); its default puts
dropout on every cell node's output, the research code's placement that produced the paper's
numbers; `MCDropoutWeights(placement="every_conv")` puts it after every convolution, as the
paper's text says. Either also runs on MAP-fixed α.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.methods.base import Method
from dbsn.methods.settings import StructureOptimizer


class MAP(Method):
    """A single point-estimate structure: learned softmax(θ) or the fixed uniform α.

    Args:
        structure_optim: Adam settings for θ (a learned structure).
        learn_structure: learn θ (MAP) or keep α fixed (MAP-fixed α).
        fixed_structure: the fixed α, (E, K) (e.g. a structure sampled from a DBSN posterior,
            see `dbsn.tools.refine`); default 1/K on every edge. Only with `learn_structure=False`.
        theta_init_std: θ ~ theta_init_std · N(0, 1) (DARTS' 1e-3).
        settings: `Method`'s settings: weights (point estimates: MAP; `MCDropoutWeights`: MC
            dropout; `GaussianWeights`: BBB), prediction (S for stochastic weights;
            deterministic methods predict with one pass), optim, execution, task, dataset_size.
    """

    variant_keys = (*Method.variant_keys, "learn_structure")  # learn_structure=false: MAP-fixed α

    def __init__(
        self,
        net: nn.Module,
        *,
        structure_optim: StructureOptimizer | None = None,
        learn_structure: bool = True,
        fixed_structure: Tensor | None = None,
        theta_init_std: float = 1e-3,
        **settings,
    ) -> None:
        super().__init__(net, **settings)
        if learn_structure and fixed_structure is not None:
            raise ValueError("fixed_structure is only used with learn_structure=False")
        # A network without structure (a `Backbone`: num_edges = 0) has no θ to learn: there MAP
        # and MAP-fixed α are one method, the network alone (mc_dropout, bbb on ResNet-18 too).
        self.learn_structure = learn_structure = learn_structure and net.num_edges > 0
        self.structure_optim = structure_optim if structure_optim is not None else StructureOptimizer()
        shape = (net.num_edges, net.num_ops)
        if learn_structure:
            self.theta = nn.Parameter(theta_init_std * torch.randn(shape))
        else:
            alpha = (
                torch.full(shape, 1.0 / max(net.num_ops, 1))
                if fixed_structure is None
                else torch.as_tensor(fixed_structure, dtype=torch.float32)
            )
            if alpha.shape != shape or not torch.allclose(alpha.sum(-1), torch.ones(shape[0])) or (alpha < 0).any():
                raise ValueError(f"fixed_structure must be {shape} with rows on the simplex, got {tuple(alpha.shape)}")
            self.register_buffer("fixed_alpha", alpha)

    def structure_parameters(self) -> list[nn.Parameter]:
        return [self.theta] if self.learn_structure else []

    def cuda_graph_refusal(self) -> str | None:
        return self.weights.cuda_graph_refusal()

    def structure_optimizer(self) -> StructureOptimizer:
        return self.structure_optim

    def alpha(self) -> Tensor:
        """The point-estimate structure: softmax(θ), or the fixed α; (E, K)."""
        return torch.softmax(self.theta, dim=-1) if self.learn_structure else self.fixed_alpha

    def training_structures(self, n: int) -> tuple[Tensor, float]:
        return self.alpha().unsqueeze(0), 0.0

    @torch.no_grad()
    def structure_probabilities(self) -> Tensor | None:
        """softmax(θ) when learned; None for a fixed α."""
        return self.alpha().detach().clone() if self.learn_structure else None

    def prediction_structures(self, n: int, first: int = 0) -> Tensor:
        return self.alpha().detach().expand(n, -1, -1)
