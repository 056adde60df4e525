"""Semantic segmentation metrics (mIoU, global accuracy, pixel ECE and NLL) and figures.

Conventions (CamVid: 11 classes, void label 11):

* A pixel whose target is ``ignore_index`` (void) is dropped from every metric; what is
  predicted there does not matter.
* Confusion matrices have the target along the rows and the prediction along the columns.
* The IoU of a class absent from both the prediction and the target (``TP + FP + FN = 0``)
  is undefined: NaN in :func:`iou_per_class`, and left out of :func:`mean_iou` (a
  ``nanmean``), as torchmetrics' ``MulticlassJaccardIndex`` and most segmentation code do.
  A class present in the target but never predicted has IoU 0 and does count.
* Log-probabilities keep the class dimension LAST, ``(B, H, W, C)`` or ``(N, C)``, as the
  rest of the method code (Bayes ensembles over ``(S, N, C)``) does.
* The pixel ECE uses the binning of :func:`dbsn.metrics.expected_calibration_error`
  (`dbsn.metrics.binning`): equal bins closed on the left, the last one closed so that a
  confidence of exactly 1 falls in it.

The functions are reference implementations on whole tensors; :class:`SegmentationMetrics`
accumulates the same numbers over batches with torchmetrics states (summed across
processes under DDP). Its ECE is streaming (:class:`StreamingCalibrationError`: three sums
per bin) because ``MulticlassCalibrationError`` keeps every pixel's confidence, about 40M
of them for the 233 CamVid test images.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassConfusionMatrix

from dbsn.metrics.binning import bin_index

__all__ = [
    "SegmentationMetrics",
    "StreamingCalibrationError",
    "colorize",
    "confusion_matrix",
    "global_accuracy",
    "iou_per_class",
    "mean_iou",
    "uncertainty_figure",
    "uncertainty_grid",
]

PANEL_TITLES = ("Input", "Ground truth", "Prediction", "Predictive entropy", "Mutual information")


# --------------------------------------------------------------------------- functional


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int | None = None) -> Tensor:
    """(C, C) int64 counts, rows = target class, columns = predicted class.

    ``pred`` and ``target`` are integer label maps of the same shape (any shape, e.g. (N,)
    or (B, H, W)); pixels with ``target == ignore_index`` are dropped. Any other label
    outside ``[0, num_classes)`` is an error.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred and target shapes differ: {tuple(pred.shape)} vs {tuple(target.shape)}")
    pred, target = pred.reshape(-1).long(), target.reshape(-1).long()
    if ignore_index is not None:
        keep = target != ignore_index
        pred, target = pred[keep], target[keep]
    for name, labels in (("pred", pred), ("target", target)):
        if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(f"{name} has labels outside [0, {num_classes}) other than ignore_index")
    counts = torch.bincount(target * num_classes + pred, minlength=num_classes**2)
    return counts.reshape(num_classes, num_classes)


def iou_per_class(confusion: Tensor) -> Tensor:
    """``TP / (TP + FP + FN)`` for each class (float64, (C,)); NaN where that is 0 / 0."""
    confusion = confusion.double()
    tp = confusion.diagonal()
    fp = confusion.sum(dim=0) - tp  # predicted as c, target another class
    fn = confusion.sum(dim=1) - tp  # target c, predicted as another class
    return tp / (tp + fp + fn)


def mean_iou(confusion: Tensor) -> Tensor:
    """Mean IoU over the classes present in the prediction or the target (``nanmean``).

    Classes absent from both are left out of the mean; a class in the target that is never
    predicted counts with IoU 0. NaN if no pixel was counted at all.
    """
    return iou_per_class(confusion).nanmean()


def global_accuracy(confusion: Tensor) -> Tensor:
    """Share of (non-void) pixels predicted right: ``trace / total`` (float64)."""
    confusion = confusion.double()
    return confusion.trace() / confusion.sum()


# -------------------------------------------------------------------------- accumulators


