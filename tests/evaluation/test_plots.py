"""Tests for dbsn.evaluation.plots: the reliability diagram and saving figures."""

import matplotlib.pyplot as plt
import pytest
import torch

from dbsn.evaluation.plots import reliability_diagram, save_figure
from dbsn.metrics.classification import reliability_bins
from tests.support.fakedata import CRAFTED_PROBS, CRAFTED_TARGET

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

PROBS, TARGET = CRAFTED_PROBS.float(), CRAFTED_TARGET


def test_bar_heights_are_bin_accuracies():
    # 4 bins: [0, .25) and [.25, .5) empty; [.5, .75) has 0.7 right, 0.5 and 0.6 wrong -> 1/3;
    # [.75, 1] has 0.8 and 0.9, both right -> 1. Empty bins are drawn with height 0.
    fig = reliability_diagram(PROBS, TARGET, n_bins=4)
    heights = [patch.get_height() for patch in fig.axes[0].patches[:4]]
    assert heights == pytest.approx([0.0, 0.0, 1 / 3, 1.0])
    accuracy = reliability_bins(PROBS, TARGET, n_bins=4)["accuracy"]
    assert heights[2:] == pytest.approx(accuracy[2:].tolist())
    assert [patch.get_x() for patch in fig.axes[0].patches[:4]] == pytest.approx([0, 0.25, 0.5, 0.75])


def test_diagram_labels_title_and_ece_text():
    fig = reliability_diagram(PROBS, TARGET, n_bins=4, title="toy")
    ax, ax_share = fig.axes
    assert ax.get_ylabel() == "Accuracy"
    assert ax_share.get_xlabel() == "Confidence"
    assert ax.get_title() == "toy"
    # With 15 bins (width 1/15) the confidences 0.5, 0.6, 0.7, 0.8, 0.9 each fall in a bin of
    # their own, so ECE = mean |right - conf| = (0.5 + 0.6 + 0.3 + 0.2 + 0.1) / 5 = 0.34.
    assert any("0.3400" in text.get_text() for text in ax.texts)
    # Share of samples per bin in the lower panel: 0, 0, 3/5, 2/5.
    shares = [patch.get_height() for patch in ax_share.patches]
    assert shares == pytest.approx([0.0, 0.0, 0.6, 0.4])


def test_save_figure_writes_png(tmp_path):
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(200, 10, generator=gen), dim=1)
    target = torch.randint(10, (200,), generator=gen)
    path = save_figure(reliability_diagram(probs, target), tmp_path / "nested" / "dir" / "rel.png")
    assert path == tmp_path / "nested" / "dir" / "rel.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_save_figure_closes_pyplot_figures(tmp_path):
    fig = plt.figure()
    number = fig.number
    save_figure(fig, tmp_path / "empty.png")
    assert not plt.fignum_exists(number)
