"""Every method on DBSN's cell network trains and predicts the same with the fused cell as with the
per-edge reference (float64, from the same state): a training step's loss, every gradient (θ's
too) and running statistics, in one grouped forward and in chunks of structures, and the
prediction's members. VOGN and Packed-Ensembles, which need every edge's own layers, run the
per-edge cell whatever the setting (`dbsn.nets.fused_cell.unfuse`)."""

from __future__ import annotations

import copy

import pytest
import torch

from dbsn.bayes import set_sampling
from dbsn.nets import FusedCell
from dbsn.runtime.build import build_model
from tests.support.configs import compose_config, small_model
from tests.support.steputil import assert_same, prediction, step_state

#: the methods of the cell network, with the overrides that put them on it
METHODS = {
    "dbsn": [],
    "fbn": [],
    "map": [],
    "map_fixed": [],
    "mc_dropout": [],
    "bbb": [],
    "deep_ensemble": ["model.size=2"],
    "vogn": [],
    "vogn_fbn": [],
    "batch_ensemble": ["model/net=structure_net"],
    "packed_ensemble": ["model/net=structure_net", "model.min_channels_per_group=1"],
    "mimo": ["model/net=structure_net"],
}


def _build(model: str, cell: str, tmp_path, chunk: int | None = None):
    prefix = "model.member.net" if model == "deep_ensemble" else "model.net"
    overrides = [*METHODS[model], f"{prefix}.cell={cell}", f"{prefix}.growth=4", f"{prefix}.stem_channels=8"]
    if model in ("dbsn", "fbn"):
        overrides += ["model.train_samples=4"] + ([f"model.train_samples_per_forward={chunk}"] if chunk else [])
    cfg = compose_config("train", small_model(model, *overrides), tmp_path)
    torch.manual_seed(0)
    method = build_model(cfg.model, num_classes=5).double()
    for m in [method, *getattr(method, "members", [])]:
        m.dataset_size = 50
    set_sampling(method, False)  # Gaussian weights at their means: the two cells draw their noise in another order
    return method


def _as_per_edge(reference, fused, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`step_state` of the fused method renamed as the per-edge method holds it."""
    converted = fused.state_dict()
    converted.update({key[len("grad/") :]: value for key, value in state.items() if key.startswith("grad/")})
    converted.update({key: value for key, value in state.items() if key in converted})
    twin = copy.deepcopy(reference)
    twin.load_state_dict(converted)
    named = dict(twin.state_dict())
    return {
        key: state["loss"] if key == "loss" else named[key[len("grad/") :] if key.startswith("grad/") else key]
        for key in _reference_keys(reference, state)
    }


def _reference_keys(reference, fused_state):
    keys = ["loss"] + [f"grad/{name}" for name, _ in reference.named_parameters()]
    return keys + [name for name, _ in reference.named_buffers() if "running_" in name or "num_batches" in name]


@pytest.mark.parametrize("model", list(METHODS))
def test_every_method_steps_and_predicts_the_same_with_the_fused_cell(model, tmp_path):
    reference = _build(model, "per_edge", tmp_path)
    fused = _build(model, "fused", tmp_path)
    fused.load_state_dict(reference.state_dict())
    fuses = model not in ("vogn", "vogn_fbn", "packed_ensemble")
    assert any(isinstance(m, FusedCell) for m in fused.modules()) == fuses
    generator = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(6, 3, 16, 16, generator=generator, dtype=torch.float64),
        torch.randint(0, 5, (6,), generator=generator),
    )
    expected = step_state(reference, x, y)
    actual = _as_per_edge(reference, fused, step_state(fused, x, y))
    expected = {k: v for k, v in expected.items() if k in actual}
    kinds = assert_same(expected, actual, rtol=1e-9, atol=1e-11)
    assert kinds["weight gradients"] > 0 and kinds["running statistics"] > 0
    torch.testing.assert_close(prediction(fused, x, 3), prediction(reference, x, 3), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("chunk", [1, 3])
def test_dbsn_in_chunks_of_structures_is_the_same_with_the_fused_cell(chunk, tmp_path):
    """T = 4 structures one chunk at a time (the memory knob), and a last chunk smaller than the others."""
    reference = _build("dbsn", "per_edge", tmp_path, chunk)
    fused = _build("dbsn", "fused", tmp_path, chunk)
    fused.load_state_dict(reference.state_dict())
    x, y = torch.randn(6, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (6,))
    kinds = assert_same(
        step_state(reference, x, y), _as_per_edge(reference, fused, step_state(fused, x, y)), rtol=1e-9, atol=1e-11
    )
    assert kinds["theta gradient"] == 1
