"""DDU, Deep Deterministic Uncertainty (Mukhoti, Kirsch, van Amersfoort, Torr & Gal, CVPR 2023).

One deterministic network whose feature space keeps distances (`ddu_network`): a residual network
with every hidden convolution and linear layer spectrally normalised with a coefficient c
(`dbsn.nets.spectral`, SNGP's transform: W̄ = W · min(1, c / σ̂(W))), and, as the authors' `-mod`,
leaky ReLUs in place of the ReLUs. Training is MAP's (the softmax cross-entropy, SGD on the
weights); prediction is the softmax of one deterministic pass (S = 1), whose entropy is DDU's
aleatoric uncertainty (the test pass's `predictive_entropy`, the OOD evaluation's `entropy`).

DDU's epistemic uncertainty, the feature density under a Gaussian discriminant analysis fitted on
the training features, is the OOD evaluation's score `gda` (`dbsn.evaluation.gda.GDAScore`), fitted
on the unaugmented training split in eval mode (the authors' `get_embeddings`) and computed for
every method; so the method here is the network and its training, and the density is measured on
it, and on every other method beside it, by the same code.

The settings are the authors' (github.com/omegafragger/DDU; `conf/model/ddu.yaml` names each
source). Where this differs from their code: spectral normalisation is SNGP's parametrisation
(the same W / max(1, σ̂ / c), gradient through σ̂) with 50 warm-up power iterations at the first
step (theirs: none), and the shortcuts stay the backbone's spectrally normalised strided 1x1
convolutions (their `-mod` pools and pads with zeros). In full: docs/methods.md ("DDU").
"""

from __future__ import annotations

from torch import nn

from dbsn.methods.map import MAP
from dbsn.nets.backbone import Backbone
from dbsn.nets.spectral import spectral_normalize

__all__ = ["DDU", "ddu_network"]


def ddu_network(
    net: nn.Module,
    spectral_bound: float = 3.0,
    power_iterations: int = 1,
    *,
    input_size: int = 32,
    leaky_relu_slope: float | None = 0.01,
    head: str = "classifier",
) -> nn.Module:
    """`net` made DDU's network in place: every `nn.ReLU` module of a backbone (`Backbone`:
    ResNet-18, WideResNet, VGG16-BN) an `nn.LeakyReLU(leaky_relu_slope)` (None: kept), and every
    `nn.Conv2d` and `nn.Linear` but the head `head` spectrally normalised with coefficient
    `spectral_bound`. DBSN's cell network keeps its ReLUs: its fused cells apply them inside their
    own kernels, not as modules, so a swap would change its stem and not its cells."""
    if not isinstance(getattr(net, head, None), nn.Linear):
        raise ValueError(
            f"DDU reads the features at the network's last layer {head!r}, an nn.Linear; "
            f"{type(net).__name__} has {type(getattr(net, head, None)).__name__}"
        )
    if leaky_relu_slope is not None and isinstance(net, Backbone):
        for parent in list(net.modules()):
            for name, child in parent.named_children():
                if type(child) is nn.ReLU:
                    setattr(parent, name, nn.LeakyReLU(leaky_relu_slope))
    return spectral_normalize(net, spectral_bound, power_iterations, input_size=input_size, skip=(head,))


class DDU(MAP):
    """DDU's network and training on any network with a linear head `classifier` (see the module
    docstring).

    Args:
        net: the network (made DDU's network here: `ddu_network`).
        spectral_bound: c, the spectral norm coefficient of the hidden layers.
        power_iterations: power-iteration steps per training step.
        input_size: side of the training images (a convolution's norm depends on it).
        leaky_relu_slope: the negative slope of the leaky ReLUs that replace a backbone's ReLUs
            (None: keep the ReLUs).
        settings: `MAP`'s (structure on DBSN's cell network, optim, prediction, ...).
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        spectral_bound: float = 3.0,
        power_iterations: int = 1,
        input_size: int = 32,
        leaky_relu_slope: float | None = 0.01,
        **settings,
    ) -> None:
        if leaky_relu_slope is not None and not leaky_relu_slope >= 0:
            raise ValueError(f"leaky_relu_slope must be >= 0 (or null: ReLU), got {leaky_relu_slope}")
        net = ddu_network(
            net, spectral_bound, power_iterations, input_size=input_size, leaky_relu_slope=leaky_relu_slope
        )
        super().__init__(net, **settings)
        self.spectral_bound, self.power_iterations = float(spectral_bound), int(power_iterations)
        self.leaky_relu_slope = leaky_relu_slope
