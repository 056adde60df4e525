"""Bayes by Backprop (Blundell et al. 2015) layers: factorised Gaussian weights and biases.

Every weight and bias w has the variational posterior q(w) = N(mu, sigma^2) with
sigma = softplus(rho), and the prior p(w) = N(0, prior_sigma^2), so KL(q || p) has a closed
form (``gaussian_kl``). BatchNorm stays deterministic. How a layer turns q into an output:

- ``BayesLinear``: local reparameterisation (Kingma et al. 2015) by default. The
  pre-activation of each example and unit is Gaussian given the input, so it is sampled
  directly: the same marginal as sampling the weights, independent across examples, with
  lower gradient variance. Otherwise one weight matrix per forward call.
- ``BayesConv2d``: one weight sample per forward call, shared by the minibatch (local
  reparameterisation would ignore that a conv weight is shared across positions), or
  Flipout (Wen et al. 2018), which decorrelates the examples of a batch at the cost of a
  second convolution.

A layer's ``sample`` attribute switches sampling off (``set_sampling``): it then computes
with the posterior means, a deterministic prediction. Sampling does not follow
``train()`` / ``eval()``, because BBB predicts by averaging over weight samples at test time.

``bayesianize`` turns the convs and linears of an existing network into these layers in
place; ``kl_divergence`` sums the KL of a network for the loss NLL + KL / N.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from dbsn.precision import float32

__all__ = [
    "BayesConv2d",
    "BayesLayer",
    "BayesLinear",
    "bayesianize",
    "gaussian_kl",
    "kl_divergence",
    "set_sampling",
]


def gaussian_kl(mu: Tensor, sigma: Tensor, prior_sigma: float | Tensor) -> Tensor:
    """KL(N(mu, sigma^2) || N(0, prior_sigma^2)) summed over all elements (a 0-dim tensor).

    Per element: log(prior_sigma / sigma) + (sigma^2 + mu^2) / (2 prior_sigma^2) - 1/2.
    """
    prior_sigma = torch.as_tensor(prior_sigma, dtype=sigma.dtype, device=sigma.device)
    kl = torch.log(prior_sigma / sigma) + (sigma.square() + mu.square()) / (2 * prior_sigma.square()) - 0.5
    return kl.sum()


class BayesLayer(nn.Module):
    """Gaussian posterior over one weight tensor and an optional bias: the shared half of
    ``BayesLinear`` and ``BayesConv2d``, which differ only in how they compute an output.

    Parameters ``weight_mu``, ``weight_rho`` and, with a bias, ``bias_mu``, ``bias_rho``
    (else registered as None). mu starts as PyTorch's default init of the deterministic layer
    (Kaiming uniform, bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))), rho as the constant
    ``init_rho`` (sigma = softplus(-5) ~ 6.7e-3 by default).
    """

    def __init__(self, weight_shape: tuple[int, ...], bias: bool, prior_sigma: float, init_rho: float) -> None:
        super().__init__()
        if prior_sigma <= 0:
            raise ValueError(f"prior_sigma must be > 0, got {prior_sigma}")
        self.prior_sigma = float(prior_sigma)
        self.init_rho = float(init_rho)
        self.sample = True
        self.weight_mu = nn.Parameter(torch.empty(weight_shape))
        self.weight_rho = nn.Parameter(torch.empty(weight_shape))
        if bias:
            self.bias_mu = nn.Parameter(torch.empty(weight_shape[0]))
            self.bias_rho = nn.Parameter(torch.empty(weight_shape[0]))
        else:
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_rho", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """mu as ``nn.Linear`` / ``nn.Conv2d`` initialise their weights, rho = init_rho."""
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        nn.init.constant_(self.weight_rho, self.init_rho)
        if self.bias_mu is not None:
            fan_in = self.weight_mu[0].numel()
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(self.bias_mu, -bound, bound)
            nn.init.constant_(self.bias_rho, self.init_rho)

    @property
    def weight_sigma(self) -> Tensor:
        return F.softplus(self.weight_rho)

    @property
    def bias_sigma(self) -> Tensor | None:
        return None if self.bias_rho is None else F.softplus(self.bias_rho)

    def sample_weights(self) -> tuple[Tensor, Tensor | None]:
        """(weight, bias) = mu + sigma * eps, one draw; the means when ``sample`` is off."""
        if not self.sample:
            return self.weight_mu, self.bias_mu
        weight = self.weight_mu + self.weight_sigma * torch.randn_like(self.weight_mu)
        bias = None
        if self.bias_mu is not None:
            bias = self.bias_mu + self.bias_sigma * torch.randn_like(self.bias_mu)
        return weight, bias

    def kl(self) -> Tensor:
        """Closed-form KL(q || p) summed over the weight and bias elements."""
        kl = gaussian_kl(self.weight_mu, self.weight_sigma, self.prior_sigma)
        if self.bias_mu is not None:
            kl = kl + gaussian_kl(self.bias_mu, self.bias_sigma, self.prior_sigma)
        return kl

    def _copy_means_from(self, layer: nn.Linear | nn.Conv2d) -> None:
        """mu <- the weights and bias of a deterministic layer; device and dtype follow it."""
        self.to(device=layer.weight.device, dtype=layer.weight.dtype)
        with torch.no_grad():
            self.weight_mu.copy_(layer.weight)
            if layer.bias is not None:
                self.bias_mu.copy_(layer.bias)

    def extra_repr(self) -> str:
        return f"prior_sigma={self.prior_sigma}, init_rho={self.init_rho}, sample={self.sample}"


class BayesLinear(BayesLayer):
    """Linear layer with Gaussian weights and bias.

    With ``local_reparameterization`` (default) each output is drawn from its Gaussian
    marginal given the input: mean = x mu_W^T + mu_b, var = x^2 (sigma_W^2)^T + sigma_b^2,
    out = mean + sqrt(var) * eps with eps independent per example and unit. Without it, one
    weight matrix is sampled per forward call and shared by the batch.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        prior_sigma: float = 0.1,
        init_rho: float = -5.0,
        local_reparameterization: bool = True,
    ) -> None:
        super().__init__((out_features, in_features), bias, prior_sigma, init_rho)
        self.in_features = in_features
        self.out_features = out_features
        self.local_reparameterization = local_reparameterization

    @classmethod
    def from_deterministic(
        cls,
        layer: nn.Linear,
        prior_sigma: float = 0.1,
        init_rho: float = -5.0,
        local_reparameterization: bool = True,
    ) -> BayesLinear:
        """The Bayesian twin of ``layer``: same shape, mu = its weight and bias."""
        twin = cls(
            layer.in_features,
            layer.out_features,
            layer.bias is not None,
            prior_sigma,
            init_rho,
            local_reparameterization,
        )
        twin._copy_means_from(layer)
        return twin

    def forward(self, x: Tensor) -> Tensor:
        if not (self.sample and self.local_reparameterization):
            return F.linear(x, *self.sample_weights())
        mean = F.linear(x, self.weight_mu, self.bias_mu)
        var = F.linear(
            x.square(), self.weight_sigma.square(), None if self.bias_mu is None else self.bias_sigma.square()
        )
        # var is 0 for an all-zero input without bias; keep sqrt's gradient finite there.
        std = var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()
        return mean + std * torch.randn_like(mean)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias_mu is not None}, local_reparameterization="
            f"{self.local_reparameterization}, {super().extra_repr()}"
        )


