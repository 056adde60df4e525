"""BatchEnsemble (Wen, Tran & Ba, ICLR 2020): M members sharing slow weights, each with rank-1 fast weights.

The network transform (`dbsn.nets.batch_ensemble`) gives every convolution and linear layer M
members' fast weights r_m, s_m (and member biases) around its shared weight; this method trains
and predicts with them, following the authors' CIFAR code (uncertainty-baselines
`baselines/cifar/batchensemble.py`; edward2's `Conv2DBatchEnsemble` / `DenseBatchEnsemble`):

- every training batch is repeated M times (`tf.tile`), so each member sees every example; the
  loss is the mean NLL over the M·b rows (= the members' mean NLL);
- BatchNorm is shared and in training normalises over the whole repeated batch, which couples the
  members; at test (running statistics) member m depends only on the shared and its own weights;
- fast weights start at N(1, 0.5²) (`random_sign_init=-0.5`; p > 0: random signs, P(+1) = p);
- the fast weights and member biases take `fast_weight_lr_multiplier` (0.5) times the lr; the
  fast weights get no weight decay, the member biases the slow weights';
- prediction averages the M members' probabilities, all M from one forward pass.

On DBSN's cell network every member uses MAP's point structure (`SinglePassEnsemble`). Sources
of each setting: docs/field.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.methods.single_pass import SinglePassEnsemble
from dbsn.methods.weights import WeightPosterior
from dbsn.nets.batch_ensemble import batch_ensemble, fast_parameters, member_biases
from dbsn.nets.ops import expand_groups


class BatchEnsemble(SinglePassEnsemble):
    """BatchEnsemble of M members on any network of `nn.Conv2d` / `nn.Linear` layers (see the
    module docstring); the network is transformed in place.

    Args:
        size: M, the number of members (the authors' 4).
        random_sign_init: initialisation of the fast weights (the authors' flag): p > 0 random
            signs with P(+1) = p, p <= 0 N(1, p²), 0 every fast weight 1.
        fast_weight_lr_multiplier: the fast weights' and member biases' lr, as a multiple of the
            weights' lr (the authors' 0.5).
        settings: `SinglePassEnsemble`'s, `MAP`'s and `Method`'s; the weights are point
            estimates.
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        size: int = 4,
        random_sign_init: float = -0.5,
        fast_weight_lr_multiplier: float = 0.5,
        **settings,
    ) -> None:
        weights = settings.get("weights")
        if weights is not None and type(weights) is not WeightPosterior:
            raise ValueError(
                f"BatchEnsemble has point-estimate weights; it cannot take {type(weights).__name__} "
                "(leave model.weights unset)"
            )
        if fast_weight_lr_multiplier <= 0:
            raise ValueError(f"fast_weight_lr_multiplier must be > 0, got {fast_weight_lr_multiplier}")
        if size < 1:
            raise ValueError(f"size (M, the number of members) must be >= 1, got {size}")
        super().__init__(batch_ensemble(net, size, random_sign_init), size=size, **settings)
        self.random_sign_init = random_sign_init
        self.fast_weight_lr_multiplier = fast_weight_lr_multiplier

    def network(self, x: Tensor, alpha: Tensor) -> Tensor:
        """Every example under every member, row i·M + m (the batch repeated M times, as the
        authors' `tf.tile`), one forward with BatchNorm statistics over all the rows."""
        if alpha.shape[0] != self.size:
            raise ValueError(
                f"a BatchEnsemble of M = {self.size} members takes {self.size} structures, got {alpha.shape[0]}"
            )
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(expand_groups(x, self.size), alpha[:1])  # one group: BatchNorm shared by the members

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return super().no_decay_parameters() + fast_parameters(self.net)

    def lr_scales(self) -> dict[int, float]:
        return {id(p): self.fast_weight_lr_multiplier for p in fast_parameters(self.net) + member_biases(self.net)}

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]]:
        """Member m's last layer as one linear map: W_m = diag(s_m) W diag(r_m), b_m its bias."""
        head = self.feature_head()
        weight = head.layer.weight.detach()
        heads = []
        for m in range(n):
            r, s = head.r.detach()[m % self.size], head.s.detach()[m % self.size]
            bias = weight.new_zeros(weight.shape[0]) if head.bias is None else head.bias.detach()[m % self.size]
            heads.append((s[:, None] * weight * r[None, :], bias))
        return heads
