"""Structure-posterior summaries, figures and the training callback that records them
(dbsn.evaluation.structure).
"""

from __future__ import annotations

import csv
import json
import math
from itertools import combinations

import pytest
import torch
import torch.nn.functional as F

from dbsn.evaluation.structure import (
    StructurePosteriorMonitor,
    edge_entropy,
    edge_labels,
    most_likely_structure,
    structure_diversity,
    structure_heatmap,
    structure_text,
    summarise_structure,
)
from dbsn.methods import DBSN, MAP
from dbsn.nets import StructureNet
from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.runtime.run import train
from tests.support.configs import compose_config, tiny_for

OPS = ["zero", "identity", "sep_conv_3x3", "dil_conv_3x3"]
EDGES = [(0, 1), (0, 2), (1, 2)]
PROBS = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.05, 0.05, 0.1, 0.8], [0.4, 0.3, 0.2, 0.1]])


def _net() -> StructureNet:
    torch.manual_seed(0)
    return StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)


def _relaxed(choices: list[list[int]], k: int = 3, top: float = 0.7) -> torch.Tensor:
    """Samples whose edge e puts `top` on op choices[s][e] and the rest evenly elsewhere."""
    one_hot = F.one_hot(torch.tensor(choices), k).double()
    return one_hot * top + (1 - one_hot) * (1 - top) / (k - 1)


