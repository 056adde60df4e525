"""Deep ensembles (Lakshminarayanan et al. 2017) of any point-estimate-structure method.

M members, each its own network initialised from its own seed, trained side by side in one job
(each with its own SGD, lr schedule and gradient clipping, so training one member is exactly
training it alone) or gathered from finished runs (`evaluate.py ckpt_path=[a,b,c]`). The
prediction averages the members' predictive *probabilities*:
p(y|x) = 1/M Σ_m p_m(y|x), where each p_m is itself a Bayes ensemble for stochastic members
(MC dropout, BBB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn

from dbsn.methods.base import Method
from dbsn.methods.map import MAP


class DeepEnsemble(Method):
    """An ensemble of `MAP`-family members (map, map_fixed, mc_dropout, bbb, fixed structures).

    Args:
        members: the member methods, already built (train.py builds `size` of them from the
            `member` config, each from its own seed).
        temperature_scaling: fit one temperature for the ensemble's prediction after training.
        size: the number of members the config asked for (checked).
    """

    def __init__(self, members: Sequence[Method], temperature_scaling: bool = False, size: int | None = None) -> None:
        members = list(members)
        if not members:
            raise ValueError("a deep ensemble needs at least one member")
        if size is not None and size != len(members):
            raise ValueError(f"size = {size} but {len(members)} members were given")
        for m in members:
            self.check_member(m)
        first = members[0]
        super().__init__(
            first.net,
            optim=first.optim,
            task=first.task,
            dataset_size=first.dataset_size,
            prediction=replace(first.prediction, temperature_scaling=temperature_scaling),
        )
        del self.net  # the members own their networks
        self.members = nn.ModuleList(members)

    @staticmethod
    def check_member(member: Method) -> None:
        """Refuse a member that cannot be trained side by side with the others: one that needs its own
        epoch hooks, or is not a point-structure method (an ensemble that trains none may accept any)."""
        if getattr(member, "epoch_state", False):
            raise ValueError(
                f"deep-ensemble members are trained side by side without their own epoch hooks, which a "
                f"{type(member).__name__} needs (e.g. SNGP's precision, reset every epoch): train the "
                "members as separate runs and ensemble them with evaluate.py ckpt_path=[run1,run2,...]"
            )
        if not isinstance(member, MAP):
            raise ValueError(
                f"deep-ensemble members must be point-structure methods (map, map_fixed, mc_dropout, "
                f"bbb); got {type(member).__name__}"
            )

    @property
    def is_stochastic(self) -> bool:
        return True

    def structure_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.members for p in m.structure_parameters()]

    def structure_optimizer(self):
        return self.members[0].structure_optimizer()

    def weight_parameter_groups(self) -> list[list[nn.Parameter]]:
        return [m.weight_parameters() for m in self.members]

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.members for p in m.no_decay_parameters()]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        for m in self.members:
            m.dataset_size = self.dataset_size

    def training_losses(self, x: Tensor, y: Tensor):
        """The step's loss member by member on one device (each member's backward frees its graph
        before the next member's forward: the activations of one network, not of M; the
        parameters are disjoint, so the gradients are those of the summed loss). Under DDP the
        summed loss in one part, so that every parameter is reduced in one backward."""
        if self._world_size() > 1:
            yield from super().training_losses(x, y)
            return
        for i, member in enumerate(self.members):
            out = member.training_loss(x, y)
            yield 1.0 / len(self.members), i == len(self.members) - 1, out  # loss adds up; nll, kl, error: means

    def training_loss(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Σ_m loss_m: parameters are disjoint, so each member gets its own loss's gradient."""
        outs = [m.training_loss(x, y) for m in self.members]
        return {
            "loss": sum(o["loss"] for o in outs),
            "nll": torch.stack([o["nll"] for o in outs]).mean(),  # mean member NLL
            "logits": outs[0]["logits"],
            "targets": outs[0]["targets"],
        }

    def predict_members(self, x: Tensor, n_samples: int | None = None, first: int = 0) -> Tensor:
        """(`first` does not apply: the members are networks, each with its own draws.)
        Each member's predictive log-probabilities (its own Bayes ensemble and temperature
        for stochastic or calibrated members), (M, b, C): the uncertainty decomposition of a
        deep ensemble is across its networks, and the sample ablation over 1..M networks."""
        return torch.stack([m.predict_log_probs(x, n_samples or m.n_samples) for m in self.members])

    def member_chunks(self, x: Tensor):
        yield self.predict_members(x)  # M networks: one chunk

    @property
    def num_members(self) -> int:
        """M, one prediction per network (each its own Bayes ensemble of its resolved S)."""
        return len(self.members)

    def predict_log_probs(self, x: Tensor, n_samples: int | None = None, first: int = 0) -> Tensor:
        return self.calibrate(torch.logsumexp(self.predict_members(x, n_samples), dim=0) - math.log(len(self.members)))

    def enable_test_noise(self) -> None:
        for m in self.members:
            m.enable_test_noise()

    # ------------------------------------------------------------------ what detection scores read
    # Member j of the ensemble is draw j // M of network j mod M: the networks first, then (for
    # stochastic members: MC dropout, BBB) their further draws.
    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits of members first .. first + n - 1, (n, b, C), in the order above."""
        size = len(self.members)
        return torch.cat([self.members[j % size].stochastic_forward(x, 1, j // size) for j in range(first, first + n)])

    @contextmanager
    def fixed_members(self, n: int):
        size = len(self.members)
        with ExitStack() as stack:
            for m, member in enumerate(self.members):
                stack.enter_context(member.fixed_members(len(range(m, n, size))))
            yield

    def member_outputs(self, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        size = len(self.members)
        parts = [self.members[m].member_outputs(x, len(range(m, n, size))) for m in range(min(n, size))]
        order = [(j % size, j // size) for j in range(n)]
        return (torch.stack([parts[m][0][d] for m, d in order]), torch.stack([parts[m][1][d] for m, d in order]))

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]] | None:
        size = len(self.members)
        parts = [self.members[m].member_heads(len(range(m, n, size))) for m in range(min(n, size))]
        if any(p is None for p in parts):
            return None
        return [parts[j % size][j // size] for j in range(n)]
