"""What the post-hoc posteriors of a point-estimate run (Laplace, SWAG) share: the run's network
held at its one structure α (`FixedStructureNetwork`, as laplace-torch sees it), and a method
around it with nothing to train whose members differ only in their weights
(`FixedStructurePosterior`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.methods.base import Method
from dbsn.methods.map import MAP
from dbsn.methods.settings import Execution, Prediction
from dbsn.methods.tasks import Segmentation

__all__ = ["FixedStructureNetwork", "FixedStructurePosterior", "point_estimate_structure"]


def point_estimate_structure(method: Method) -> Tensor:
    """The one structure α of a point-estimate method, (1, E, K); refuses any method whose
    prediction is stochastic (DBSN's sampled structures, MC dropout, BBB, a deep ensemble:
    pass its members one by one) and segmentation."""
    if not isinstance(method, MAP) or method.is_stochastic:
        kind = type(method).__name__ + (f" with {type(method.weights).__name__}" if isinstance(method, MAP) else "")
        raise ValueError(
            f"post-hoc Laplace/SWAG wrap a point-estimate method (map, map_fixed, or one "
            f"deep-ensemble member); got {kind}"
        )
    if isinstance(method.task, Segmentation):
        raise ValueError(
            "post-hoc Laplace/SWAG support classification only (the head of a segmentation network is a convolution)"
        )
    return method.prediction_structures(1).detach().clone()


class FixedStructureNetwork(nn.Module):
    """f(x) = net(x, α) for one fixed structure α: the network as laplace-torch sees it.

    Args:
        net: a network with `forward(x, alpha, replicate)` and a linear head `head`.
        alpha: the structure, (1, E, K) or (E, K).
        channels_last: feed x in the channels-last layout (as the method does).
        head: name of the last layer, an `nn.Linear` fed by the features φ(x).
    """

    def __init__(self, net: nn.Module, alpha: Tensor, channels_last: bool = False, head: str = "classifier") -> None:
        super().__init__()
        self.net = net
        self.register_buffer("alpha", alpha.reshape(1, *alpha.shape[-2:]))
        self.channels_last = channels_last
        self.head_name = head
        if not isinstance(self.head, nn.Linear):
            raise ValueError(f"the last layer {head!r} must be an nn.Linear, got {type(self.head).__name__}")

    @classmethod
    def of(cls, method: Method, head: str = "classifier") -> FixedStructureNetwork:
        """The network of a point-estimate `method` at its structure (sharing its weights)."""
        return cls(method.net, point_estimate_structure(method), method.channels_last, head)

    @property
    def head(self) -> nn.Linear:
        return self.net.get_submodule(self.head_name)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (b, C)."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x, self.alpha, replicate=True)

    def features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(φ(x), logits): the head's input (b, D) and output (b, C)."""
        captured: list[Tensor] = []
        handle = self.head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            logits = self(x)
        finally:
            handle.remove()
        return captured[0], logits


class FixedStructurePosterior(Method):
    """What the post-hoc posteriors (Laplace, SWAG) share: a finished point-estimate method's
    network held at its structure (`network_fixed`, its weights shared, not copied), nothing to
    train, and members that differ only in their weights.

    Args:
        base: the finished point-estimate method.
        n_samples: S, the members it predicts with.
        head: name of the network's last layer.
        temperature_scaling: a post-hoc temperature on top (fitted by `fit_temperature`).
    """

    def __init__(
        self, base: Method, n_samples: int, head: str = "classifier", temperature_scaling: bool = False
    ) -> None:
        alpha = point_estimate_structure(base)
        prediction = Prediction(
            n_samples=n_samples,
            val_samples=n_samples,
            samples_per_forward=base.samples_per_forward,
            temperature_scaling=temperature_scaling,
        )
        super().__init__(
            base.net,
            optim=base.optim,
            prediction=prediction,
            task=base.task,
            dataset_size=base.dataset_size,
            execution=Execution(channels_last=base.channels_last),
        )
        net = self.net
        del self.net  # kept once, inside the network at the fixed structure
        self.network_fixed = FixedStructureNetwork(net, alpha, base.channels_last, head)

    @property
    def is_stochastic(self) -> bool:
        return True

    def prediction_structures(self, n: int, first: int = 0) -> Tensor:
        return self.network_fixed.alpha.expand(n, -1, -1)

    def training_structures(self, n: int):
        raise NotImplementedError(f"a {type(self).__name__} is built post hoc from a finished run, not trained")

    def weight_parameters(self) -> list[nn.Parameter]:
        return []

    def feature_head(self) -> nn.Module:
        """The network's last layer (its point weights: each member's own last layer, where
        members differ there, is applied to these features)."""
        return self.network_fixed.head

    def enable_test_noise(self) -> None:
        """Nothing is stochastic in the network itself (point weights)."""
