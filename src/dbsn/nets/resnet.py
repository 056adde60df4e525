"""ResNet-18 for 32x32 images (He et al. 2016, CIFAR variant): the field's first backbone.

The uncertainty literature's ResNet-18 on CIFAR (TorchUncertainty, the SNGP and DUQ PyTorch
code) is the one of kuangliu/pytorch-cifar, which this follows layer for layer:

- stem: conv3x3(3 -> w, stride 1, no bias)-BN-ReLU, no max pooling;
- four stages of two ``BasicBlock`` s, w, 2w, 4w, 8w channels, strides 1, 2, 2, 2:
  conv3x3(stride)-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU; the shortcut is
  conv1x1(stride, no bias)-BN where the shape changes (option B of He et al.), else the identity;
- global average pooling and ``classifier``, a Linear(8w, C) with bias.

At ``width=64`` and 10 classes: 11,173,962 parameters (the published count); ``width=8``: 176 K,
for tests and CPUs (narrower needs ``model.execution.channels_last=false`` on a CPU: see
docs/methods.md, "Networks"). Initialisation: PyTorch's defaults, as kuangliu/pytorch-cifar;
BatchNorm at the identity. A `Backbone` whose BatchNorms are `GroupBatchNorm2d`, so a grouped
forward in training mode equals G separate forwards.
"""

from __future__ import annotations

from torch import Tensor, nn

from dbsn.nets.backbone import Backbone
from dbsn.nets.ops import GroupBatchNorm2d, GroupedSequential

__all__ = ["BasicBlock", "ResNet18", "ResidualStage"]


class ResidualStage(nn.Sequential):
    """Residual blocks applied in order, each given the number of groups of the batch."""

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:  # type: ignore[override]
        for block in self:
            x = block(x, groups)
        return x


class BasicBlock(nn.Module):
    """Post-activation basic block: ReLU(BN(conv(ReLU(BN(conv(x))))) + shortcut(x))."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = GroupBatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = GroupBatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.shortcut = GroupedSequential()  # the identity
        if stride != 1 or in_channels != channels:
            self.shortcut = GroupedSequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), GroupBatchNorm2d(channels)
            )

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:
        y = self.relu(self.bn1(self.conv1(x), groups))
        y = self.bn2(self.conv2(y), groups)
        return self.relu(y + self.shortcut(x, groups))


class ResNet18(Backbone):
    """ResNet-18, CIFAR variant (see the module docstring).

    Args:
        num_classes: C.
        in_channels: channels of the input images.
        width: channels of the stem and the first stage (64 in the published network); the
            stages have width, 2 width, 4 width, 8 width.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 64) -> None:
        super().__init__(num_classes)
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn1 = GroupBatchNorm2d(width)
        self.relu = nn.ReLU()
        channels = width
        for index, (multiple, stride) in enumerate(((1, 1), (2, 2), (4, 2), (8, 2)), start=1):
            stage = ResidualStage(
                BasicBlock(channels, multiple * width, stride), BasicBlock(multiple * width, multiple * width)
            )
            setattr(self, f"layer{index}", stage)
            channels = multiple * width
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(channels, num_classes)

    def features(self, x: Tensor, groups: int = 1) -> Tensor:
        """The last stage's map, (b, 8 width, H/8, W/8)."""
        x = self.relu(self.bn1(self.conv1(x), groups))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x, groups)
        return x

    def logits(self, x: Tensor, groups: int) -> Tensor:
        return self.classifier(self.pool(self.features(x, groups)))
