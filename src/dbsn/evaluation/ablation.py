"""The Monte Carlo sample ablation's table and figure (the paper's Figure 5); the metrics of
every ensemble size are accumulated during the test pass by `dbsn.metrics.ablation.SampleAblation`."""

from __future__ import annotations

from matplotlib.figure import Figure

__all__ = ["CALIBRATED_NLL_FILE", "COLUMNS", "ablation_figure"]

COLUMNS = ("n_samples", "error", "nll", "brier", "ece")
#: each ablation size's calibrated NLL of every test example, where the ablation kept its ensembles
#: (`sizes` (S,), `nll` (S, N)): what the deep-ensemble equivalent's interval resamples
CALIBRATED_NLL_FILE = "ablation/calibrated_nll.npz"


def ablation_figure(results: dict[str, list[dict[str, float]]], title: str | None = None) -> Figure:
    """Test error (%), NLL and ECE against the number of samples S (log axis), one line per
    label (e.g. per method). The value at the right end is the full ensemble's."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = (("error", "Test error (%)", 100.0), ("nll", "Test NLL (nats)", 1.0), ("ece", "Test ECE (15 bins)", 1.0))
    for ax, (key, label, scale) in zip(axes, panels):
        for name, rows in results.items():
            s = [row["n_samples"] for row in rows]
            ax.plot(s, [scale * row[key] for row in rows], marker="o" if len(s) <= 12 else None, ms=3, label=name)
        ax.set_xscale("log")
        ax.set(xlabel="Monte Carlo samples S", ylabel=label, title=label.split(" (")[0] + " vs. S")
        ax.grid(True, which="both", alpha=0.3)
    if len(results) > 1 or any(results):
        axes[0].legend(title="method" if len(results) > 1 else None)
    if title:
        fig.suptitle(title)
    return fig
