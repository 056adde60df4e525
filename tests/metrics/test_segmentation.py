"""Tests for dbsn.metrics.segmentation: confusion/IoU/accuracy, the accumulator and figures."""

import math

import numpy as np
import pytest
import torch

from dbsn.evaluation.plots import save_figure
from dbsn.metrics.classification import expected_calibration_error
from dbsn.metrics.segmentation import (
    SegmentationMetrics,
    colorize,
    confusion_matrix,
    global_accuracy,
    iou_per_class,
    mean_iou,
    uncertainty_figure,
    uncertainty_grid,
)

V = 4  # void label of the crafted maps, with 4 classes 0..3

# Class 3 appears nowhere (except as a prediction on void pixels), class 2 is in the
# target but never predicted (only on a void pixel), two pixels are void.
TARGET = torch.tensor(
    [
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [2, 2, 1, V],
        [V, V, 0, 1],
    ]
)
PRED = torch.tensor(
    [
        [0, 1, 1, 1],
        [0, 0, 1, 0],
        [0, 1, 1, 3],
        [3, 2, 0, 1],
    ]
)
# Non-void (target, pred) pairs, 13 pixels:
#   target 0: (0,0) x4 [r0c0 r1c0 r1c1 r3c2], (0,1) x1 [r0c1]           -> row [4, 1, 0, 0]
#   target 1: (1,1) x5 [r0c2 r0c3 r1c2 r2c2 r3c3], (1,0) x1 [r1c3]      -> row [1, 5, 0, 0]
#   target 2: (2,0) x1 [r2c0], (2,1) x1 [r2c1]                          -> row [1, 1, 0, 0]
#   target 3: none                                                      -> row [0, 0, 0, 0]
EXPECTED_CONFUSION = torch.tensor(
    [
        [4, 1, 0, 0],
        [1, 5, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 0, 0],
    ]
)
# Column sums (predicted counts): 6, 7, 0, 0.
# IoU_0 = TP / (TP + FP + FN) = 4 / (4 + (6 - 4) + (5 - 4)) = 4/7
# IoU_1 = 5 / (5 + (7 - 5) + (6 - 5)) = 5/8
# IoU_2 = 0 / (0 + 0 + 2) = 0          (in the target, never predicted)
# IoU_3 = 0 / 0 = NaN                  (absent from both)
# mIoU = (4/7 + 5/8 + 0) / 3 = (32/56 + 35/56) / 3 = 67/168   (class 3 left out)
# global accuracy = (4 + 5) / 13 = 9/13
EXPECTED_IOU = [4 / 7, 5 / 8, 0.0, math.nan]
EXPECTED_MIOU = 67 / 168
EXPECTED_ACC = 9 / 13


def test_confusion_matrix_by_hand():
    confusion = confusion_matrix(PRED, TARGET, num_classes=4, ignore_index=V)
    assert confusion.dtype == torch.int64
    assert torch.equal(confusion, EXPECTED_CONFUSION)
    # Same with a batch dimension and flattened.
    assert torch.equal(confusion_matrix(PRED[None], TARGET[None], 4, V), EXPECTED_CONFUSION)
    assert torch.equal(confusion_matrix(PRED.flatten(), TARGET.flatten(), 4, V), EXPECTED_CONFUSION)


def test_iou_miou_and_accuracy_by_hand():
    iou = iou_per_class(EXPECTED_CONFUSION)
    assert iou.shape == (4,)
    assert iou[:3].tolist() == pytest.approx(EXPECTED_IOU[:3])
    assert iou[2] == 0  # in the target, never predicted: 0, not NaN
    assert torch.isnan(iou[3])  # absent from prediction and target
    assert mean_iou(EXPECTED_CONFUSION).item() == pytest.approx(EXPECTED_MIOU)
    assert global_accuracy(EXPECTED_CONFUSION).item() == pytest.approx(EXPECTED_ACC)


