"""Tests for dbsn.evaluation.plots: the reliability diagram, the Pareto front and figure, and
saving figures."""

import matplotlib.pyplot as plt
import pytest
import torch

from dbsn.evaluation.interval_rule import OUTSIDE_NOTE
from dbsn.evaluation.plots import (
    FLAGGED_NOTE,
    INTERVAL_LABEL,
    PARETO_METRICS,
    front_steps,
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
    {"method": "single", "flops": 1e9, "calibrated_nll": 0.30, "ce2": 0.0020, "error": 0.08},
    {
        "method": "ensemble",
        "flops": 4e9,
        "calibrated_nll": 0.22,
        "calibrated_nll_low": 0.20,
        "calibrated_nll_high": 0.24,
        "ce2": 0.0010,
        "error": 0.06,
        "error_low": 0.055,
        "error_high": 0.065,
    },
    {
        "method": "dbsn",
        "flops": 2e9,
        "calibrated_nll": 0.25,
        "calibrated_nll_low": 0.23,
        "calibrated_nll_high": 0.27,
        "ce2": 0.0030,
    },  # error not measured
    {"method": "bad", "flops": 5e9, "calibrated_nll": 0.35, "ce2": 0.0040, "error": 0.10},
]


def _front_line(ax):
    (line,) = [line for line in ax.lines if line.get_label() == "Pareto front"]
    return line


def _markers(ax) -> dict:
    """method -> its marker's Line2D (the errorbar containers labelled with a method)."""
    return {c.get_label(): c.lines[0] for c in ax.containers if c.get_label() != INTERVAL_LABEL}


def _bars(ax) -> list[float]:
    """low, high of every interval bar drawn, in drawing order, one flat list."""
    return [
        end
        for c in ax.containers
        if c.get_label() == INTERVAL_LABEL
        for end in sorted(c.lines[2][0].get_segments()[0][:, 1].tolist())
    ]


