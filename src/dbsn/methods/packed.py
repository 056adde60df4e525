"""Packed-Ensembles (Laurent et al., ICLR 2023): M members in the channels of one network.

The network is rebuilt by `dbsn.nets.packed.pack` with α times the channels and grouped
convolutions (M·γ groups), so that M independent networks of α·c / M channels each run in one
forward pass; its logits are (b, M·C). Each member sees every example of the batch (no batch
repetition: the members are in the channels), the loss is the members' mean NLL, and prediction
averages the M members' probabilities like a deep ensemble. On DBSN's cell network every member
uses MAP's point structure (one α for all members), on a residual network α only counts the
members (`SinglePassEnsemble`).

The defaults are the authors' CIFAR settings (torch-uncertainty,
`experiments/classification/cifar10/configs/resnet18/packed.yaml` and
`wideresnet28x10/packed.yaml`): M = 4, α = 2, γ = 2, with γ lowered where a group would have
fewer than 64 input channels (`PackedConv2d`'s `minimum_channels_per_group`).
"""

from __future__ import annotations

from torch import Tensor, nn

from dbsn.methods.single_pass import SinglePassEnsemble
from dbsn.nets.packed import pack


class PackedEnsemble(SinglePassEnsemble):
    """Packed-Ensembles of M = `size` members (see the module docstring).

    Args:
        net: the network to pack (rebuilt in place: its layers are replaced, its weights not
            kept); the stem is its first `nn.Conv2d`, the head its `classifier`.
        size: M, the number of members.
        alpha: α, the width factor of every layer.
        gamma: γ, subgroups per member in the inner convolutions.
        min_channels_per_group: fewest input channels per group before γ is lowered (64).
        settings: `SinglePassEnsemble`'s and `MAP`'s settings.
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        size: int = 4,
        alpha: float = 2,
        gamma: int = 2,
        min_channels_per_group: int = 64,
        **settings,
    ) -> None:
        super().__init__(
            pack(net, alpha, gamma, size, min_channels_per_group=min_channels_per_group), size=size, **settings
        )
        # `alpha` is the structure (MAP.alpha); the width factor is `width_factor`
        self.width_factor, self.subgroups, self.min_channels_per_group = alpha, gamma, min_channels_per_group

    def network(self, x: Tensor, alpha: Tensor) -> Tensor:
        """Logits (b·M, C), row i·M + m for member m on example i, from one forward of the packed
        network under one structure (the members share the point structure: `alpha` holds it M
        times)."""
        logits = super().network(x, alpha[:1])  # (b, M·C), member m's at columns m·C ...
        return logits.reshape(x.shape[0] * self.size, -1)

    # ------------------------------------------------------------------ what detection scores read
    def member_features(self, head_input: Tensor, batch: int) -> Tensor:
        """Member m's features are its block of the packed head's input: (M, b, α·F / M)."""
        return head_input.flatten(1).view(batch, self.size, -1).transpose(0, 1)

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]]:
        """Member m's block of the packed head (`PackedLinear`, M groups)."""
        head = self.feature_head()
        weight = head.weight.detach().view(self.size, -1, head.weight.shape[1])
        bias = weight.new_zeros(weight.shape[:2]) if head.bias is None else head.bias.detach().view(self.size, -1)
        return [(weight[m % self.size], bias[m % self.size]) for m in range(n)]