def test_predictions_on_void_pixels_change_nothing():
    void = TARGET == V
    for value in range(4):
        other = torch.where(void, torch.full_like(PRED, value), PRED)
        assert torch.equal(confusion_matrix(other, TARGET, 4, V), EXPECTED_CONFUSION)
    # Without ignore_index the void label is out of range.
    with pytest.raises(ValueError):
        confusion_matrix(PRED, TARGET, 4)


def _one_hot_log_probs(pred, num_classes, confidence=0.9):
    """Log-probs (..., C) whose argmax is ``pred`` with the given confidence."""
    probs = torch.full((*pred.shape, num_classes), (1 - confidence) / (num_classes - 1))
    probs.scatter_(-1, pred.unsqueeze(-1), confidence)
    return probs.log()


def test_accumulator_on_crafted_maps_and_void_invariance():
    metrics = SegmentationMetrics(num_classes=4, ignore_index=V)
    metrics.update(_one_hot_log_probs(PRED, 4)[None], TARGET[None])
    result = metrics.compute()
    assert result["miou"].item() == pytest.approx(EXPECTED_MIOU)
    assert result["global_acc"].item() == pytest.approx(EXPECTED_ACC)
    assert [result[f"iou/class_{c}"].item() for c in range(3)] == pytest.approx(EXPECTED_IOU[:3])
    assert torch.isnan(result["iou/class_3"])
    # NLL: -log 0.9 on right pixels (9), -log(0.1 / 3) on wrong ones (4), void excluded.
    assert result["nll"].item() == pytest.approx((9 * -math.log(0.9) + 4 * -math.log(0.1 / 3)) / 13, rel=1e-5)
    # ECE: one bin (0.9), accuracy 9/13.
    assert result["ece"].item() == pytest.approx(abs(9 / 13 - 0.9), abs=1e-6)

    # Different log-probs on the void pixels (prediction, confidence and all): same metrics.
    log_probs = _one_hot_log_probs(PRED, 4)
    log_probs[TARGET == V] = torch.randn(3, 4).log_softmax(-1)
    other = SegmentationMetrics(num_classes=4, ignore_index=V)
    other.update(log_probs[None], TARGET[None])
    other_result = other.compute()
    assert other_result.keys() == result.keys()
    for name in result:
        torch.testing.assert_close(other_result[name], result[name], equal_nan=True)


def _random_batch(generator, batch, height=5, width=7, num_classes=11, void=11):
    log_probs = (3 * torch.randn(batch, height, width, num_classes, generator=generator)).log_softmax(-1)
    target = torch.randint(0, num_classes + 1, (batch, height, width), generator=generator)
    target[target == num_classes] = void
    return log_probs, target


def test_accumulator_over_batches_equals_functional_on_concatenation():
    generator = torch.Generator().manual_seed(0)
    batches = [_random_batch(generator, b) for b in (1, 3, 2)]
    metrics = SegmentationMetrics()  # 11 classes, void 11, 15 bins
    for log_probs, target in batches:
        metrics.update(log_probs, target)
    result = metrics.compute()

    log_probs = torch.cat([lp for lp, _ in batches])
    target = torch.cat([t for _, t in batches])
    assert (target == 11).any()
    confusion = confusion_matrix(log_probs.argmax(-1), target, 11, ignore_index=11)
    assert torch.equal(metrics.confusion.compute(), confusion)
    assert result["miou"].item() == pytest.approx(mean_iou(confusion).item())
    assert result["global_acc"].item() == pytest.approx(global_accuracy(confusion).item())
    iou = iou_per_class(confusion)
    for c in range(11):
        torch.testing.assert_close(result[f"iou/class_{c}"].double(), iou[c], equal_nan=True)

    valid = target != 11
    flat_log_probs, flat_target = log_probs[valid], target[valid]  # (M, C), (M,)
    ece = expected_calibration_error(flat_log_probs.exp(), flat_target, n_bins=15)
    assert result["ece"].item() == pytest.approx(ece.item(), abs=1e-6)
    nll = torch.stack([-flat_log_probs[i, flat_target[i]] for i in range(len(flat_target))]).mean()
    assert result["nll"].item() == pytest.approx(nll.item(), rel=1e-5)

    metrics.reset()
    metrics.update(*batches[0])
    assert metrics.compute()["nll"].item() != pytest.approx(result["nll"].item())