class StreamingCalibrationError(Metric):
    """Top-label ECE from per-bin sums, so memory does not grow with the number of pixels.

    ``update(confidence, correct)`` takes the top-label confidence ``max_c p_c`` (N,) and
    whether the argmax is right (N,), of the non-void pixels only. Per bin it keeps the
    count, the sum of confidences and the number right (float64, summed under DDP), and
    ``compute()`` returns ``sum_b |right_b - confidence_b| / N``, the same number as
    :func:`dbsn.metrics.expected_calibration_error` on all those pixels at once (bins
    ``[b/M, (b+1)/M)``, the last one also holding a confidence of exactly 1).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, n_bins: int = 15, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_bins = n_bins
        zeros = torch.zeros(n_bins, dtype=torch.float64)
        self.add_state("count", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("sum_confidence", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("sum_correct", default=zeros.clone(), dist_reduce_fx="sum")

    def update(self, confidence: Tensor, correct: Tensor) -> None:
        confidence = confidence.reshape(-1)
        index = bin_index(confidence, self.n_bins)  # the bins of expected_calibration_error
        self.count.index_add_(0, index, torch.ones_like(confidence, dtype=torch.float64))
        self.sum_confidence.index_add_(0, index, confidence.double())
        self.sum_correct.index_add_(0, index, correct.reshape(-1).double())

    def compute(self) -> Tensor:
        return ((self.sum_correct - self.sum_confidence).abs().sum() / self.count.sum()).float()


class SegmentationMetrics(nn.Module):
    """Stable-named segmentation metrics of a predictive distribution, over batches.

    ``update(log_probs, target)`` takes class-last log-probabilities (B, H, W, C) or (N, C)
    (for a Bayes ensemble, the log of the averaged probabilities) and targets (B, H, W) or
    (N,); the prediction is the argmax. ``compute()`` returns float32 tensors:

    * ``miou``: :func:`mean_iou` of the accumulated confusion matrix;
    * ``global_acc``: :func:`global_accuracy`;
    * ``ece``: pixel-level top-label ECE with ``ece_bins`` bins;
    * ``nll``: mean ``-log p(target)`` over the pixels;
    * ``iou/<class_name>`` for every class (NaN if absent from prediction and target);

    all over the non-void pixels only. ``reset()`` starts over. The confusion matrix is a
    ``MulticlassConfusionMatrix(ignore_index=...)``, which drops the pixels whose *target*
    is ``ignore_index`` (the prediction there is irrelevant). Its ``validate_args`` is off:
    that check only counts the distinct labels (a sort of every batch) without checking
    their range, and an out-of-range target fails in the NLL's ``gather`` anyway.
    """

    def __init__(
        self,
        num_classes: int = 11,
        ignore_index: int | None = 11,
        class_names: Sequence[str] | None = None,
        ece_bins: int = 15,
    ) -> None:
        super().__init__()
        if class_names is None:
            class_names = [f"class_{c}" for c in range(num_classes)]
        if len(class_names) != num_classes:
            raise ValueError(f"got {len(class_names)} class names for {num_classes} classes")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.class_names = list(class_names)
        self.confusion = MulticlassConfusionMatrix(num_classes, ignore_index=ignore_index, validate_args=False)
        self.ece = StreamingCalibrationError(n_bins=ece_bins)
        self.nll = MeanMetric(nan_strategy="disable")
        self.ece_bins = ece_bins
        self._per_image: list[Tensor] = []  # one row per image: confusion, ECE bin sums, NLL sum, pixels

    def update(self, log_probs: Tensor, target: Tensor) -> None:
        """Add a batch: log-probabilities (..., C), class last, and targets (...)."""
        if log_probs.shape[:-1] != target.shape or log_probs.shape[-1] != self.num_classes:
            raise ValueError(
                f"expected log_probs (..., {self.num_classes}) and target (...), "
                f"got {tuple(log_probs.shape)} and {tuple(target.shape)}"
            )
        target_shape = target.shape
        log_probs = log_probs.detach().reshape(-1, self.num_classes)
        target = target.reshape(-1).long()
        # Confidence and prediction as in dbsn.metrics.classification: max of the probabilities.
        confidence, prediction = log_probs.exp().max(dim=-1)
        self.confusion.update(prediction, target)

        if self.ignore_index is None:
            valid = torch.ones_like(target, dtype=torch.bool)
        else:
            valid = target != self.ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))  # void -> any class
        nll = -log_probs.gather(1, safe_target.unsqueeze(1)).squeeze(1)
        self.nll.update(nll[valid])
        self.ece.update(confidence[valid], (prediction == target)[valid])
        images = target_shape[0] if len(target_shape) > 1 else 1
        self._per_image.append(self._image_rows(images, prediction, safe_target, valid, confidence, nll))

    def _image_rows(
        self, images: int, prediction: Tensor, target: Tensor, valid: Tensor, confidence: Tensor, nll: Tensor
    ) -> Tensor:
        """(images, C² + 2 bins + 2) float64 sums of each image's valid pixels: its confusion
        matrix (row-major, target by prediction), per ECE bin the count and the sum of
        (correct - confidence), the NLL sum and the pixel count."""
        c, slots = self.num_classes, self.ece_bins
        image = torch.arange(images, device=target.device).repeat_interleave(target.numel() // images)[valid]
        target, prediction, confidence, nll = target[valid], prediction[valid], confidence[valid], nll[valid]
        confusion = torch.zeros(images * c * c, dtype=torch.float64, device=target.device)
        confusion.index_add_(0, image * c * c + target * c + prediction, torch.ones_like(nll, dtype=torch.float64))
        index = image * slots + bin_index(confidence, self.ece_bins)
        counts = torch.zeros(images * slots, dtype=torch.float64, device=target.device)
        counts.index_add_(0, index, torch.ones_like(nll, dtype=torch.float64))
        gaps = torch.zeros(images * slots, dtype=torch.float64, device=target.device)
        gaps.index_add_(0, index, (prediction == target).double() - confidence.double())
        nll_sum = torch.zeros(images, dtype=torch.float64, device=target.device).index_add_(0, image, nll.double())
        pixels = torch.zeros(images, dtype=torch.float64, device=target.device).index_add_(
            0, image, torch.ones_like(nll, dtype=torch.float64)
        )
        return torch.cat(
            [
                confusion.view(images, -1),
                counts.view(images, -1),
                gaps.view(images, -1),
                nll_sum[:, None],
                pixels[:, None],
            ],
            1,
        ).cpu()

    def per_image(self) -> Tensor | None:
        """(images, ...) the rows of `_image_rows` of every image since the last reset (None if none)."""
        return torch.cat(self._per_image) if self._per_image else None

    def resampled(self, weights: Tensor, per_image: Tensor | None = None) -> dict[str, Tensor]:
        """`miou`, `global_acc`, `ece` and `nll` at every row of `weights` (B, images): the
        metrics of the data set that repeats image i w_i times (row 0 at unit weights equals
        `compute`)."""
        rows = (self.per_image() if per_image is None else per_image).double()
        c, slots = self.num_classes, self.ece_bins
        sums = weights.double() @ rows  # (B, columns)
        confusion = sums[:, : c * c].view(-1, c, c)
        tp = confusion.diagonal(dim1=1, dim2=2)
        iou = tp / (confusion.sum(1) + confusion.sum(2) - tp)
        gaps = sums[:, c * c + slots : c * c + 2 * slots]
        pixels = sums[:, -1]
        return {
            "miou": iou.nanmean(1),
            "global_acc": tp.sum(1) / pixels,
            "ece": gaps.abs().sum(1) / pixels,
            "nll": sums[:, -2] / pixels,
        }

    def compute(self) -> dict[str, Tensor]:
        """The metrics over everything seen since the last reset."""
        confusion = self.confusion.compute()
        iou = iou_per_class(confusion).float()
        out = {
            "miou": mean_iou(confusion).float(),
            "global_acc": global_accuracy(confusion).float(),
            "ece": self.ece.compute(),
            "nll": self.nll.compute().float(),
        }
        out.update({f"iou/{name}": iou[c] for c, name in enumerate(self.class_names)})
        return out

    def reset(self) -> None:
        """Clear the accumulated states."""
        for metric in (self.confusion, self.ece, self.nll):
            metric.reset()
        self._per_image = []


# ------------------------------------------------------------------------------ figures


def _numpy(x) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu()
    return np.asarray(x)


def _palette(palette) -> np.ndarray:
    """(C, 3) colours as floats in [0, 1] (integer palettes, 0..255, are divided by 255)."""
    palette = np.asarray(_numpy(palette) if hasattr(palette, "shape") else palette)
    if np.issubdtype(palette.dtype, np.integer):
        return palette.astype(np.float64) / 255
    return palette.astype(np.float64)


def colorize(labels, palette) -> np.ndarray:
    """(H, W) label map -> (H, W, 3) floats: class ``c`` in ``palette[c]``, any label
    outside ``[0, C)`` (void) black."""
    labels, colours = _numpy(labels).astype(np.int64), _palette(palette)
    known = (labels >= 0) & (labels < len(colours))
    rgb = np.zeros((*labels.shape, 3))
    rgb[known] = colours[labels[known]]
    return rgb


def uncertainty_grid(
    rows: Sequence[dict],
    palette,
    class_names: Sequence[str],
    ignore_index: int = 11,
    title: str | None = None,
) -> Figure:
    """One row of five panels per image, as in Figure 2 of the DBSN paper.

    Each dict of ``rows`` has ``image`` (3, H, W) floats in [0, 1], ``target`` and
    ``prediction`` (H, W) labels, ``entropy`` and ``mutual_information`` (H, W) in nats,
    and optionally ``label`` (written left of the row). The panels are the input, the
    ground truth and the prediction coloured with ``palette`` ((C, 3), uint8 or floats in
    [0, 1]; ``ignore_index`` and any other label outside ``[0, C)`` black), then the
    predictive entropy and the mutual information as heat maps with a colourbar in nats.
    ``fig.axes`` starts with the ``5 * len(rows)`` panels, row by row; the colourbars
    (axes labelled ``"<colorbar>"``) come after. A legend of the class colours (and void)
    is drawn below.
    """
    if not rows:
        raise ValueError("no rows to draw")
    colours = _palette(palette)
    height, width = _numpy(rows[0]["target"]).shape
    fig = Figure(figsize=(16, len(rows) * 3.2 * height / width + 1.2), layout="constrained")
    axes = np.asarray(fig.subplots(len(rows), 5, squeeze=False))
    for row, ax_row in zip(rows, axes):
        image = np.clip(_numpy(row["image"]).transpose(1, 2, 0), 0, 1)
        panels = (image, colorize(row["target"], colours), colorize(row["prediction"], colours))
        for ax, panel in zip(ax_row[:3], panels):
            ax.imshow(panel, interpolation="nearest")
        for ax, key, cmap in zip(ax_row[3:], ("entropy", "mutual_information"), ("inferno", "viridis")):
            heat = ax.imshow(_numpy(row[key]), cmap=cmap, vmin=0, interpolation="nearest")
            fig.colorbar(heat, ax=ax, shrink=0.9).set_label("nats")
        for ax, panel_title in zip(ax_row, PANEL_TITLES):
            ax.set_title(panel_title)
            ax.set_xticks([])
            ax.set_yticks([])
        if row.get("label"):
            ax_row[0].set_ylabel(row["label"])
    handles = [Patch(facecolor=colours[c], edgecolor="gray", label=name) for c, name in enumerate(class_names)]
    handles.append(Patch(facecolor="black", edgecolor="gray", label=f"void ({ignore_index})"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 12), frameon=False)
    if title is not None:
        fig.suptitle(title)
    return fig


def uncertainty_figure(
    image,
    target,
    prediction,
    entropy,
    mutual_information,
    palette,
    class_names: Sequence[str],
    ignore_index: int = 11,
    title: str | None = None,
) -> Figure:
    """The five panels of :func:`uncertainty_grid` for a single image."""
    row = {
        "image": image,
        "target": target,
        "prediction": prediction,
        "entropy": entropy,
        "mutual_information": mutual_information,
    }
    return uncertainty_grid([row], palette, class_names, ignore_index=ignore_index, title=title)
