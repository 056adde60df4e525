"""What a method needs to know about its prediction task: classification or segmentation.

The methods (DBSN, MAP, MC dropout, BBB, ...) are written once. Everything that depends on
whether a network predicts one label per image, (N, C) logits, or one per pixel,
(N, C, H, W) logits, lives in a task object handed to the method (`model.task` in the config):

- the training loss (segmentation ignores the void label);
- how logits become *class-last* tensors, (..., C), so that the Bayes ensemble, the
  uncertainty decomposition and the metrics work unchanged on images and on pixels;
- which metrics are accumulated (`ClassificationMetrics` or `SegmentationMetrics`), and
  whether per-example test outputs are kept (for reliability diagrams and OOD scores; a
  segmentation test set has tens of millions of pixels, so only a few uncertainty maps are kept).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.precision import float32, full


class Classification:
    """One label per input: logits (N, C), targets (N,)."""

    ignore_index: int = -100  # torch's default: no label is ignored
    keeps_test_outputs = True  # the test pass keeps per-example log-probabilities and scores
    supports_ablation = True

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over the labelled entries, in float32 (at least) under mixed precision."""
        with float32():
            return F.cross_entropy(full(logits), targets, ignore_index=self.ignore_index)

    def error(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Fraction of labelled entries whose argmax class is wrong (class dimension 1)."""
        labelled = (
            targets != self.ignore_index
        )  # a mask, not an index: boolean indexing would read its size on the host
        return ((logits.argmax(1) != targets) & labelled).sum() / labelled.sum()

    @staticmethod
    def class_last(logits: Tensor) -> Tensor:
        """(N, C, ...) -> (N, ..., C); a no-op for (N, C)."""
        return logits.movedim(1, -1)

    @staticmethod
    def flatten(members: Tensor) -> Tensor:
        """Class-last members (S, N, ..., C) -> (S, M, C) with one row per labelled entry."""
        return members.flatten(1, -2)

    def make_metrics(self, num_classes: int) -> nn.Module:
        from dbsn.metrics.classification import ClassificationMetrics

        return ClassificationMetrics(num_classes)


class Segmentation(Classification):
    """One label per pixel: logits (N, C, H, W), targets (N, H, W), `ignore_index` = void.

    Args:
        ignore_index: the void label, left out of the loss and of every metric (CamVid: 11).
        class_names: names for the per-class metrics (`test/iou/<name>`).
        num_maps: test images whose pixel-wise uncertainty maps are kept and drawn.
    """

    keeps_test_outputs = False
    supports_ablation = False

    def __init__(self, ignore_index: int = 11, class_names: Sequence[str] | None = None, num_maps: int = 4) -> None:
        self.ignore_index = ignore_index
        self.class_names = list(class_names) if class_names is not None else None
        self.num_maps = num_maps

    def make_metrics(self, num_classes: int) -> nn.Module:
        from dbsn.metrics.segmentation import SegmentationMetrics

        return SegmentationMetrics(num_classes, ignore_index=self.ignore_index, class_names=self.class_names)
