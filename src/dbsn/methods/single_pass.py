"""Single-pass ensembles: M members inside one network, evaluated in one forward pass.

BatchEnsemble, Packed-Ensembles and MIMO promise what DBSN promises, an ensemble's uncertainty
at about the cost of one network. Here they share one base, `SinglePassEnsemble`, built on
`MAP`: on DBSN's cell network every member uses MAP's point structure (learned softmax(θ) or the
fixed uniform α), on a backbone without structure α only counts the members. The members differ
by what the network transform of each method gives them (rank-1 fast weights, channel groups, an
input and a head each).

The contract with `Method`'s loss and prediction: `training_structures` returns the point
structure once per member, (M, E, K), and `network(x, α)` returns logits with row i·M + m for
member m on example i, the layout of a grouped forward over M structures. The loss is then the
members' mean NLL on the batch (each member sees every example: the batch repetition of
BatchEnsemble; MIMO overrides the loss with its own input batch), and prediction averages the
M members' probabilities, like a deep ensemble. S is M: every prediction evaluates all members
at once, and `predict_members` returns them for the uncertainty decomposition, the ablation
over 1..M members and every evaluation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.methods.base import Method
from dbsn.methods.features import FeaturesUnavailable
from dbsn.methods.map import MAP


class SinglePassEnsemble(MAP):
    """M members in one network (see the module docstring); subclasses transform the network
    and override `network(x, alpha)` (rows i·M + m) where the default grouped forward does not
    give each row its member.

    Args:
        size: M, the number of members.
        settings: `MAP`'s (structure_optim, learn_structure, ...) and `Method`'s settings. The
            prediction's S (`prediction.n_samples`, `val_samples`) must be M or left at 1.
    """

    def __init__(self, net: nn.Module, *, size: int = 4, **settings) -> None:
        if size < 1:
            raise ValueError(f"size (M, the number of members) must be >= 1, got {size}")
        super().__init__(net, **settings)
        self.size = size
        for key in ("n_samples", "val_samples"):
            value = getattr(self.prediction, key)
            if value not in (1, size):
                raise ValueError(
                    f"prediction.{key}={value}: a {type(self).__name__} predicts with its M = {size} "
                    f"members; leave prediction.{key} at {size} (or 1)."
                )
            setattr(self.prediction, key, size)
        self.prediction.samples_per_forward = size

    @property
    def is_stochastic(self) -> bool:
        return True  # M members to average (one forward pass evaluates them all)

    @property
    def n_samples(self) -> int:
        return self.size

    @n_samples.setter
    def n_samples(self, value: int) -> None:
        if int(value) != self.size:
            raise ValueError(
                f"a {type(self).__name__} has M = {self.size} members, fixed by its network: "
                f"it cannot predict with S = {value} (leave n_samples unset)."
            )

    def cuda_graph_refusal(self) -> str | None:
        return Method.cuda_graph_refusal(self)

    def training_structures(self, n: int) -> tuple[Tensor, float]:
        """The point structure once per member, (M, E, K) (`n`, T, does not apply)."""
        return self.alpha().unsqueeze(0).expand(self.size, -1, -1), 0.0

    def prediction_structures(self, n: int, first: int = 0) -> Tensor:
        return self.alpha().detach().unsqueeze(0).expand(self.size, -1, -1)

    def _num_draws(self, n_samples: int | None) -> int:
        return self.size

    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits of members first .. first + n - 1 counted modulo M, (n, b, C), from one forward
        of all M. The members are fixed, so an evaluation that asks for members beyond the first
        M (the adversarial evaluation scores with members S_attack, S_attack + 1, ..., fresh draws
        for a sampling method) gets the same M again: there are no others."""
        logits = self.network(x, self.prediction_structures(self.size))  # (b·M, C), row i·M + m
        members = logits.view(x.shape[0], self.size, *logits.shape[1:]).transpose(0, 1)
        if first == 0 and n == self.size:
            return members
        return members[torch.arange(first, first + n, device=members.device) % self.size]

    # ------------------------------------------------------------------ what detection scores read
    def member_outputs(self, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Logits and features of members 0 .. n - 1 (modulo M) from one forward of all M."""
        captured: list[Tensor] = []
        head = self.feature_head()
        if head is None:
            raise FeaturesUnavailable(f"{type(self).__name__} has no last layer `classifier` to read features at")
        handle = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            logits = self.stochastic_forward(x, self.size)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise FeaturesUnavailable(f"{type(self).__name__}'s last layer ran {len(captured)} times in one forward")
        members = torch.arange(n, device=logits.device) % self.size
        return logits[members], self.member_features(captured[0], x.shape[0])[members]

    def member_features(self, head_input: Tensor, batch: int) -> Tensor:
        """Each member's features (M, b, D) from the last layer's input in one forward: here rows
        i·M + m (a network that runs every member on its own rows)."""
        return head_input.flatten(1).view(batch, self.size, -1).transpose(0, 1)
