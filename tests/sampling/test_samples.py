"""The kept samples in a module's state dict (dbsn.sampling.SampleSet): written under the owner's
prefix, loaded back into a fresh module (any number of them, strict loading), kept on the CPU and
outside `Module.to()`, and a malformed set refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dbsn.sampling import SampleSet


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 3)
        self.samples = SampleSet()


def test_samples_round_trip_through_the_state_dict():
    owner = Owner()
    for step in (4, 9):
        owner.samples.append({"weight": owner.layer.weight * step, "bias": owner.layer.bias}, step)
    state = owner.state_dict()
    assert {k for k in state if k.startswith("samples.")} == {
        "samples.0.weight",
        "samples.0.bias",
        "samples.1.weight",
        "samples.1.bias",
        "samples.steps",
    }
    assert state["samples.steps"].tolist() == [4, 9] and not state["samples.1.weight"].requires_grad
    fresh = Owner()
    fresh.load_state_dict(state, strict=True)
    assert fresh.samples.count == 2 and fresh.samples.steps == [4, 9]
    for i in range(2):
        for name, tensor in owner.samples[i].items():
            assert torch.equal(fresh.samples[i][name], tensor)
    empty = Owner()
    fresh.load_state_dict(empty.state_dict(), strict=True)  # loading replaces the set
    assert fresh.samples.count == 0 and fresh.samples.steps == []


def test_samples_are_copies_on_the_cpu_outside_to():
    owner = Owner()
    owner.samples.append({"weight": owner.layer.weight}, 0)
    with torch.no_grad():
        owner.layer.weight.add_(1.0)
    assert not torch.equal(owner.samples[0]["weight"], owner.layer.weight)  # a copy, not the live tensor
    owner.to(torch.float64)
    assert owner.layer.weight.dtype == torch.float64 and owner.samples[0]["weight"].dtype == torch.float32
    assert owner.samples[0]["weight"].device.type == "cpu"


def test_a_malformed_set_is_refused_by_name():
    owner = Owner()
    owner.samples.append({"weight": torch.zeros(2)}, 3)
    state = owner.state_dict()
    state["samples.2.weight"] = state.pop("samples.0.weight")  # sample 0 missing
    with pytest.raises(RuntimeError, match=r"samples\.: samples \[2\] with 1 steps, not samples 0, 1, \.\.\."):
        Owner().load_state_dict(state)
