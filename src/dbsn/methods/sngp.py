"""SNGP, the spectral-normalised neural Gaussian process (Liu et al., NeurIPS 2020).

A deterministic network made distance-aware (`sngp_network`): every hidden convolution and linear
layer spectrally normalised with a norm bound c (`dbsn.nets.spectral`), and the dense output layer
`classifier` replaced by a random-feature Gaussian process
(`dbsn.bayes.gp.RandomFeatureGaussianProcess`) whose output weights get a Laplace posterior.

Training is MAP's; the GP layer sums its output weights' precision over the training examples and
is reset at the start of every epoch, so after training it holds the final epoch's (the authors'
`gp_cov_discount_factor=-1` in uncertainty-baselines' `baselines/cifar/sngp.py`). Prediction is one
deterministic pass with the mean-field logits g / √(1 + λ var) (S = 1). Checkpoints hold the
precision and covariance the run ended with; under data-parallel DDP the processes' parts are
added (`sync_precision`) before validation and at each epoch's end.

Settings are the authors' CIFAR defaults (`conf/model/sngp.yaml` names each source). Where this
differs from their code: spectral normalisation is a parametrisation with the gradient through σ̂
(theirs overwrites the kernel with its projection; the forward is the same); the GP's output
weights and LayerNorm get no weight decay, as theirs. Details: docs/field.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from dbsn.bayes.gp import RandomFeatureGaussianProcess
from dbsn.methods.map import MAP
from dbsn.nets.spectral import spectral_normalize

__all__ = ["SNGP", "sngp_network"]


def sngp_network(
    net: nn.Module,
    spectral_bound: float = 6.0,
    power_iterations: int = 1,
    *,
    input_size: int = 32,
    gp: Mapping | None = None,
    head: str = "classifier",
) -> nn.Module:
    """`net` made an SNGP network in place: every `nn.Conv2d` and `nn.Linear` but the head
    spectrally normalised with bound `spectral_bound`, and the head (an `nn.Linear` named `head`)
    replaced by a `RandomFeatureGaussianProcess` on its input features (`gp`: that layer's
    settings). Works on any network that follows the conventions (`StructureNet`, `ResNet18`,
    `WideResNet`, `VGG16BN`)."""
    linear = getattr(net, head, None)
    if not isinstance(linear, nn.Linear):
        raise ValueError(
            f"SNGP replaces the network's last layer {head!r}, an nn.Linear; "
            f"{type(net).__name__} has {type(linear).__name__}"
        )
    spectral_normalize(net, spectral_bound, power_iterations, input_size=input_size, skip=(head,))
    setattr(net, head, RandomFeatureGaussianProcess(linear.in_features, linear.out_features, **dict(gp or {})))
    return net


class SNGP(MAP):
    """SNGP on any network with a linear head `classifier` (see the module docstring).

    Args:
        net: the network (made an SNGP network here: `sngp_network`).
        spectral_bound: c, the spectral norm bound of the hidden layers.
        power_iterations: power-iteration steps per training step.
        input_size: side of the training images (a convolution's norm depends on it).
        gp: settings of `RandomFeatureGaussianProcess` (hidden_dim, input_dim, normalize_input,
            feature_std, kernel_scale, ridge_penalty, mean_field_factor).
        settings: `MAP`'s (structure on DBSN's cell network, optim, prediction, ...).
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        spectral_bound: float = 6.0,
        power_iterations: int = 1,
        input_size: int = 32,
        gp: Mapping | None = None,
        **settings,
    ) -> None:
        net = sngp_network(net, spectral_bound, power_iterations, input_size=input_size, gp=gp)
        super().__init__(net, **settings)
        self.spectral_bound, self.power_iterations = float(spectral_bound), int(power_iterations)

    #: State kept by the epoch hooks (the precision): a deep ensemble cannot train it side by side.
    epoch_state = True

    @property
    def gp(self) -> RandomFeatureGaussianProcess:
        """The Gaussian-process output layer."""
        return self.net.classifier

    def no_decay_parameters(self) -> list[nn.Parameter]:
        """The GP layer's parameters (β, the LayerNorm's scale and offset) besides the weight
        posterior's: the authors' L2 covers convolution kernels and BatchNorm only."""
        return [*super().no_decay_parameters(), *self.gp.parameters()]

    def on_train_epoch_start(self) -> None:
        self.gp.reset_precision()

    def on_validation_epoch_start(self) -> None:
        self._sync_precision()

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        self._sync_precision()

    def _sync_precision(self) -> None:
        """Sum the processes' precisions (data-parallel DDP); one process: nothing to do."""
        if self._trainer is not None and self._world_size() > 1:
            self.gp.sync_precision(lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"))
