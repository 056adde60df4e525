"""BatchEnsemble layers (Wen, Tran & Ba, ICLR 2020): M members that share one slow weight.

Member m's weight is the shared ("slow") weight W times a rank-1 "fast" weight, W ∘ s_m r_mᵀ
(paper, Eq. 1), computed without forming it (Eq. 2): y = (W (x ∘ r_m)) ∘ s_m + b_m for a linear
layer, the same per channel for a convolution. b_m is the member's own bias (where the layer
has one, as edward2's layers). A batch holds the members' rows *interleaved*: row r belongs to
member r mod M, so `x.repeat_interleave(M, 0)` evaluates every example under every member.

`batch_ensemble(net, M)` swaps every `nn.Conv2d` and `nn.Linear` of a network for these layers in
place, keeping their weights as the slow weights (depthwise convolutions become edward2's
`DepthwiseConv2DBatchEnsemble`). BatchNorm stays shared; `dbsn.methods.BatchEnsemble` decides
which rows its statistics cover. The fast weights start as the authors' `random_sign_init`
(uncertainty-baselines): p > 0 draws random signs, +1 with probability p; p ≤ 0 draws N(1, p²)
(their CIFAR default −0.5); 0 sets them to 1, every member the slow network. Member biases start
as copies of the slow bias.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "BatchEnsembleConv2d",
    "BatchEnsembleLinear",
    "batch_ensemble",
    "fast_parameters",
    "init_fast_weights_",
    "member_biases",
    "swap_layers",
]


def init_fast_weights_(tensor: Tensor, random_sign_init: float) -> Tensor:
    """The authors' initialisation of fast weights, in place (see the module docstring)."""
    with torch.no_grad():
        if random_sign_init > 0:
            return tensor.copy_(2 * torch.bernoulli(torch.full_like(tensor, random_sign_init)) - 1)
        return tensor.normal_(1.0, -random_sign_init)


class _BatchEnsembleLayer(nn.Module):
    """A slow layer (`layer`, without its bias) with M members' fast weights r (M, in),
    s (M, out) and, where the slow layer had a bias, member biases (M, out)."""

    def __init__(
        self, layer: nn.Module, size: int, in_features: int, out_features: int, random_sign_init: float
    ) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"size (M, the number of members) must be >= 1, got {size}")
        self.size = size
        bias = layer.bias
        layer.register_parameter("bias", None)  # the slow layer keeps only its weight
        self.layer = layer
        self.r = nn.Parameter(init_fast_weights_(layer.weight.new_empty(size, in_features), random_sign_init))
        self.s = nn.Parameter(init_fast_weights_(layer.weight.new_empty(size, out_features), random_sign_init))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone().unsqueeze(0).repeat(size, 1))

    def _rows(self, p: Tensor, x: Tensor) -> Tensor:
        """p (G, C) per row of x (row r: p[r mod G]), shaped to broadcast against x's channels; G is
        M here (a rank-1 BNN's held members pass their own)."""
        if x.shape[0] % p.shape[0]:
            raise ValueError(
                f"a BatchEnsemble layer of M = {p.shape[0]} members needs a batch of whole member "
                f"groups (rows interleaved, row r = member r mod M); got {x.shape[0]} rows"
            )
        rows = p.repeat(x.shape[0] // p.shape[0], 1)  # (b·G, C)
        ones = (1,) * (x.dim() - 2)
        return rows.view(*rows.shape, *ones) if self.channels_first else rows.view(rows.shape[0], *ones, -1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.layer(x * self._rows(self.r, x)) * self._rows(self.s, x)
        return y if self.bias is None else y + self._rows(self.bias, x)


class BatchEnsembleConv2d(_BatchEnsembleLayer):
    """`nn.Conv2d` (grouped and depthwise too) with M members' rank-1 fast weights: r scales the
    input channels, s the output channels (edward2's `Conv2DBatchEnsemble`,
    `DepthwiseConv2DBatchEnsemble`)."""

    channels_first = True

    def __init__(self, conv: nn.Conv2d, size: int, random_sign_init: float = -0.5) -> None:
        super().__init__(conv, size, conv.in_channels, conv.out_channels, random_sign_init)


class BatchEnsembleLinear(_BatchEnsembleLayer):
    """`nn.Linear` with M members' rank-1 fast weights (edward2's `DenseBatchEnsemble`)."""

    channels_first = False  # (b, ..., C)

    def __init__(self, linear: nn.Linear, size: int, random_sign_init: float = -0.5) -> None:
        super().__init__(linear, size, linear.in_features, linear.out_features, random_sign_init)


def batch_ensemble(net: nn.Module, size: int, random_sign_init: float = -0.5) -> nn.Module:
    """Make `net` a BatchEnsemble of `size` members in place: every `nn.Conv2d` and `nn.Linear`
    becomes a `BatchEnsembleConv2d` / `BatchEnsembleLinear` around it (its weight the slow
    weight); BatchNorm and everything else stays shared. Returns `net`, which then takes
    batches of whole member groups (row r = member r mod `size`)."""
    return swap_layers(
        net,
        lambda conv: BatchEnsembleConv2d(conv, size, random_sign_init),
        lambda linear: BatchEnsembleLinear(linear, size, random_sign_init),
    )


def swap_layers(net: nn.Module, conv, linear) -> nn.Module:
    """Every `nn.Conv2d` of `net` replaced by `conv(it)`, every `nn.Linear` by `linear(it)`, in
    place, in the order of `net.modules()` (layers already wrapped are left alone): the network
    transform of BatchEnsemble and of the rank-1 BNN (`dbsn.nets.rank1`). Returns `net`."""
    swapped = 0
    for parent in list(net.modules()):
        if isinstance(parent, _BatchEnsembleLayer):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, conv(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, linear(child))
            else:
                continue
            swapped += 1
    if swapped == 0:
        raise ValueError(f"{type(net).__name__} has no nn.Conv2d or nn.Linear layer to give fast weights")
    return net


def _layers(net: nn.Module) -> list[_BatchEnsembleLayer]:
    return [m for m in net.modules() if isinstance(m, _BatchEnsembleLayer)]


def fast_parameters(net: nn.Module) -> list[nn.Parameter]:
    """The fast weights r and s of every BatchEnsemble layer of `net`."""
    return [p for m in _layers(net) for p in (m.r, m.s)]


def member_biases(net: nn.Module) -> list[nn.Parameter]:
    """The members' biases of every BatchEnsemble layer of `net` (layers with a bias only)."""
    return [m.bias for m in _layers(net) if m.bias is not None]
