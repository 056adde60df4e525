"""How a method treats the network weights w: point estimate, MC dropout, or a Gaussian posterior.

A `WeightPosterior` is the weight-side half of a method (the structure side lives in the
method class). It may transform the network once (insert dropout, swap layers for Bayesian
ones), adds its KL term to the loss, and says how its noise behaves in a grouped forward:

- `stochastic`: predictions need S Monte Carlo samples;
- `shared_noise`: one draw is shared by every row of a forward call (BBB convolutions sample
  one weight tensor per call), so S independent members need S forward calls; otherwise each
  row of a grouped forward gets its own noise (dropout masks, flipout) and S members fit in
  one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from dbsn.bayes import BayesLayer, bayesianize, kl_divergence


class WeightPosterior:
    """Point-estimate weights (MAP under the L2 prior that SGD's weight decay implements)."""

    stochastic = False
    shared_noise = False

    def prepare(self, net: nn.Module) -> nn.Module:
        return net

    def kl(self, net: nn.Module, epoch: int) -> Tensor | float:
        """Weight-space KL(q(w) || p(w)) as it enters the per-example loss (times N)."""
        return 0.0

    def no_decay_parameters(self, net: nn.Module) -> list[nn.Parameter]:
        """Parameters of `net` that SGD's weight decay must not touch: those the KL alone
        regularises (none for point weights and dropout, whose L2 *is* the weight decay)."""
        return []

    def enable_test_noise(self, net: nn.Module) -> None:
        """Called after the network is put in eval mode for validation/test."""

    def cuda_graph_refusal(self) -> str | None:
        """Why a training step with these weights cannot be captured in a CUDA graph (None: it can)."""
        return None


PointWeights = WeightPosterior


def _insert_after_convs(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Conv2d):
            setattr(module, name, nn.Sequential(child, make()))
        else:
            _insert_after_convs(child, make)


PLACEMENTS = ("every_conv", "node_outputs", "existing")


@dataclass
class MCDropoutWeights(WeightPosterior):
    """MC dropout with rate `p`, kept active at test time when `test_time` is true, so S forward
    passes give S members.

    `placement`:

    - "node_outputs" (default) puts it on every node output of every cell (`Cell.node_output`):
      the DBSN research code's baseline, which produced the paper's MC dropout numbers;
    - "every_conv" inserts dropout after every convolution, four times inside each separable
      op: the placement the paper's text describes, and far harsher (114 dropout layers in the
      small B = 4, 3-cell network, which then barely trains);
    - "existing" keeps the network's own dropout layers and sets their rate to `p` (e.g. the
      FC-DenseNet's, for the Bayesian-SegNet-style segmentation baseline).
    """

    p: float = 0.2
    test_time: bool = True
    placement: str = "node_outputs"
    shared_noise = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"dropout rate p must be in [0, 1), got {self.p}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.test_time and self.p > 0

    def prepare(self, net: nn.Module) -> nn.Module:
        if self.placement == "every_conv":
            _insert_after_convs(net, lambda: nn.Dropout(self.p))
            return net
        if self.placement == "node_outputs":
            cells = [m for m in net.modules() if isinstance(getattr(m, "node_output", None), nn.Identity)]
            if not cells:
                raise ValueError(
                    f"placement='node_outputs' but {type(net).__name__} has no cells with node outputs: "
                    "use placement='every_conv', or 'existing' for the network's own dropout layers"
                )
            for cell in cells:
                cell.node_output = nn.Dropout(self.p)
            return net
        layers = [m for m in net.modules() if isinstance(m, nn.Dropout)]
        if not layers:
            raise ValueError(f"placement='existing' but {type(net).__name__} has no dropout layers")
        for m in layers:
            m.p = self.p
        return net

    def enable_test_noise(self, net: nn.Module) -> None:
        if self.test_time:
            for m in net.modules():
                if isinstance(m, nn.Dropout):
                    m.train()


@dataclass
class GaussianWeights(WeightPosterior):
    """Bayes by Backprop (Blundell et al. 2015): factorised Gaussians on every conv and linear
    weight and bias, deterministic BatchNorm, prior N(0, prior_sigma²) with closed-form KL.

    The loss gets `kl_weight · warm-up(epoch) · KL / N` (the research code: prior σ 0.1, KL
    weight 1e-3); the warm-up rises linearly from 0 to 1 over `warmup_epochs`. Linear layers use
    local reparameterisation; convolutions sample one weight tensor per forward call, or use
    flipout (`flipout=True`) for per-example noise.

    Regularisation. The scales ρ (σ = softplus(ρ)) get no weight decay (`no_decay_parameters`):
    at weight decay 1e-4, KL weight 1e-3 and N = 50,000, the decay's gradient on ρ = -5 is
    ~25,000 times the KL's, so decay (pulling ρ to 0, σ to 0.69), not the prior, would set σ.
    The means μ keep the weight decay on top of the prior's KL: it is the L2 every SGD-trained
    method of the comparison shares (the paper's recipe, weight decay 1e-4), and the KL's own
    pull on μ, kl_weight · μ / (σ_p² N) = 2e-6 · μ, is 50 times weaker than the decay's
    1e-4 · μ, so without the decay μ would be far less regularised than MAP's weights.
    """

    prior_sigma: float = 0.1
    init_rho: float = -5.0
    kl_weight: float = 1e-3
    warmup_epochs: int = 0
    flipout: bool = False
    stochastic = True

    @property
    def shared_noise(self) -> bool:  # type: ignore[override]
        return not self.flipout

    def prepare(self, net: nn.Module) -> nn.Module:
        return bayesianize(net, prior_sigma=self.prior_sigma, init_rho=self.init_rho, flipout=self.flipout)

    def kl(self, net: nn.Module, epoch: int) -> Tensor:
        warmup = min(1.0, (epoch + 1) / self.warmup_epochs) if self.warmup_epochs > 0 else 1.0
        return self.kl_weight * warmup * kl_divergence(net)

    def cuda_graph_refusal(self) -> str | None:
        if self.warmup_epochs > 0:
            return "the Gaussian weights' KL warm-up changes the loss's weighting every epoch (model.weights.warmup_epochs=0)"
        return None

    def no_decay_parameters(self, net: nn.Module) -> list[nn.Parameter]:
        """The scales ρ of every Bayesian layer (see the class docstring)."""
        layers = [m for m in net.modules() if isinstance(m, BayesLayer)]
        return [p for m in layers for p in (m.weight_rho, m.bias_rho) if p is not None]