def test_streaming_ece_on_bin_edges_and_confidence_one():
    edges = torch.linspace(0, 1, 16)  # the 15 bins, as in expected_calibration_error
    e8, e12 = edges[8].item(), edges[12].item()  # 8/15 and 12/15
    below = torch.nextafter(edges[8], torch.tensor(0.0)).item()
    above = torch.nextafter(edges[8], torch.tensor(1.0)).item()
    # (confidence of class 0, is class 0 right); the last pixel is void.
    pixels = [(e8, 1), (below, 0), (above, 1), (e12, 1), (e12, 0), (0.95, 1), (1.0, 0), (1.0, 1), (1.0, 0)]
    confidence = torch.tensor([c for c, _ in pixels])
    log_probs = torch.stack([confidence, 1 - confidence], dim=-1).log()
    target = torch.tensor([0 if right else 1 for _, right in pixels])
    target[-1] = 2  # void
    # The confidences survive the log/exp round trip: they are exactly on the edges.
    assert torch.equal(log_probs.exp()[:, 0], confidence)
    assert confidence[0] == edges[8] and confidence[3] == edges[12] and confidence[6] == 1

    metrics = SegmentationMetrics(num_classes=2, ignore_index=2)
    metrics.update(log_probs[:4], target[:4])  # (N, C) input, in two batches
    metrics.update(log_probs[4:], target[4:])
    ece = metrics.compute()["ece"].item()

    valid = target != 2
    reference = expected_calibration_error(log_probs[valid].exp(), target[valid], n_bins=15).item()
    assert ece == pytest.approx(reference, abs=1e-6)
    # By hand (8 non-void pixels), bins closed on the left, the last one [14/15, 1] closed:
    #   bin 7  [7/15, 8/15): below (wrong)         -> |0 - e8|        = 8/15
    #   bin 8  [8/15, 9/15): e8, above (both right) -> |2 - 2 e8|      = 14/15
    #   bin 12 [12/15, 13/15): e12 right and wrong -> |1 - 2 * 0.8|   = 0.6
    #   bin 14: 0.95 right, 1.0 wrong and right    -> |2 - 2.95|      = 0.95
    # ECE = (8/15 + 14/15 + 0.6 + 0.95) / 8 = (22/15 + 1.55) / 8
    assert ece == pytest.approx((22 / 15 + 1.55) / 8, abs=1e-6)


def test_metric_names_are_stable():
    names = ["sky", "building", "road"]
    metrics = SegmentationMetrics(num_classes=3, ignore_index=3, class_names=names)
    metrics.update(torch.randn(2, 4, 4, 3).log_softmax(-1), torch.randint(0, 4, (2, 4, 4)))
    assert list(metrics.compute()) == ["miou", "global_acc", "ece", "nll", "iou/sky", "iou/building", "iou/road"]
    default = SegmentationMetrics()
    default.update(torch.randn(1, 2, 2, 11).log_softmax(-1), torch.zeros(1, 2, 2, dtype=torch.long))
    assert list(default.compute()) == ["miou", "global_acc", "ece", "nll"] + [f"iou/class_{c}" for c in range(11)]
    with pytest.raises(ValueError):
        default.update(torch.randn(1, 2, 2, 3), torch.zeros(1, 2, 2, dtype=torch.long))


def _figure_inputs(seed, height=6, width=8, num_classes=3):
    generator = torch.Generator().manual_seed(seed)
    return {
        "image": torch.rand(3, height, width, generator=generator),
        "target": torch.randint(0, num_classes + 1, (height, width), generator=generator),  # 3 = void
        "prediction": torch.randint(0, num_classes, (height, width), generator=generator),
        "entropy": torch.rand(height, width, generator=generator),
        "mutual_information": 0.1 * torch.rand(height, width, generator=generator),
    }


