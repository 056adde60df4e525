"""Networks that take the structure alpha as an input (no distributions here).

``OPS`` is the search space (op name -> constructor), ``Cell`` mixes ops along
its edges with alpha (paper Eq. 1), ``FusedCell`` computes the same with each node's
out-edges fused (the networks' default), and ``StructureNet`` stacks cells into the
classification network. ``FCDenseNet`` (FC-DenseNet67) and ``DBSNSegNet`` (its cells
version) are the CamVid segmentation networks. ``Backbone`` is the interface of a network
without structure (``VGG16BN``, the field's ``ResNet18`` and ``WideResNet``, or your own:
docs/extending.md).
"""

from dbsn.nets.backbone import Backbone
from dbsn.nets.cell import Cell
from dbsn.nets.classifier import StructureNet
from dbsn.nets.fcdensenet import DBSNSegNet, FCDenseNet
from dbsn.nets.fused_cell import FusedCell
from dbsn.nets.ops import OPS, GroupBatchNorm2d, GroupedSequential
from dbsn.nets.resnet import ResNet18
from dbsn.nets.vgg import VGG16BN
from dbsn.nets.wideresnet import WideResNet

__all__ = [
    "OPS",
    "Backbone",
    "Cell",
    "DBSNSegNet",
    "FCDenseNet",
    "FusedCell",
    "GroupBatchNorm2d",
    "GroupedSequential",
    "ResNet18",
    "StructureNet",
    "VGG16BN",
    "WideResNet",
]
