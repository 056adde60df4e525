"""VGG16 with BatchNorm for 32x32 images: the network of the NEK-FAC baseline.

The DBSN paper compares with NEK-FAC "on a VGG16 with BN (3.7M parameters)". That is the VGG16
of the noisy-K-FAC / NEK-FAC code (Zhang et al. 2018; Bae et al. 2018), which has half the
filters of the ImageNet VGG16: 13 conv3x3-BN-ReLU layers

    32, 32, M, 64, 64, M, 128 x 3, M, 256 x 3, M, 256 x 3, M

(M = 2x2 max pooling; the last block keeps 256 channels instead of doubling) and a single
Linear(256, C) classifier on the 1x1 map left after five poolings. At ``width=1`` on CIFAR-10
this is 3,686,954 parameters (convolutions with bias as in that code: 3,680,160; BatchNorm
affine: 4,224; classifier: 2,570). Halving the standard 64..512 VGG16 is the only reading
that gives 3.7M: the full-width VGG16-BN with a 512 -> 10 head has 14.7M, and any VGG16 with
the usual 4096-wide fully connected head has more than 15M. ``width`` scales every conv's
channels (``width=0.25``: 8, 16, 32, 64, 64, about 0.23M parameters; for tests and CPUs).

It is a `Backbone` (a network without structure, ``num_edges = num_ops = 0``): the method
classes call it as they call the structure-learnable networks. As in ``StructureNet``, the
batch holds G interleaved groups and in training mode BatchNorm normalises each group with its
own statistics.
"""

from __future__ import annotations

from torch import Tensor, nn

from dbsn.nets.backbone import Backbone
from dbsn.nets.ops import GroupBatchNorm2d, GroupedSequential, research_init_

__all__ = ["VGG16BN"]

# Output channels of the 13 convolutions at width 1, "M" = 2x2 max pooling.
VGG16_CHANNELS = (32, 32, "M", 64, 64, "M", 128, 128, 128, "M", 256, 256, 256, "M", 256, 256, 256, "M")


class VGG16BN(Backbone):
    """VGG16-BN for 32x32 inputs (see the module docstring); conv bias as in the NEK-FAC code."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__(num_classes)
        if width <= 0:
            raise ValueError(f"width must be > 0, got {width}")
        layers: list[nn.Module] = []
        channels = in_channels
        for spec in VGG16_CHANNELS:
            if spec == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out = max(1, round(spec * width))
            layers += [nn.Conv2d(channels, out, 3, padding=1), GroupBatchNorm2d(out), nn.ReLU()]
            channels = out
        self.features = GroupedSequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())  # 1x1 already at 32x32 inputs
        self.classifier = nn.Linear(channels, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init (fan-out) for convs, BN to identity, zero biases (as ``StructureNet``)."""
        research_init_(self)

    def logits(self, x: Tensor, groups: int) -> Tensor:
        return self.classifier(self.pool(self.features(x, groups)))
