"""Figures: the reliability diagram (Guo et al., 2017, fig. 1) and the cost/quality Pareto
figure (calibrated NLL, the unbiased CE² and error against prediction FLOPs per image).

Every interval a figure draws follows the rule of every shown interval
(`dbsn.evaluation.interval_rule`, `interval_bar`): the bar spans the interval within the metric's
limits, exactly where it lies; an interval that misses its estimate is drawn as it is, not
stretched to the marker, and the marker says so.

Figures are built with :class:`matplotlib.figure.Figure` directly, not through pyplot, so
they work on a headless machine and never open a window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from dbsn.evaluation.interval_rule import OUTSIDE_NOTE, shown_interval
from dbsn.metrics.classification import expected_calibration_error, reliability_bins

__all__ = ["PARETO_METRICS", "interval_bar", "pareto_figure", "pareto_front", "reliability_diagram", "save_figure"]


def reliability_diagram(probs: Tensor, target: Tensor, n_bins: int = 10, title: str | None = None) -> Figure:
    """Reliability diagram of the top-label confidence.

    The upper axes (``fig.axes[0]``) has one bar per confidence bin whose height is the
    accuracy in that bin (0 for an empty bin); these are its first ``n_bins`` patches, in
    bin order. Hatched bars fill the gap between accuracy and mean confidence, the diagonal
    marks perfect calibration and the ECE (15 bins, as logged) is written in the corner.
    The lower axes shows the share of examples in each bin.
    """
    probs, target = torch.as_tensor(probs), torch.as_tensor(target)
    bins = {k: v.detach().cpu().double().numpy() for k, v in reliability_bins(probs, target, n_bins).items()}
    ece = expected_calibration_error(probs, target, n_bins=15).item()
    empty = bins["count"] == 0
    accuracy = np.where(empty, 0.0, bins["accuracy"])
    confidence = np.where(empty, 0.0, bins["confidence"])
    share = bins["count"] / max(bins["count"].sum(), 1)
    left, width = bins["lower"], bins["upper"] - bins["lower"]

    fig = Figure(figsize=(4.5, 5.5), layout="constrained")
    ax, ax_share = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.bar(left, accuracy, width=width, align="edge", color="tab:blue", edgecolor="black", label="Accuracy")
    ax.bar(
        left,
        confidence - accuracy,
        bottom=accuracy,
        width=width,
        align="edge",
        color="tab:red",
        alpha=0.3,
        edgecolor="tab:red",
        hatch="//",
        label="Gap",
    )
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", zorder=3, label="Perfect calibration")
    ax.text(
        0.97,
        0.03,
        f"ECE (15 bins) = {ece:.4f}",
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8},
    )
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="Accuracy", title=title)
    ax.legend(loc="upper left")

    ax_share.bar(left, share, width=width, align="edge", color="gray", edgecolor="black")
    ax_share.set(xlim=(0, 1), ylim=(0, 1), xlabel="Confidence", ylabel="Share")
    return fig


PARETO_METRICS = {"calibrated_nll": "Calibrated NLL", "ce2": "CE² (unbiased)", "error": "Error"}
"""The metrics of `pareto_figure`, one panel each, left to right: row key (the last part of the
stable metric name) -> panel label. Calibration is the unbiased squared calibration error, the one
the report's tests compare (the plug-in ECE's bias depends on each method's spread of confidences)."""

_MARKERS = "osD^vP*Xph<>"
#: what a hollow marker (Pareto figure) or a hatched bar (conformal figure) means
FLAGGED_NOTE = {mark: f"{mark}: {OUTSIDE_NOTE.strip('()')}" for mark in ("hollow marker", "hatched")}
#: the label of every interval bar `interval_bar` draws (left out of legends: it starts with "_")
INTERVAL_LABEL = "_interval"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, lower being better on both coordinates.

    Point j dominates point i when x_j <= x_i and y_j <= y_i with at least one strict. Equal
    points do not dominate each other, so all copies of a front point are on the front. A
    point with a nan coordinate is never on the front and dominates nothing. The indices come
    in the order of the front, by increasing x (then y, then index).
    """
    pts = [(float(x), float(y)) for x, y in points]
    valid = [i for i, (x, y) in enumerate(pts) if not (math.isnan(x) or math.isnan(y))]

    def dominated(i: int) -> bool:
        xi, yi = pts[i]
        return any(pts[j][0] <= xi and pts[j][1] <= yi and (pts[j][0] < xi or pts[j][1] < yi) for j in valid)

    return sorted((i for i in valid if not dominated(i)), key=lambda i: (*pts[i], i))


def front_steps(front: Sequence[tuple[float, float]], right: float | None = None) -> tuple[list[float], list[float]]:
    """The Pareto front's points (by increasing cost) as the vertices of its step line: the best value
    reached at or below each cost, so from each point across to the next one's cost and down to it,
    then across to `right` (the costliest method drawn) where that lies beyond the last point."""
    xs, ys = [front[0][0]], [front[0][1]]
    for x, y in front[1:]:
        xs += [x, x]
        ys += [ys[-1], y]
    if right is not None and right > xs[-1]:
        xs.append(right)
        ys.append(ys[-1])
    return xs, ys


def _measured(row: Mapping, metric: str) -> float | None:
    """The row's value of `metric`, or None where it is absent, None or nan."""
    value = row.get(metric)
    if value is None or math.isnan(float(value)):
        return None
    return float(value)


