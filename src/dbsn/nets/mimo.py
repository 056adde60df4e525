"""The multi-input multi-output network of MIMO (Havasi et al., ICLR 2021): M subnetworks inside
one network, each with an input and a head of its own.

`mimo(net, size)` turns any network that follows dbsn's conventions into its MIMO version, in
place: the stem (the first ``nn.Conv2d`` of ``net.modules()``; `StructureNet`'s ``stem``) takes
the M images concatenated on the channel axis, channel ``m · C_in + c`` holding channel c of
member m's image (the authors' Keras model interleaves them, ``c · M + m``: a permutation of
the stem's input channels that the i.i.d. initialisation does not see); ``classifier`` gives M
heads, head m in columns ``m · C .. (m + 1) · C - 1`` (the authors' ``DenseMultihead``);
everything between is shared. The network still reports ``num_classes`` = C; its forward returns
(b, M · C), and `dbsn.methods.MIMO` builds the inputs and splits the heads.

Initialisation: the new stem's weights are N(0, s² / M), s the standard deviation of the replaced
stem's (a fan-in initialisation over M · C_in channels, as the authors' ``he_normal``, so the
stem's output keeps its scale); the heads' N(0, s_h²), s_h that of the replaced classifier;
biases zero. A network with M = 1 keeps its layers untouched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["mimo", "mimo_size", "stem_of"]


def stem_of(net: nn.Module) -> tuple[nn.Module, str, nn.Conv2d]:
    """The first ``nn.Conv2d`` of ``net.modules()``, with its parent module and attribute name."""
    for path, module in net.named_modules():
        if isinstance(module, nn.Conv2d):
            parent, _, name = path.rpartition(".")
            return net.get_submodule(parent), name, module
    raise ValueError(f"{type(net).__name__} has no nn.Conv2d: MIMO widens the network's first convolution (its stem)")


def mimo_size(net: nn.Module) -> int:
    """M of a network `mimo` transformed (1 for any other)."""
    return getattr(net, "mimo_size", 1)


def _normal_like(weight: torch.Tensor, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    std = weight.detach().float().std().item() if weight.numel() > 1 else 0.0
    std = std if math.isfinite(std) and std > 0 else 1.0 / math.sqrt(max(1, weight[0].numel()))
    return torch.randn(shape, dtype=weight.dtype, device=weight.device) * std * scale


def mimo(net: nn.Module, size: int) -> nn.Module:
    """`net` with M = `size` inputs and M heads (see the module docstring), changed in place and
    returned."""
    if size < 1:
        raise ValueError(f"size (M, the number of MIMO subnetworks) must be >= 1, got {size}")
    if mimo_size(net) != 1:
        raise ValueError(f"{type(net).__name__} is already a MIMO network with M = {mimo_size(net)}")
    classifier = getattr(net, "classifier", None)
    if not isinstance(classifier, nn.Linear):
        raise ValueError(
            f"{type(net).__name__} has no `classifier` nn.Linear: MIMO gives the network one head per "
            "member by widening it"
        )
    parent, name, stem = stem_of(net)
    if stem.groups != 1:
        raise ValueError(
            f"the stem of {type(net).__name__} ({name}) is a grouped convolution (groups = {stem.groups}); "
            "MIMO concatenates the members' images on its input channels and needs groups = 1"
        )
    if size == 1:
        return net
    wide = nn.Conv2d(
        stem.in_channels * size,
        stem.out_channels,
        stem.kernel_size,
        stride=stem.stride,
        padding=stem.padding,
        dilation=stem.dilation,
        bias=stem.bias is not None,
        padding_mode=stem.padding_mode,
        device=stem.weight.device,
        dtype=stem.weight.dtype,
    )
    heads = nn.Linear(
        classifier.in_features,
        classifier.out_features * size,
        bias=classifier.bias is not None,
        device=classifier.weight.device,
        dtype=classifier.weight.dtype,
    )
    with torch.no_grad():
        wide.weight.copy_(_normal_like(stem.weight, tuple(wide.weight.shape), 1.0 / math.sqrt(size)))
        heads.weight.copy_(_normal_like(classifier.weight, tuple(heads.weight.shape), 1.0))
        for layer in (wide, heads):
            if layer.bias is not None:
                layer.bias.zero_()
    setattr(parent, name, wide)
    net.classifier = heads
    net.mimo_size = size
    return net
