"""Tests for dbsn.evaluation.plots: the reliability diagram, the Pareto front and figure, and
saving figures."""

import matplotlib.pyplot as plt
import pytest
import torch

from dbsn.evaluation.plots import (
    PARETO_METRICS,
    pareto_figure,
    pareto_front,
    reliability_diagram,
    save_figure,
)
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


def test_pareto_front_excludes_dominated_points_and_keeps_ties():
    points = [
        (1.0, 5.0),  # 0: cheapest, on the front
        (2.0, 3.0),  # 1: on the front
        (2.0, 4.0),  # 2: same cost as 1, worse -> dominated
        (3.0, 3.0),  # 3: dearer than 1, not better -> dominated (tie in y, strict in x)
        (4.0, 1.0),  # 4: on the front
        (2.0, 3.0),  # 5: equal to 1: neither dominates the other, both on the front
        (5.0, 2.0),  # 6: dominated by 4
        (float("nan"), 0.0),  # 7: not measured: never on the front
    ]
    assert pareto_front(points) == [0, 1, 5, 4]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0)]) == [0]
    assert pareto_front([(3.0, 1.0), (1.0, 3.0), (2.0, 2.0)]) == [1, 2, 0]  # order of the front, by x


ROWS = [
    {"method": "single", "flops": 1e9, "calibrated_nll": 0.30, "ece": 0.020, "error": 0.08},
    {"method": "ensemble", "flops": 4e9, "calibrated_nll": 0.22, "calibrated_nll_low": 0.20,
     "calibrated_nll_high": 0.24, "ece": 0.010, "error": 0.06, "error_low": 0.055, "error_high": 0.065},
    {"method": "dbsn", "flops": 2e9, "calibrated_nll": 0.25, "calibrated_nll_low": 0.23,
     "calibrated_nll_high": 0.27, "ece": 0.030},  # error not measured
    {"method": "bad", "flops": 5e9, "calibrated_nll": 0.35, "ece": 0.040, "error": 0.10},
]


def _front_line(ax):
    (line,) = [line for line in ax.lines if line.get_label() == "Pareto front"]
    return line


def test_pareto_figure_panels_markers_bars_and_front():
    fig = pareto_figure(ROWS, title="toy")
    assert len(fig.axes) == 3
    assert [ax.get_title() for ax in fig.axes] == list(PARETO_METRICS.values())
    assert fig.get_suptitle() == "toy"
    assert all(ax.get_xscale() == "log" for ax in fig.axes)
    # one errorbar container (one marker) per method that has the metric; bars only with an interval
    assert [len(ax.containers) for ax in fig.axes] == [4, 4, 3]
    assert [sum(c.has_yerr for c in ax.containers) for ax in fig.axes] == [2, 0, 1]
    nll_ax = fig.axes[0]
    assert [c.get_label() for c in nll_ax.containers] == ["single", "ensemble", "dbsn", "bad"]
    # the ensemble's NLL bar spans its interval
    (bar,) = nll_ax.containers[1].lines[2]
    assert bar.get_segments()[0][:, 1] == pytest.approx([0.20, 0.24])
    # NLL front: single (1e9), dbsn (2e9), ensemble (4e9); 'bad' is dominated
    front = _front_line(nll_ax)
    assert front.get_drawstyle() == "steps-post"
    assert list(front.get_xdata()) == [1e9, 2e9, 4e9]
    assert list(front.get_ydata()) == pytest.approx([0.30, 0.25, 0.22])
    # ECE front: single and ensemble only
    assert list(_front_line(fig.axes[1]).get_xdata()) == [1e9, 4e9]
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_labels == ["single", "ensemble", "dbsn", "bad", "Pareto front"]


def test_pareto_figure_metric_absent_from_every_row_says_not_measured(tmp_path):
    rows = [{k: v for k, v in row.items() if not k.startswith("ece")} for row in ROWS]
    rows[0]["ece"] = None  # None counts as absent too
    fig = pareto_figure(rows, title="no ECE")
    ece_ax = fig.axes[1]
    assert len(ece_ax.containers) == 0
    assert [t.get_text() for t in ece_ax.texts] == ["not measured"]
    assert ece_ax.get_xscale() == "log"
    assert not any(t.get_text() == "not measured" for ax in (fig.axes[0], fig.axes[2]) for t in ax.texts)
    assert save_figure(fig, tmp_path / "pareto.png").read_bytes().startswith(PNG_MAGIC)


def test_pareto_figure_rejects_bad_rows():
    with pytest.raises(ValueError, match="flops must be a positive number"):
        pareto_figure([{"method": "m", "flops": 0.0, "error": 0.1}], title="x")
    with pytest.raises(ValueError, match="needs both error_low and error_high"):
        pareto_figure([{"method": "m", "flops": 1e9, "error": 0.1, "error_low": 0.05}], title="x")