def _bounds(row: Mapping, metric: str) -> tuple[float, float] | None:
    """The row's ``<metric>_low`` and ``<metric>_high``, or None where it gives no interval."""
    low, high = row.get(f"{metric}_low"), row.get(f"{metric}_high")
    if low is None and high is None:
        return None
    if low is None or high is None:
        raise ValueError(f"{row.get('method')!r}: {metric} needs both {metric}_low and {metric}_high, got one")
    return float(low), float(high)


def interval_bar(
    ax, x: float, value: float, low: float, high: float, metric: str | None, color, zorder: float = 3
) -> bool:
    """Draw the interval [low, high] of `value` (the metric `metric`'s stable name, or its last part)
    at `x` as a capped vertical bar (an errorbar container labelled `INTERVAL_LABEL`), by the rule of
    every shown interval: within the metric's limits and exactly where it lies, whether or not it
    reaches `value`. Returns whether it misses `value` (the caller marks that)."""
    low, high, misses = shown_interval(metric, value, low, high)
    middle = (low + high) / 2
    ax.errorbar(
        [x],
        [middle],
        yerr=[[middle - low], [high - middle]],
        fmt="none",
        ecolor=color,
        capsize=3,
        zorder=zorder,
        label=INTERVAL_LABEL,
    )
    return misses


def pareto_figure(rows: Sequence[Mapping], title: str | None = None) -> Figure:
    """Quality against cost, one panel per metric of `PARETO_METRICS` (``fig.axes[0:3]``, in
    that order, each titled with its label).

    Each row is one method: ``{"method": name, "flops": prediction FLOPs per image, and for each
    metric its value with optional "<metric>_low" / "<metric>_high"}``. In each panel the x axis
    is the FLOPs (log scale) and every method with that metric is a marker (an ``ax.errorbar``
    container labelled with the method, same colour and marker in every panel, named in one figure
    legend), with its interval, where the row gives one, as a bar of its own (`interval_bar`: within
    the metric's limits; a marker outside its interval is hollow, and the panel says why). The Pareto
    front of the panel (`pareto_front` of (FLOPs, metric)) is a dashed step line (`front_steps`):
    the best value reached at or below each cost, stepping down at each better, costlier method and
    running on to the costliest method drawn. A metric no row has leaves its panel saying "not
    measured".
    """
    for row in rows:
        flops = row.get("flops")
        if flops is None or not float(flops) > 0 or math.isinf(float(flops)):
            raise ValueError(f"{row.get('method')!r}: flops must be a positive number for the log axis, got {flops}")
    colours = [f"C{i % 10}" for i in range(len(rows))]
    markers = [_MARKERS[i % len(_MARKERS)] for i in range(len(rows))]

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, len(PARETO_METRICS))
    handles = {}
    for ax, (metric, label) in zip(axes, PARETO_METRICS.items()):
        ax.set_xscale("log")
        ax.set(title=label, xlabel="Prediction FLOPs per image", ylabel=label)
        drawn = [(i, value) for i, row in enumerate(rows) if (value := _measured(row, metric)) is not None]
        if not drawn:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="gray")
            continue
        flagged = False
        for i, value in drawn:
            row, x = rows[i], float(rows[i]["flops"])
            bounds = _bounds(row, metric)
            misses = bounds is not None and interval_bar(ax, x, value, *bounds, metric, colours[i])
            flagged |= misses
            container = ax.errorbar(
                x,
                value,
                fmt=markers[i],
                color=colours[i],
                markersize=7,
                label=str(row["method"]),
                zorder=4,
                markerfacecolor="none" if misses else colours[i],
            )
            handles.setdefault(i, container)
        front = pareto_front([(float(rows[i]["flops"]), value) for i, value in drawn])
        xs, ys = front_steps(
            [(float(rows[drawn[k][0]]["flops"]), drawn[k][1]) for k in front],
            right=max(float(rows[i]["flops"]) for i, _ in drawn),
        )
        (front_line,) = ax.plot(xs, ys, linestyle="--", color="gray", zorder=3.5, label="Pareto front")
        if flagged:
            ax.text(
                0.02,
                0.02,
                FLAGGED_NOTE["hollow marker"],
                transform=ax.transAxes,
                fontsize="x-small",
                color="gray",
                wrap=True,
            )
        ax.grid(True, which="major", alpha=0.3)
    if handles:
        order = sorted(handles)
        fig.legend(
            [handles[i] for i in order] + [front_line],
            [str(rows[i]["method"]) for i in order] + ["Pareto front"],
            loc="outside right upper",
        )
    if title:
        fig.suptitle(title)
    return fig


def tuning_figure(
    curves: Mapping[str, Mapping[float, float]], chosen: Mapping[str, float], title: str | None = None
) -> Figure:
    """Validation NLL against the learning rate (log scale), one line per method, its choice marked;
    a rate that diverged (an infinite NLL) is left out of its line."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for method, curve in curves.items():
        points = sorted((lr, nll) for lr, nll in curve.items() if math.isfinite(nll))
        if not points:
            continue
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        if method in chosen and chosen[method] in curve and math.isfinite(curve[chosen[method]]):
            ax.plot([chosen[method]], [curve[chosen[method]]], marker="*", markersize=14, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("base learning rate")
    ax.set_ylabel("validation NLL (last epoch)")
    if title:
        ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (creating parent folders), close it, return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=150)
    if fig.canvas.manager is not None:  # made through pyplot: unregister it to free it
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path