class BayesConv2d(BayesLayer):
    """2d convolution with Gaussian weights and bias; any stride, padding, dilation, groups
    (``groups=in_channels`` is a depthwise conv). Zero padding only.

    By default one weight sample per forward call, shared by the minibatch. With
    ``flipout=True`` (Wen et al. 2018) example n gets the perturbation dW * (s_out s_in^T)
    of one shared draw dW = sigma * eps, with random signs s_in (input channels) and s_out
    (output channels) per example:
        out = conv(x, mu) + conv(x * s_in, dW) * s_out   (and the bias likewise).
    Since dW is symmetric about 0 and independent of the signs, each example's marginal is
    exactly that of weight sampling, while different examples are decorrelated.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        prior_sigma: float = 0.1,
        init_rho: float = -5.0,
        flipout: bool = False,
    ) -> None:
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible by groups ({groups})"
            )
        kernel_size = _pair(kernel_size)
        super().__init__((out_channels, in_channels // groups, *kernel_size), bias, prior_sigma, init_rho)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = _pair(stride)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        self.dilation = _pair(dilation)
        self.groups = groups
        self.flipout = flipout

    @classmethod
    def from_deterministic(
        cls,
        layer: nn.Conv2d,
        prior_sigma: float = 0.1,
        init_rho: float = -5.0,
        flipout: bool = False,
    ) -> BayesConv2d:
        """The Bayesian twin of ``layer``: same hyper-parameters, mu = its weight and bias."""
        if layer.padding_mode != "zeros":
            raise ValueError(f"only zero padding is supported, got padding_mode={layer.padding_mode!r}")
        twin = cls(
            layer.in_channels,
            layer.out_channels,
            layer.kernel_size,
            layer.stride,
            layer.padding,
            layer.dilation,
            layer.groups,
            layer.bias is not None,
            prior_sigma,
            init_rho,
            flipout,
        )
        twin._copy_means_from(layer)
        for key in ("stacked_edges", "form", "form_convolve"):  # a fused cell's stacked convolution keeps its form
            if hasattr(layer, key):
                setattr(twin, key, getattr(layer, key))
        return twin

    def _conv(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if getattr(self, "form", "conv") != "conv":  # `dbsn.nets.conv_forms`: the same sums in another form
            return self.form_convolve(self, x, weight, bias)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def forward(self, x: Tensor) -> Tensor:
        if not (self.sample and self.flipout):
            return self._conv(x, *self.sample_weights())
        delta_w = self.weight_sigma * torch.randn_like(self.weight_mu)
        delta_b = None if self.bias_mu is None else self.bias_sigma * torch.randn_like(self.bias_mu)
        batch = x.shape[:-3]  # () for an unbatched (C, H, W) input
        sign_in = _random_signs((*batch, self.in_channels, 1, 1), x)
        sign_out = _random_signs((*batch, self.out_channels, 1, 1), x)
        return self._conv(x, self.weight_mu, self.bias_mu) + self._conv(x * sign_in, delta_w, delta_b) * sign_out

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
            f"groups={self.groups}, bias={self.bias_mu is not None}, flipout={self.flipout}, "
            f"{super().extra_repr()}"
        )


def _random_signs(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Independent +-1 entries with probability 1/2 each, in ``like``'s dtype and device."""
    return torch.randint(0, 2, shape, device=like.device).to(like.dtype).mul_(2).sub_(1)