# ---------------------------------------------------------------------- pure functions
def test_edge_labels_and_entropy_by_hand():
    assert edge_labels(EDGES) == ["0→1", "0→2", "1→2"]
    probs = torch.tensor([[0.25] * 4, [0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(edge_entropy(probs), torch.tensor([math.log(4), 0.0, math.log(2)], dtype=torch.float64))


def test_diversity_of_identical_samples():
    samples = _relaxed([[0, 1, 2, 0, 1, 2]] * 5)
    d = structure_diversity(samples)
    assert d["unique_structures"] == 1 and d["unique_fraction"] == pytest.approx(0.2)
    assert d["mean_hamming"] == 0.0
    assert d["mean_max_weight"] == pytest.approx(0.7)
    assert structure_diversity(samples[:1])["mean_hamming"] == 0.0


def test_diversity_of_two_structures_differing_on_two_of_six_edges():
    a, b = [0, 1, 2, 0, 1, 2], [0, 1, 2, 1, 1, 0]
    d = structure_diversity(_relaxed([a, a, b, a], top=0.9))
    # pairs (a,a) x3 differ on 0 edges, (a,b) x3 on 2 of 6: mean (3 * 0 + 3 * 2/6) / 6
    assert d["unique_structures"] == 2 and d["unique_fraction"] == pytest.approx(0.5)
    assert d["mean_hamming"] == pytest.approx(1 / 6)
    assert d["mean_max_weight"] == pytest.approx(0.9)


def test_diversity_hamming_equals_pairwise_brute_force():
    torch.manual_seed(1)
    samples = torch.softmax(3 * torch.randn(40, 7, 4), -1)
    chosen = samples.argmax(-1)
    pairs = [(chosen[i] != chosen[j]).float().mean() for i, j in combinations(range(40), 2)]
    d = structure_diversity(samples)
    assert d["mean_hamming"] == pytest.approx(float(torch.stack(pairs).mean()), rel=1e-6)
    assert d["unique_structures"] == len({tuple(c.tolist()) for c in chosen})


def test_most_likely_structure_and_text_name_the_argmax_ops():
    best = most_likely_structure(PROBS, EDGES, OPS)
    assert [(b["edge"], b["from"], b["to"], b["op"]) for b in best] == [
        ("0→1", 0, 1, "identity"),
        ("0→2", 0, 2, "dil_conv_3x3"),
        ("1→2", 1, 2, "zero"),
    ]
    assert [b["probability"] for b in best] == pytest.approx([0.6, 0.8, 0.4])
    text = structure_text(PROBS, EDGES, OPS, title="T")
    assert text.startswith("T\n") and "shared by all cells" in text
    assert "node 1 ← identity(node 0) 0.60\n" in text
    assert "node 2 ← dil_conv_3x3(node 0) 0.80, zero(node 1) 0.40\n" in text


def test_summary_is_json_ready_and_complete():
    samples = _relaxed([[1, 3, 0], [1, 3, 1]], k=4)
    summary = json.loads(json.dumps(summarise_structure(PROBS, samples, EDGES, OPS)))
    assert summary["op_names"] == OPS and summary["edges"] == [[0, 1], [0, 2], [1, 2]]
    assert torch.allclose(torch.tensor(summary["probabilities"], dtype=torch.float64), PROBS.double())
    assert summary["edge_entropy"] == pytest.approx(edge_entropy(PROBS).tolist())
    assert summary["mean_edge_entropy"] == pytest.approx(float(edge_entropy(PROBS).mean()))
    assert summary["max_entropy"] == pytest.approx(math.log(4))
    assert [m["op"] for m in summary["most_likely"]] == ["identity", "dil_conv_3x3", "zero"]
    assert summary["diversity"]["unique_structures"] == 2
    assert "diversity" not in summarise_structure(PROBS, None, EDGES, OPS)


def test_heatmap_shows_probs_with_edge_and_op_labels():
    fig = structure_heatmap(PROBS, EDGES, OPS, title="posterior")
    ax, ax_entropy, colourbar = fig.axes
    torch.testing.assert_close(torch.as_tensor(ax.images[0].get_array().data), PROBS.double())
    assert ax.images[0].get_clim() == (0.0, 1.0)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0→1", "0→2", "1→2"]
    assert [t.get_text() for t in ax.get_xticklabels()] == OPS
    assert ax.get_xlabel() == "Candidate operation" and ax.get_ylabel() == "Edge (from node → to node)"
    assert colourbar.get_ylabel() == "P(op selected on edge)"
    assert {t.get_text() for t in ax.texts} >= {"0.60", "0.80", "0.05"} and len(ax.texts) == 12
    assert [t.get_text() for t in ax_entropy.texts] == [f"{h:.2f}" for h in edge_entropy(PROBS).tolist()]


# ---------------------------------------------------------------------- the monitor's measurement
def test_measure_skips_fixed_structures_and_leaves_the_random_state_alone():
    monitor = StructurePosteriorMonitor(n_samples=50)
    assert monitor.measure(MAP(_net(), learn_structure=False, dataset_size=10)) is None
    assert monitor.measure(torch.nn.Linear(2, 2)) is None  # no structure_probabilities at all

    probs, samples = monitor.measure(MAP(_net(), dataset_size=10))  # one structure, repeated
    d = structure_diversity(samples)
    assert samples.shape == (50, 3, 4) and d["unique_structures"] == 1 and d["mean_hamming"] == 0.0

    method = DBSN(_net(), dataset_size=100)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    probs, samples = monitor.measure(method)
    assert torch.equal(torch.get_rng_state(), state)
    assert samples.shape == (50, 3, 4) and structure_diversity(samples)["unique_structures"] > 1
    torch.testing.assert_close(probs, method.structure_probabilities())


# ---------------------------------------------------------------------- end to end
def _digits(model: str, epochs: int) -> list[str]:
    return [
        f"model={model}",
        "data=digits",
        "data.batch_size=64",
        *tiny_for(model),
        f"trainer.max_epochs={epochs}",
        "trainer.limit_train_batches=3",
        "test=false",
    ]


@pytest.mark.slow
def test_training_logs_and_writes_the_structure_posterior(tmp_path):
    train(compose_config("train", _digits("dbsn", epochs=2), tmp_path), tmp_path)

    with open(next(tmp_path.glob("csv/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    for key in ("edge_entropy_mean", "edge_entropy_min", "unique_fraction", "mean_hamming", "mean_max_weight"):
        values = [float(r[f"structure/{key}"]) for r in rows if r.get(f"structure/{key}")]
        assert len(values) == 2, key
    assert all(0 < float(r["structure/unique_fraction"]) <= 1 for r in rows if r.get("structure/unique_fraction"))

    folder = tmp_path / "structure"
    for name in ("epoch_000.png", "epoch_001.png", "final.png", "final.txt", "final.json"):
        assert (folder / name).stat().st_size > 0, name
    summary = json.loads((folder / "final.json").read_text(encoding="utf-8"))
    state = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    expected = torch.softmax(state["structure.theta"] / state["beta"], -1)
    torch.testing.assert_close(torch.tensor(summary["probabilities"]), expected)
    assert summary["diversity"]["unique_structures"] >= 1 and summary["epochs"] == 2
    text = (folder / "final.txt").read_text(encoding="utf-8")
    assert all(f"{m['op']}(node {m['from']})" in text for m in summary["most_likely"])


@pytest.mark.slow
def test_fixed_structure_run_writes_no_structure_files(tmp_path):
    train(compose_config("train", _digits("map_fixed", epochs=1), tmp_path), tmp_path)
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "structure").exists()


def test_heatmap_takes_edge_names_of_a_network_with_two_structures():
    from dbsn.evaluation.structure import edge_names_of
    from dbsn.methods import DBSN
    from dbsn.nets import DBSNSegNet

    method = DBSN(DBSNSegNet(first_channels=8, growth=4, num_nodes=3, num_down=1))
    names = edge_names_of(method)
    assert names[:3] == ["down 0→1", "down 0→2", "down 1→2"] and names[3:] == ["up 0→1", "up 0→2", "up 1→2"]
    figure = structure_heatmap(method.structure_probabilities(), method.net.edges, method.net.op_names, labels=names)
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == names
    assert edge_names_of(DBSN(StructureNet(num_classes=10, num_nodes=3, cells_per_stage=1, growth=4))) is None
