"""Figures for calibration: the reliability diagram (Guo et al., 2017, fig. 1).

Figures are built with :class:`matplotlib.figure.Figure` directly, not through pyplot, so
they work on a headless machine and never open a window.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from dbsn.metrics.classification import expected_calibration_error, reliability_bins

__all__ = ["reliability_diagram", "save_figure"]


def reliability_diagram(
    probs: Tensor, target: Tensor, n_bins: int = 10, title: str | None = None
) -> Figure:
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


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (creating parent folders), close it, return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=150)
    if fig.canvas.manager is not None:  # made through pyplot: unregister it to free it
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path
