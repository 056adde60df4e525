"""The samples a chain keeps, as part of a module's state dict.

A sample is a dict of named tensors (a network's parameters and BatchNorm statistics, or a
structure's logits). `SampleSet` keeps them on the CPU, outside `Module.to()` (they are needed one
at a time, at prediction), and writes them into the state dict of the module that owns it, so that
a checkpoint carries them and a resumed run or an evaluation rebuilt from the checkpoint has them:
under `<prefix><i>.<name>` for sample i, and the steps after which they were kept under
`<prefix>steps`. A state dict may hold any number of samples; loading one replaces the set.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

__all__ = ["SampleSet"]


class SampleSet(nn.Module):
    """A chain's kept samples, in the order kept, each with the step after which it was kept."""

    def __init__(self) -> None:
        super().__init__()
        self.members: list[dict[str, Tensor]] = []
        self.steps: list[int] = []

    @property
    def count(self) -> int:
        return len(self.members)

    def append(self, tensors: Mapping[str, Tensor], step: int) -> None:
        """Keep detached CPU copies of `tensors`, taken after `step`."""
        self.members.append({name: t.detach().to("cpu", copy=True) for name, t in tensors.items()})
        self.steps.append(int(step))

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.members[index]

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for i, member in enumerate(self.members):
            for name, tensor in member.items():
                destination[f"{prefix}{i}.{name}"] = tensor
        destination[f"{prefix}steps"] = torch.tensor(self.steps, dtype=torch.long)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        members: dict[int, dict[str, Tensor]] = {}
        steps = state_dict.get(f"{prefix}steps")
        for key, tensor in state_dict.items():
            if not key.startswith(prefix) or key == f"{prefix}steps":
                continue
            index, _, name = key[len(prefix) :].partition(".")
            if not index.isdigit() or not name:
                unexpected_keys.append(key)
                continue
            members.setdefault(int(index), {})[name] = tensor.detach().to("cpu")
        if sorted(members) != list(range(len(members))) or (steps is not None and len(steps) != len(members)):
            error_msgs.append(
                f"{prefix}: samples {sorted(members)} with {0 if steps is None else len(steps)} steps, "
                "not samples 0, 1, ... each with its step"
            )
            return
        self.members = [members[i] for i in range(len(members))]
        self.steps = [] if steps is None else [int(s) for s in steps]
