"""Summaries and figures of the structure posterior, and a callback that tracks it in training.

The pure functions take tensors and label lists (no networks, no Lightning):

- `edge_labels`, `edge_entropy`: names "i→j" and the entropy (nats) of each edge's op law;
- `structure_diversity`: how different sampled structures α (n, E, K) are once discretised;
- `most_likely_structure`, `structure_text`: the argmax genotype, shared by all cells;
- `summarise_structure`: all of it as a JSON-ready dict;
- `structure_heatmap`: P(op selected on edge) as a heatmap with a per-edge entropy column.

`StructurePosteriorMonitor` applies them during training to any method whose
`structure_probabilities()` returns a tensor (DBSN: softmax(θ/β), MAP: softmax(θ)); it skips
methods without a learned structure (MAP-fixed α, ensembles) silently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from matplotlib.figure import Figure
from torch import Tensor

from dbsn.evaluation.plots import save_figure
from dbsn.evaluation.results import write_file

__all__ = [
    "StructurePosteriorMonitor",
    "edge_entropy",
    "edge_labels",
    "most_likely_structure",
    "structure_diversity",
    "structure_heatmap",
    "structure_text",
    "summarise_structure",
]

ARROW = "→"


# ---------------------------------------------------------------------- pure functions
def edge_labels(edges: Sequence[tuple[int, int]]) -> list[str]:
    """ "i→j" for each edge (i, j)."""
    return [f"{i}{ARROW}{j}" for i, j in edges]


def _cpu(t: Tensor) -> Tensor:
    return torch.as_tensor(t).detach().cpu().double()


def edge_entropy(probs: Tensor) -> Tensor:
    """Entropy in nats of each edge's operation distribution, (E, K) -> (E,); 0 log 0 = 0."""
    probs = _cpu(probs)
    return -torch.special.xlogy(probs, probs).sum(-1)


def structure_diversity(samples: Tensor) -> dict[str, float]:
    """How diverse n sampled structures α (n, E, K) are, each discretised by argmax per edge.

    Returns:
        unique_structures: number of distinct discrete structures;
        unique_fraction: unique_structures / n;
        mean_hamming: mean over the n(n-1)/2 pairs of the fraction of edges whose selected
            op differs (0 for n = 1);
        mean_max_weight: mean over samples and edges of max_k α (1 for one-hot samples).
    """
    samples = _cpu(samples)
    if samples.dim() != 3 or samples.shape[0] < 1:
        raise ValueError(f"samples must be (n >= 1, E, K), got {tuple(samples.shape)}")
    n, num_edges, k = samples.shape
    chosen = samples.argmax(-1)  # (n, E)
    unique = torch.unique(chosen, dim=0).shape[0]
    if n > 1:
        # On edge e with c_ek samples selecting op k, sum_k c_ek (n - c_ek) / 2 pairs differ.
        counts = torch.nn.functional.one_hot(chosen, k).sum(0).double()  # (E, K)
        differing = (n * n - (counts**2).sum(-1)) / 2  # (E,)
        mean_hamming = float(differing.sum() / (n * (n - 1) / 2) / num_edges)
    else:
        mean_hamming = 0.0
    return {
        "unique_structures": int(unique),
        "unique_fraction": unique / n,
        "mean_hamming": mean_hamming,
        "mean_max_weight": float(samples.max(-1).values.mean()),
    }


def most_likely_structure(probs: Tensor, edges: Sequence[tuple[int, int]], op_names: Sequence[str]) -> list[dict]:
    """The most probable op on each edge: [{"edge", "from", "to", "op", "probability"}, ...]."""
    probs = _cpu(probs)
    best = probs.argmax(-1)
    return [
        {"edge": label, "from": int(i), "to": int(j), "op": op_names[int(b)], "probability": float(probs[e, b])}
        for e, ((i, j), label, b) in enumerate(zip(edges, edge_labels(edges), best))
    ]


def structure_text(
    probs: Tensor, edges: Sequence[tuple[int, int]], op_names: Sequence[str], title: str | None = None
) -> str:
    """The most likely structure as text, one line per destination node, then the per-edge
    entropies. The structure (and so this genotype) is shared by all cells. E.g.

        node 2 ← identity(node 0) 0.91, sep_conv_3x3(node 1) 0.48
    """
    entropy = edge_entropy(probs)
    lines = [title] if title else []
    lines.append("Most likely structure (shared by all cells): op(source) P(op selected)")
    by_node: dict[int, list[str]] = {}
    for entry in most_likely_structure(probs, edges, op_names):
        by_node.setdefault(entry["to"], []).append(f"{entry['op']}(node {entry['from']}) {entry['probability']:.2f}")
    lines += [f"  node {j} ← " + ", ".join(parts) for j, parts in sorted(by_node.items())]
    lines.append(f"Edge entropy (nats, max log K = {math.log(len(op_names)):.3f}), mean {float(entropy.mean()):.3f}:")
    lines.append("  " + ", ".join(f"{label} {h:.3f}" for label, h in zip(edge_labels(edges), entropy.tolist())))
    return "\n".join(lines)