def test_pareto_figure_panels_markers_bars_and_front():
    fig = pareto_figure(ROWS, title="toy")
    assert len(fig.axes) == 3
    assert [ax.get_title() for ax in fig.axes] == list(PARETO_METRICS.values())
    assert list(PARETO_METRICS) == ["calibrated_nll", "ce2", "error"]  # the unbiased CE², not the plug-in ECE
    assert fig.get_suptitle() == "toy"
    assert all(ax.get_xscale() == "log" for ax in fig.axes)
    # one marker per method that has the metric; a bar of its own only with an interval
    assert [len(_markers(ax)) for ax in fig.axes] == [4, 4, 3]
    assert [len(_bars(ax)) // 2 for ax in fig.axes] == [2, 0, 1]
    nll_ax = fig.axes[0]
    assert list(_markers(nll_ax)) == ["single", "ensemble", "dbsn", "bad"]
    # the ensemble's NLL bar spans its interval, then dbsn's (rows in order)
    assert _bars(nll_ax) == pytest.approx([0.20, 0.24, 0.23, 0.27])
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_labels == ["single", "ensemble", "dbsn", "bad", "Pareto front"]


def test_the_pareto_front_steps_down_at_each_better_costlier_method():
    """NLL: single (1e9, 0.30), dbsn (2e9, 0.25), ensemble (4e9, 0.22) are the front, 'bad' (5e9) is
    dominated: the line holds each best value across to the next front point's cost, steps down to
    it (the last step down included) and runs on to the costliest method drawn."""
    fig = pareto_figure(ROWS, title="toy")
    front = _front_line(fig.axes[0])
    assert list(front.get_xdata()) == [1e9, 2e9, 2e9, 4e9, 4e9, 5e9]
    assert list(front.get_ydata()) == pytest.approx([0.30, 0.30, 0.25, 0.25, 0.22, 0.22])
    assert front.get_drawstyle() == "default" and front.get_linestyle() == "--"
    # CE²: single (1e9, 0.002) then ensemble (4e9, 0.001); dbsn and bad dominated
    ce2 = _front_line(fig.axes[1])
    assert list(ce2.get_xdata()) == [1e9, 4e9, 4e9, 5e9]
    assert list(ce2.get_ydata()) == pytest.approx([0.002, 0.002, 0.001, 0.001])
    # the front is drawn above the interval bars (a step at a method's cost is not hidden by its bar)
    assert front.get_zorder() > max(
        c.lines[2][0].get_zorder() for c in fig.axes[0].containers if c.get_label() == INTERVAL_LABEL
    )
    assert front_steps([(1.0, 2.0)]) == ([1.0], [2.0])


def test_pareto_bars_stay_within_the_metrics_limits_and_are_not_stretched_to_their_marker():
    """Two seeds' t intervals reach below 0 for an error, a CE² and an NLL: the bars stop at 0. An
    interval that misses its estimate (as a biased statistic's can) is drawn where it lies, and its
    marker is hollow with the panel's note; a negative CE² estimate under an interval clipped at 0 is
    not flagged (the estimate may be negative, the true CE² cannot)."""
    rows = [
        {
            "method": "two seeds",
            "flops": 1e9,
            "calibrated_nll": 0.02,
            "calibrated_nll_low": -0.10,
            "calibrated_nll_high": 0.14,
            "ce2": -0.0002,
            "ce2_low": -0.0010,
            "ce2_high": 0.0030,
            "error": 0.01,
            "error_low": -0.05,
            "error_high": 0.07,
        },
        {
            "method": "biased",
            "flops": 2e9,
            "calibrated_nll": 0.30,
            "calibrated_nll_low": 0.28,
            "calibrated_nll_high": 0.33,
            "ce2": 0.001,
            "error": 0.03,
            "error_low": 0.035,
            "error_high": 0.07,
        },
    ]
    fig = pareto_figure(rows, title="limits")
    nll_ax, ce2_ax, error_ax = fig.axes
    assert _bars(nll_ax) == pytest.approx([0.0, 0.14, 0.28, 0.33])
    assert _bars(ce2_ax) == pytest.approx([0.0, 0.003])
    assert _bars(error_ax) == pytest.approx([0.0, 0.07, 0.035, 0.07])  # not stretched down to 0.03
    assert all(min(_bars(ax)) >= 0.0 for ax in fig.axes)
    hollow = {
        ax.get_title(): [m for m, line in _markers(ax).items() if line.get_markerfacecolor() == "none"]
        for ax in fig.axes
    }
    assert hollow == {"Calibrated NLL": [], "CE² (unbiased)": [], "Error": ["biased"]}
    assert [t.get_text() for t in error_ax.texts] == [FLAGGED_NOTE["hollow marker"]]
    assert not nll_ax.texts and not ce2_ax.texts
    assert OUTSIDE_NOTE.strip("()") in FLAGGED_NOTE["hollow marker"]


def test_pareto_figure_metric_absent_from_every_row_says_not_measured(tmp_path):
    rows = [{k: v for k, v in row.items() if not k.startswith("ce2")} for row in ROWS]
    rows[0]["ce2"] = None  # None counts as absent too
    fig = pareto_figure(rows, title="no CE²")
    ce2_ax = fig.axes[1]
    assert len(ce2_ax.containers) == 0
    assert [t.get_text() for t in ce2_ax.texts] == ["not measured"]
    assert ce2_ax.get_xscale() == "log"
    assert not any(t.get_text() == "not measured" for ax in (fig.axes[0], fig.axes[2]) for t in ax.texts)
    assert save_figure(fig, tmp_path / "pareto.png").read_bytes().startswith(PNG_MAGIC)


def test_pareto_figure_rejects_bad_rows():
    with pytest.raises(ValueError, match="flops must be a positive number"):
        pareto_figure([{"method": "m", "flops": 0.0, "error": 0.1}], title="x")
    with pytest.raises(ValueError, match="needs both error_low and error_high"):
        pareto_figure([{"method": "m", "flops": 1e9, "error": 0.1, "error_low": 0.05}], title="x")