def set_sampling(module: nn.Module, enabled: bool) -> nn.Module:
    """Switch weight sampling on or off in every Bayesian layer of ``module``; off means the
    posterior means are used (a deterministic prediction). Returns ``module``."""
    for m in module.modules():
        if isinstance(m, BayesLayer):
            m.sample = enabled
    return module


def kl_divergence(module: nn.Module) -> Tensor:
    """Sum of ``kl()`` over the Bayesian layers of ``module`` (each shared layer counted once);
    a 0-dim zero on the module's device if it has none. In float32 under mixed precision."""
    with float32():
        kls = [m.kl() for m in module.modules() if isinstance(m, BayesLayer)]
    if kls:
        return torch.stack(kls).sum()
    param = next(module.parameters(), None)
    if param is None:
        return torch.zeros(())
    return torch.zeros((), device=param.device, dtype=param.dtype if param.is_floating_point() else None)


def bayesianize(
    module: nn.Module,
    prior_sigma: float = 0.1,
    init_rho: float = -5.0,
    flipout: bool = False,
    local_reparameterization: bool = True,
) -> nn.Module:
    """Replace, in place and recursively, every ``nn.Conv2d`` and ``nn.Linear`` of ``module``
    by its Bayesian twin (``from_deterministic``: mu = the current weights). Other modules,
    BatchNorm included, stay as they are. A layer shared by several parents gets one twin, so
    tied weights stay tied. Returns ``module``, or the twin if ``module`` itself is a layer.
    """
    twins: dict[int, BayesLayer] = {}

    def twin_of(layer: nn.Module) -> BayesLayer:
        if id(layer) not in twins:
            if isinstance(layer, nn.Conv2d):
                twins[id(layer)] = BayesConv2d.from_deterministic(layer, prior_sigma, init_rho, flipout)
            else:
                twins[id(layer)] = BayesLinear.from_deterministic(
                    layer, prior_sigma, init_rho, local_reparameterization
                )
        return twins[id(layer)]

    def convert(parent: nn.Module) -> None:
        # Not named_children(): it skips a repeated child, which would leave a tied copy.
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if isinstance(child, (nn.Conv2d, nn.Linear)):
                setattr(parent, name, twin_of(child))
            else:
                convert(child)

    if isinstance(module, (nn.Conv2d, nn.Linear)):
        return twin_of(module)
    convert(module)
    return module