def summarise_structure(
    probs: Tensor, samples: Tensor | None, edges: Sequence[tuple[int, int]], op_names: Sequence[str]
) -> dict:
    """Everything about the structure posterior as a JSON-ready dict."""
    entropy = edge_entropy(probs)
    summary = {
        "op_names": list(op_names),
        "edges": [[int(i), int(j)] for i, j in edges],
        "edge_labels": edge_labels(edges),
        "probabilities": _cpu(probs).tolist(),
        "edge_entropy": entropy.tolist(),
        "mean_edge_entropy": float(entropy.mean()),
        "max_entropy": math.log(len(op_names)),
        "most_likely": most_likely_structure(probs, edges, op_names),
    }
    if samples is not None:
        summary["diversity"] = structure_diversity(samples)
    return summary


def structure_heatmap(
    probs: Tensor,
    edges: Sequence[tuple[int, int]],
    op_names: Sequence[str],
    title: str | None = None,
    labels: Sequence[str] | None = None,
) -> Figure:
    """Heatmap of P(op selected on edge): edges on the y axis, ops on the x axis.

    `labels` name the edges (default "i→j"; e.g. "down 0→1" / "up 0→1" for a network with
    several structures, from its `edge_names()`).

    `fig.axes[0]` is the heatmap (its one image holds `probs`, colours on [0, 1], every cell
    annotated), `fig.axes[1]` a narrow column with each edge's entropy in nats (shaded by
    entropy / log K), `fig.axes[2]` the colourbar.
    """
    p = _cpu(probs).numpy()
    num_edges, k = p.shape
    entropy = edge_entropy(probs).numpy()
    labels = list(labels) if labels is not None else edge_labels(edges)

    fig = Figure(figsize=(1.1 * k + 3.2, 0.38 * num_edges + 1.9), layout="constrained")
    ax, ax_h = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [k, 1.1]})
    image = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for e in range(num_edges):
        for j in range(k):
            ax.text(
                j,
                e,
                f"{p[e, j]:.2f}",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if p[e, j] < 0.55 else "black",
            )
    ax.set_xticks(range(k), list(op_names), rotation=30, ha="right")
    ax.set_yticks(range(num_edges), labels)
    ax.set(xlabel="Candidate operation", ylabel="Edge (from node → to node)", title=title)

    max_entropy = math.log(k) if k > 1 else 1.0
    ax_h.imshow((entropy / max_entropy)[:, None], cmap="Greys", vmin=0.0, vmax=1.6, aspect="auto")
    for e in range(num_edges):
        ax_h.text(0, e, f"{entropy[e]:.2f}", ha="center", va="center", fontsize=8)
    ax_h.set_xticks([0], [f"entropy\n(nats,\nmax {math.log(k):.2f})"])
    ax_h.tick_params(axis="y", left=False, labelleft=False)
    fig.colorbar(image, ax=[ax, ax_h], label="P(op selected on edge)", shrink=0.9)
    return fig


def structure_files(
    probs: Tensor,
    samples: Tensor | None,
    edges: Sequence[tuple[int, int]],
    op_names: Sequence[str],
    title: str,
    extra: dict | None = None,
    labels: Sequence[str] | None = None,
) -> dict[str, object]:
    """The structure posterior's files: `final.json` (`summarise_structure` + `extra`),
    `final.txt` (`structure_text`) and `final.png` (`structure_heatmap`), by file name (for
    `dbsn.evaluation.results.write_file`)."""
    return {
        "final.json": {**summarise_structure(probs, samples, edges, op_names), **(extra or {})},
        "final.txt": structure_text(probs, edges, op_names, title=title),
        "final.png": structure_heatmap(probs, edges, op_names, title=title, labels=labels),
    }


# ---------------------------------------------------------------------- callback
def _fork_rng(device: torch.device):
    """Random draws inside do not change the random state outside (CPU and the module's device)."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else 0
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def edge_names_of(pl_module) -> list[str] | None:
    """Edge labels from the network's `edge_names()` (several structures), if it has one."""
    names = getattr(getattr(pl_module, "net", None), "edge_names", None)
    return list(names()) if callable(names) else None


