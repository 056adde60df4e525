"""Masksembles (Durasov, Bagautdinov, Baque & Fua, CVPR 2021): M members that are M fixed channel
masks of one network.

The network transform (`dbsn.nets.masksembles`) masks the input channels of every convolution but
the stem and of the head, each layer with its own M masks drawn once, at the overlap the scale sets;
this method trains and predicts with them. It follows torch-uncertainty's masked ResNet and
WideResNet (`torch_uncertainty/models/classification/{resnet,wideresnet}/masked.py`, their routine
with `RepeatTarget`), whose mask generation is the authors' (nikitadurasov/masksembles):

- every batch, in training and at test, is repeated M times (their `x.repeat(num_estimators, ...)`),
  so each member sees every example; the loss is the mean NLL over the M·b rows = the members' mean;
- BatchNorm is shared and normalises in training over the whole repeated batch (their plain
  `BatchNorm2d` over the M·b rows); at test (running statistics) member m's output depends only on
  the shared weights and its masks;
- prediction averages the M members' probabilities, all M from one forward pass of M·b rows.

The members are fixed: the masks are buffers, the same at every call and in every checkpoint. On
DBSN's cell network every member uses MAP's point structure (`SinglePassEnsemble`), and the masks
sit on the inputs of the cells' convolutions as on a residual network's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.methods.single_pass import SinglePassEnsemble
from dbsn.methods.weights import WeightPosterior
from dbsn.nets.masksembles import mask_overlap, masked_layers, masksembles
from dbsn.nets.ops import expand_groups


class Masksembles(SinglePassEnsemble):
    """Masksembles of M members on any network of `nn.Conv2d` / `nn.Linear` layers (see the module
    docstring); the network is transformed in place.

    Args:
        size: M, the number of members (torch-uncertainty's `num_estimators`, 4).
        scale: the masks' scale s (their 2): larger, less overlap between the members' channels
            (a pair's intersection over union about 1/(2s − 1)) and fewer channels per member.
        settings: `SinglePassEnsemble`'s, `MAP`'s and `Method`'s; the weights are point estimates.
    """

    def __init__(self, net: nn.Module, *, size: int = 4, scale: float = 2.0, **settings) -> None:
        weights = settings.get("weights")
        if weights is not None and type(weights) is not WeightPosterior:
            raise ValueError(
                f"Masksembles has point-estimate weights; it cannot take {type(weights).__name__} "
                "(leave model.weights unset)"
            )
        super().__init__(masksembles(net, size, scale), size=size, **settings)
        self.scale = scale

    def network(self, x: Tensor, alpha: Tensor) -> Tensor:
        """Every example under every member, row i·M + m (the batch repeated M times), one forward
        with BatchNorm statistics over all the rows."""
        if alpha.shape[0] != self.size:
            raise ValueError(
                f"Masksembles of M = {self.size} members takes {self.size} structures, got {alpha.shape[0]}"
            )
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(expand_groups(x, self.size), alpha[:1])  # one group: BatchNorm shared by the members

    def feature_head(self) -> nn.Module | None:
        """The head's own linear layer: its input is each member's masked features, on which its
        weight and bias give the member's logits (`member_heads`: the shared head)."""
        head = super().feature_head()
        return getattr(head, "layer", head)

    def run_facts(self) -> dict[str, float]:
        """The masks' mean intersection over union of a pair, over the masked layers (the overlap the
        scale sets), beside the method's other facts."""
        overlaps = [mask_overlap(layer.masks) for layer in masked_layers(self.net)]
        return {**super().run_facts(), "mask_iou": sum(overlaps) / len(overlaps)}