PALETTE = torch.tensor([[128, 128, 128], [128, 0, 0], [192, 192, 128]], dtype=torch.uint8)
NAMES = ["sky", "building", "pole"]
TITLES = ["Input", "Ground truth", "Prediction", "Predictive entropy", "Mutual information"]


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def test_uncertainty_figure_panels_and_data(tmp_path):
    row = _figure_inputs(0)
    fig = uncertainty_figure(**row, palette=PALETTE, class_names=NAMES, ignore_index=3, title="CamVid")
    panels = _panels(fig)
    assert len(panels) == 5 and panels == fig.axes[:5]
    assert [ax.get_title() for ax in panels] == TITLES
    assert all(len(ax.get_xticks()) == 0 and len(ax.get_yticks()) == 0 for ax in panels)
    assert fig.get_suptitle() == "CamVid"

    data = [np.asarray(ax.images[0].get_array()) for ax in panels]
    np.testing.assert_allclose(data[0], row["image"].permute(1, 2, 0).numpy())
    np.testing.assert_allclose(data[1], colorize(row["target"], PALETTE))
    np.testing.assert_allclose(data[2], colorize(row["prediction"], PALETTE))
    np.testing.assert_allclose(data[3], row["entropy"].numpy())
    np.testing.assert_allclose(data[4], row["mutual_information"].numpy())
    # Palette colours (uint8 / 255) and void in black.
    void = row["target"] == 3
    assert void.any()
    np.testing.assert_allclose(data[1][void.numpy()], 0)
    y, x = torch.nonzero(row["target"] == 1)[0].tolist()
    np.testing.assert_allclose(data[1][y, x], [128 / 255, 0, 0])

    colorbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert [ax.get_ylabel() for ax in colorbars] == ["nats", "nats"]
    legend_labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend_labels[:3] == NAMES and "void" in legend_labels[3]
    assert save_figure(fig, tmp_path / "fig.png").stat().st_size > 0


def test_uncertainty_grid_one_row_per_image():
    rows = [_figure_inputs(seed) for seed in range(3)]
    rows[1]["label"] = "image 1"
    palette = PALETTE.float() / 255  # float palettes are taken as they are
    fig = uncertainty_grid(rows, palette=palette, class_names=NAMES, ignore_index=3)
    panels = _panels(fig)
    assert len(panels) == 15 and panels == fig.axes[:15]
    for r, row in enumerate(rows):
        ax_row = panels[5 * r : 5 * r + 5]
        assert [ax.get_title() for ax in ax_row] == TITLES
        np.testing.assert_allclose(np.asarray(ax_row[3].images[0].get_array()), row["entropy"].numpy())
        np.testing.assert_allclose(np.asarray(ax_row[2].images[0].get_array()), colorize(row["prediction"], palette))
    assert panels[5].get_ylabel() == "image 1"


def test_resampled_metrics_are_those_of_the_data_set_that_repeats_the_images():
    from dbsn.metrics.intervals import resample_counts

    generator = torch.Generator().manual_seed(1)
    batches = [_random_batch(generator, b) for b in (2, 3)]
    metrics = SegmentationMetrics()
    for log_probs, target in batches:
        metrics.update(log_probs, target)
    log_probs, target = torch.cat([lp for lp, _ in batches]), torch.cat([t for _, t in batches])
    per_image = metrics.per_image()
    assert per_image.shape[0] == 5
    counts = torch.cat([torch.ones(1, 5, dtype=torch.float64), resample_counts(5, 3, seed=2)])
    found = metrics.resampled(counts)
    for row, weights in enumerate(counts.long()):
        repeated = torch.repeat_interleave(torch.arange(5), weights)
        plain = SegmentationMetrics()
        plain.update(log_probs[repeated], target[repeated])
        expected = plain.compute()
        for key in ("miou", "global_acc", "ece", "nll"):
            assert float(found[key][row]) == pytest.approx(float(expected[key]), abs=1e-5), (key, row)
    metrics.reset()
    assert metrics.per_image() is None
