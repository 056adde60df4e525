"""Wide residual network WRN-depth-k (Zagoruyko & Komodakis 2016): the field's second backbone.

WideResNet-28-10 is the network of uncertainty-baselines' CIFAR tables (deterministic, MC
dropout, deep ensembles, BatchEnsemble, MIMO, SNGP). This follows the authors' code
(szagoruyko/wide-residual-networks, models/wide-resnet.lua) layer for layer:

- stem: conv3x3(3 -> 16, no bias), no BatchNorm after it (the blocks are pre-activation);
- three stages of n = (depth - 4) / 6 ``WideBlock`` s with 16k, 32k, 64k channels and strides
  1, 2, 2: BN-ReLU-conv3x3(stride)-BN-ReLU-[dropout]-conv3x3 plus the shortcut, conv1x1(stride,
  no bias) of the *pre-activated* input where the shape changes, the identity elsewhere;
- BN-ReLU, global average pooling and ``classifier``, a Linear(64k, C) with bias.

``dropout`` is the paper's (Sec. 2.4, rate 0.3 on CIFAR there); its layers exist at every rate,
so MC dropout's ``placement=existing`` finds them. WRN-28-10 at 10 classes has 36,479,194
parameters (the published count); ``depth=10, widen_factor=1`` is a 77 K version for tests.
Initialisation as the authors' (``MSRinit``, ``FCinit``): He normal with fan-out for every
convolution, zero Linear bias, BatchNorm at the identity (``research_init_``). A `Backbone` with
`GroupBatchNorm2d` everywhere, so a grouped forward in training mode equals G separate forwards.
"""

from __future__ import annotations

from torch import Tensor, nn

from dbsn.nets.backbone import Backbone
from dbsn.nets.ops import GroupBatchNorm2d, research_init_
from dbsn.nets.resnet import ResidualStage

__all__ = ["WideBlock", "WideResNet"]


class WideBlock(nn.Module):
    """Pre-activation wide basic block with dropout between its two convolutions."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.bn1 = GroupBatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = GroupBatchNorm2d(channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.shortcut = None
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False)

    def forward(self, x: Tensor, groups: int = 1) -> Tensor:
        activated = self.relu(self.bn1(x, groups))
        y = self.conv1(activated)
        y = self.conv2(self.dropout(self.relu(self.bn2(y, groups))))
        return y + (x if self.shortcut is None else self.shortcut(activated))


class WideResNet(Backbone):
    """WRN-depth-widen_factor (see the module docstring).

    Args:
        num_classes: C.
        depth: number of convolutional layers on the main path plus the head, 6n + 4 (28).
        widen_factor: k, the stages have 16k, 32k, 64k channels (10).
        dropout: rate of the dropout between the two convolutions of every block (0: none).
        in_channels: channels of the input images.
    """

    def __init__(
        self, num_classes: int, depth: int = 28, widen_factor: int = 10, dropout: float = 0.0, in_channels: int = 3
    ) -> None:
        super().__init__(num_classes)
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(f"depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, 40, ...), got {depth}")
        if widen_factor < 1:
            raise ValueError(f"widen_factor must be >= 1, got {widen_factor}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        blocks = (depth - 4) // 6
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        channels = 16
        for index, (multiple, stride) in enumerate(((16, 1), (32, 2), (64, 2)), start=1):
            out = multiple * widen_factor
            stage = ResidualStage(
                *(WideBlock(channels if b == 0 else out, out, stride if b == 0 else 1, dropout) for b in range(blocks))
            )
            setattr(self, f"layer{index}", stage)
            channels = out
        self.bn = GroupBatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(channels, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He normal (fan-out) convolutions, zero Linear bias, BatchNorm at the identity."""
        research_init_(self)

    def features(self, x: Tensor, groups: int = 1) -> Tensor:
        """The activated last stage's map, (b, 64k, H/4, W/4)."""
        x = self.conv1(x)
        for stage in (self.layer1, self.layer2, self.layer3):
            x = stage(x, groups)
        return self.relu(self.bn(x, groups))

    def logits(self, x: Tensor, groups: int) -> Tensor:
        return self.classifier(self.pool(self.features(x, groups)))