class StructurePosteriorMonitor(pl.Callback):
    """Watch the structure posterior sharpen during training.

    Every `every_n_epochs` training epochs it logs `structure/edge_entropy_mean`,
    `structure/edge_entropy_min` (of `structure_probabilities()`) and, from
    `prediction_structures(n_samples)`, `structure/unique_fraction`, `structure/mean_hamming`
    and `structure/mean_max_weight` (see `structure_diversity`). With `save_figures` it writes
    the heatmap to `<output_dir>/structure/epoch_{epoch:03d}.png` and sends it to every
    `WandbLogger` as `structure/heatmap`. At the end of fit it writes `structure/final.json`
    (`summarise_structure`), `final.txt` (`structure_text`) and `final.png`.

    Methods whose `structure_probabilities()` is missing or returns None are skipped. The
    structure draws run in a forked random state, so training is the same with or without it.

    Args:
        every_n_epochs: log every this many training epochs.
        n_samples: structures drawn for the diversity statistics.
        save_figures: write (and log) the per-epoch heatmap.
        output_dir: the run folder; None uses `trainer.default_root_dir`.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        n_samples: int = 100,
        save_figures: bool = True,
        output_dir: str | None = None,
    ) -> None:
        if every_n_epochs < 1 or n_samples < 1:
            raise ValueError(f"every_n_epochs and n_samples must be >= 1, got {every_n_epochs}, {n_samples}")
        self.every_n_epochs = every_n_epochs
        self.n_samples = n_samples
        self.save_figures = save_figures
        self.output_dir = output_dir

    # -------------------------------------------------------------- helpers
    def measure(self, pl_module: pl.LightningModule) -> tuple[Tensor, Tensor | None] | None:
        """(structure probabilities (E, K) on CPU, n_samples sampled structures or None), or
        None when the module has no learned structure. Leaves the random state untouched."""
        get_probs = getattr(pl_module, "structure_probabilities", None)
        if not callable(get_probs):
            return None
        with torch.no_grad(), _fork_rng(pl_module.device):
            probs = get_probs()
            if probs is None:
                return None
            sample = getattr(pl_module, "prediction_structures", None)
            samples = sample(self.n_samples).detach().cpu() if callable(sample) else None
        return probs.detach().float().cpu(), samples

    def _output_dir(self, trainer: pl.Trainer) -> Path:
        return Path(self.output_dir or trainer.default_root_dir) / "structure"

    @staticmethod
    def _labels(pl_module: pl.LightningModule, probs: Tensor) -> tuple[list[tuple[int, int]], list[str]]:
        net = getattr(pl_module, "net", None)
        num_edges, k = probs.shape
        edges = list(getattr(net, "edges", None) or [(e, e) for e in range(num_edges)])
        op_names = list(getattr(net, "op_names", None) or [f"op{j}" for j in range(k)])
        return edges, op_names

    # -------------------------------------------------------------- hooks
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if (epoch + 1) % self.every_n_epochs:
            return
        measured = self.measure(pl_module)
        if measured is None:
            return
        probs, samples = measured
        entropy = edge_entropy(probs)
        metrics = {
            "structure/edge_entropy_mean": float(entropy.mean()),
            "structure/edge_entropy_min": float(entropy.min()),
        }
        if samples is not None:
            diversity = structure_diversity(samples)
            metrics.update(
                {f"structure/{k}": float(diversity[k]) for k in ("unique_fraction", "mean_hamming", "mean_max_weight")}
            )
        pl_module.log_dict(metrics, on_step=False, on_epoch=True)
        if self.save_figures:
            self._write_epoch_figure(trainer, pl_module, probs, epoch)

    @rank_zero_only
    def _write_epoch_figure(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, probs: Tensor, epoch: int
    ) -> None:
        edges, op_names = self._labels(pl_module, probs)
        figure = structure_heatmap(
            probs, edges, op_names, title=f"Structure posterior, epoch {epoch}", labels=edge_names_of(pl_module)
        )
        path = save_figure(figure, self._output_dir(trainer) / f"epoch_{epoch:03d}.png")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="structure/heatmap", images=[str(path)], step=trainer.global_step)

    @rank_zero_only
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        measured = self.measure(pl_module)
        if measured is None:
            return
        probs, samples = measured
        edges, op_names = self._labels(pl_module, probs)
        title = f"Structure posterior after {trainer.current_epoch} epochs"
        files = structure_files(
            probs,
            samples,
            edges,
            op_names,
            title,
            labels=edge_names_of(pl_module),
            extra={"epochs": trainer.current_epoch},
        )
        for name, content in files.items():
            write_file(self._output_dir(trainer) / name, content)
