"""What detection scores read of a method: each member's logits and the features its last layer
sees.

The post-hoc OOD scores (max-logit, energy, Mahalanobis, KNN, ViM, ODIN; `dbsn.evaluation.detection`)
read each member's logits and the features its last layer sees. By convention that layer is the
network's `classifier`; a method whose members are not one network row by row says how to split
it (overriding `feature_head`, `fixed_members`, `member_outputs`, `head_input` or `member_heads`).
`MemberFeatures` is the part of `dbsn.methods.base.Method` that does so; it reads the method's
`net` and `stochastic_forward`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn


class FeaturesUnavailable(RuntimeError):
    """A method cannot give each member's features at its last layer (the message says why)."""


class MemberFeatures:
    """What detection scores read of a `Method` (see the module docstring)."""

    def feature_head(self) -> nn.Module | None:
        """The last layer, whose input are the features (None: this method has none)."""
        return getattr(getattr(self, "net", None), "classifier", None)

    def fixed_members(self, n: int):
        """A context in which members 0 .. n - 1 are the same networks at every call (the
        detection scores fit on training features and score test features member by member);
        members already fixed by their index (point estimates, ensembles, per-structure
        BatchNorm) need nothing."""
        return nullcontext()

    def member_outputs(self, x: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Logits (n, b, C) and features (n, b, D) of prediction members 0 .. n - 1 on x, one
        member per forward, the features captured at the input of `feature_head`.

        Raises `FeaturesUnavailable` when the method has no such layer, or when one member's
        forward does not pass the b examples through it once (in one call, or in the parts of
        `prediction.rows_per_forward`)."""
        head = self.feature_head()
        if head is None:
            raise FeaturesUnavailable(f"{type(self).__name__} has no last layer `classifier` to read features at")
        logits, features = [], []
        for s in range(n):
            captured: list[Tensor] = []
            handle = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
            try:
                logits.append(self.stochastic_forward(x, 1, s)[0])
            finally:
                handle.remove()
            features.append(self.head_input(captured, x.shape[0]))
        return torch.stack(logits), torch.stack(features)

    def head_input(self, captured: list[Tensor], batch: int) -> Tensor:
        """One member's features (b, D) from the inputs `feature_head` saw in its forward, in
        order (several calls: the forward ran its examples in parts)."""
        if not captured or sum(c.shape[0] for c in captured) != batch:
            raise FeaturesUnavailable(
                f"{type(self).__name__}'s last layer saw {[tuple(c.shape) for c in captured]} "
                f"in one member's forward, not the {batch} examples once"
            )
        return torch.cat(captured).flatten(1) if len(captured) > 1 else captured[0].flatten(1)

    def member_heads(self, n: int) -> list[tuple[Tensor, Tensor]] | None:
        """The linear last layer (W (C, D), b (C,)) of members 0 .. n - 1 on the features of
        `member_outputs` (ViM's origin and residual space): `feature_head`'s weights, the
        posterior means for a Bayesian layer; None where the last layer is not linear."""
        head = self.feature_head()
        weight = getattr(head, "weight_mu", getattr(head, "weight", None))
        bias = getattr(head, "bias_mu", getattr(head, "bias", None))
        if not isinstance(head, nn.Module) or not isinstance(weight, Tensor) or weight.ndim != 2:
            return None
        bias = torch.zeros(weight.shape[0], device=weight.device, dtype=weight.dtype) if bias is None else bias
        return [(weight.detach(), bias.detach())] * n
