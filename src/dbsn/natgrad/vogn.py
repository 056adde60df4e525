"""Variational Online Gauss-Newton (VOGN): a natural-gradient optimiser of a Gaussian posterior.

Khan et al. 2018, "Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam";
Osawa et al. 2019, "Practical Deep Learning with Bayesian Principles"; the paper's Table 5
baseline. The posterior is q(w) = N(μ, diag(σ²)): μ is the parameter tensor itself, the state
holds the scaled precision s and the momentum m. Each step draws K weight samples, takes ĥ from
the squared per-example gradients (a `LayerCapture`, at the observed targets as the papers do)
and updates m (no (1 − β1) factor, as the CIFAR recipes) and s (β2 weighs the NEW estimate). The
update rules, the KL warm-up and the fixed point that equals exact Bayesian linear regression:
docs/methods.md ("VOGN as implemented").

The closure computes the SUM over the minibatch of per-example losses (the mean with
``loss_reduction="mean"``), calls ``backward()`` and returns the loss; the optimiser sets the
parameters to w_k and zeroes ``.grad`` before each call. Each captured layer is applied once per
forward to the whole batch. ĥ uses the LAST backward pass's output gradients, so a second
``torch.autograd.grad`` pass can change the curvature estimate (e.g. to an MC Fisher).

BatchNorm affine parameters are supported at fixed batch statistics; the K forwards each update
the running statistics. A group with ``point_estimate=True`` gets no noise and no prior but is
still preconditioned by 1 / (s + γ). Parameters outside Linear, Conv2d and BatchNorm layers are
refused at construction. Sampling uses the global torch RNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from dbsn.natgrad.per_example import SUPPORTED_LAYERS, LayerCapture, sum_squared_grads

__all__ = ["VOGN"]

_GLOBAL_OPTIONS = (
    "dataset_size",
    "augmentation_factor",
    "tau",
    "draws_per_step",
    "kl_warmup_start",
    "kl_warmup_steps",
    "loss_reduction",
)


class VOGN(Optimizer):
    """VOGN (the exact update: docs/methods.md, "VOGN as implemented").

    ``VOGN(model, lr=..., dataset_size=N, ...)`` optimises ``params`` (default: every trainable
    parameter of ``model``; or parameters / param-group dicts, all of them weights or biases
    of ``model``'s Linear, Conv2d or BatchNorm layers). Per-group options: ``lr``,
    ``prior_variance`` (``math.inf``: no prior), ``damping`` γ, ``momentum`` β1, ``beta2``,
    ``init_precision`` s0 (initial s, so the initial σ = sqrt(τ / (N_eff (s0 + δ̃ + γ)))),
    ``point_estimate``. The others (``dataset_size`` N, ``augmentation_factor`` ρ, ``tau``,
    ``draws_per_step`` K, ``kl_warmup_start``, ``kl_warmup_steps``, ``loss_reduction``) are
    global. ``sample_noise = False`` makes steps deterministic at w = μ (for tests).
    ``add_param_group`` after construction is not supported (the capture is built once).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        dataset_size: int,
        *,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | None = None,
        prior_variance: float = 1.0,
        tau: float = 1.0,
        augmentation_factor: float = 1.0,
        damping: float = 1e-3,
        momentum: float = 0.9,
        beta2: float = 0.999,
        init_precision: float = 8e-3,
        draws_per_step: int = 1,
        kl_warmup_start: float = 1.0,
        kl_warmup_steps: int = 0,
        loss_reduction: str = "sum",
    ) -> None:
        checks = {
            "lr >= 0": lr >= 0,
            "dataset_size > 0": dataset_size > 0,
            "prior_variance > 0": prior_variance > 0,
            "tau > 0": tau > 0,
            "augmentation_factor > 0": augmentation_factor > 0,
            "damping >= 0": damping >= 0,
            "0 <= momentum < 1": 0 <= momentum < 1,
            "0 < beta2 <= 1": 0 < beta2 <= 1,
            "init_precision >= 0": init_precision >= 0,
            "draws_per_step >= 1": draws_per_step >= 1,
            "0 < kl_warmup_start <= 1": 0 < kl_warmup_start <= 1,
            "kl_warmup_steps >= 0": kl_warmup_steps >= 0,
            "loss_reduction in ('sum', 'mean')": loss_reduction in ("sum", "mean"),
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"VOGN: invalid hyperparameters, need {', '.join(failed)}")
        defaults = dict(
            lr=lr,
            prior_variance=prior_variance,
            damping=damping,
            momentum=momentum,
            beta2=beta2,
            init_precision=init_precision,
            point_estimate=False,
            dataset_size=dataset_size,
            augmentation_factor=augmentation_factor,
            tau=tau,
            draws_per_step=int(draws_per_step),
            kl_warmup_start=kl_warmup_start,
            kl_warmup_steps=int(kl_warmup_steps),
            loss_reduction=loss_reduction,
        )
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        for group in self.param_groups:
            overridden = [k for k in _GLOBAL_OPTIONS if group[k] != defaults[k]]
            if overridden:
                raise ValueError(f"VOGN: {overridden} are global options and cannot be set per param group")

        names = {p: name for name, p in model.named_parameters()}
        owners: dict[Tensor, list[nn.Module]] = {}
        for module in model.modules():
            if isinstance(module, SUPPORTED_LAYERS):
                for p in (getattr(module, "weight", None), getattr(module, "bias", None)):
                    if isinstance(p, nn.Parameter):
                        owners.setdefault(p, []).append(module)
        uncovered = [
            names.get(p, f"<parameter {tuple(p.shape)} not in the model>")
            for p in self._params()
            if len(owners.get(p, [])) != 1
        ]
        if uncovered:
            raise ValueError(
                "VOGN needs per-example squared gradients, which dbsn.natgrad computes only for the weight and "
                "bias of Linear, Conv2d and BatchNorm layers of the model passed in (each owned by one layer); "
                f"these parameters are not: {uncovered}. Optimise them with another optimiser and pass VOGN "
                "the covered ones with params=."
            )
        self._names = names
        self._index = {p: i for i, p in enumerate(self._params())}
        covered = {owners[p][0] for p in self._params()}
        layers = [m for m in model.modules() if m in covered]
        self._capture = LayerCapture(model, layers)
        self._capture.enabled = False
        self.sample_noise = True
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {
                    "step": 0,
                    "precision": torch.full_like(p, group["init_precision"], memory_format=torch.preserve_format),
                    "momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def steps_taken(self) -> int:
        """Optimiser steps taken so far (the warm-up clock)."""
        return self.state[self._params()[0]]["step"]

    @property
    def n_eff(self) -> float:
        """N_eff = ρ N."""
        return self.defaults["augmentation_factor"] * self.defaults["dataset_size"]

    def current_tau(self) -> float:
        """τ_t of the next step, after the KL warm-up."""
        d, t = self.defaults, self.steps_taken
        warm = 1.0
        if d["kl_warmup_steps"] > 0:
            warm = d["kl_warmup_start"] + (1.0 - d["kl_warmup_start"]) * min(1.0, t / d["kl_warmup_steps"])
        return d["tau"] * warm

    def _delta_tilde(self, group: dict[str, Any], tau: float) -> float:
        """δ̃ = τ δ / N_eff (0 for point estimates or an infinite prior variance)."""
        return 0.0 if group["point_estimate"] else tau / (group["prior_variance"] * self.n_eff)

    def _stds(self, tau: float) -> list[Tensor | None]:
        """σ = sqrt(τ / N_eff) / sqrt(s + δ̃ + γ) per parameter (None for point estimates)."""
        stds: list[Tensor | None] = []
        for group in self.param_groups:
            shift = self._delta_tilde(group, tau) + group["damping"]
            for p in group["params"]:
                precision = self.state[p]["precision"]
                stds.append(
                    None if group["point_estimate"] else math.sqrt(tau / self.n_eff) * torch.rsqrt(precision + shift)
                )
        return stds

    def posterior_std(self) -> dict[str, Tensor]:
        """σ = 1 / sqrt(N_eff (s + δ̃ + γ) / τ) by parameter name (zeros for point estimates)."""
        stds = self._stds(self.current_tau())
        return {self._names[p]: torch.zeros_like(p) if std is None else std for p, std in zip(self._params(), stds)}

    @contextmanager
    def _perturbed(self, stds: list[Tensor | None]) -> Iterator[Callable[[], None]]:
        """Yields a function that writes a fresh draw μ + σ ε into the parameters; restores μ on exit."""
        params = self._params()
        with torch.no_grad():
            mus = [p.detach().clone() for p in params]

        def draw() -> None:
            with torch.no_grad():
                for p, mu, std in zip(params, mus, stds):
                    if std is not None and self.sample_noise:
                        p.copy_(mu + std * torch.randn_like(mu))

        try:
            yield draw
        finally:
            with torch.no_grad():
                for p, mu in zip(params, mus):
                    p.copy_(mu)

    @contextmanager
    def sample_weights(self) -> Iterator[None]:
        """Set one posterior draw w ~ q into the model (for prediction); restore μ on exit."""
        with self._perturbed(self._stds(self.current_tau())) as draw:
            draw()
            yield

    def _accumulate(self, g_sum: list[Tensor], h_sum: list[Tensor]) -> None:
        """Add this sample's ĝ (from .grad) and ĥ (from the capture) to the running sums."""
        cap = self._capture
        for layer in cap.layers:
            slots = [(p, self._index.get(p)) for p in (layer.weight, layer.bias) if p is not None]
            if all(p.grad is None for p, i in slots if i is not None):
                continue  # the layer took no part in this forward/backward
            if not cap.has(layer) or cap.num_calls(layer) != 1:
                raise RuntimeError(
                    f"VOGN: layer {layer} has gradients but {cap.num_calls(layer)} captured forward calls and "
                    f"{'a' if cap.has(layer) else 'no'} captured output gradient; each layer must be applied once "
                    "per forward, with grad enabled, and reached by the backward pass"
                )
            inputs, output_grads = cap.input(layer), cap.output_grad(layer)
            batch = inputs.shape[0]
            g_scale, h_scale = (1.0 / batch, 1.0 / batch) if self.defaults["loss_reduction"] == "sum" else (1.0, batch)
            for (p, i), sq in zip(slots, sum_squared_grads(layer, inputs, output_grads)):
                if i is None:
                    continue
                if p.grad is not None:
                    g_sum[i].add_(p.grad, alpha=g_scale)
                h_sum[i].add_(sq, alpha=h_scale)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One VOGN step; ``closure`` (required) is called K times. Returns the mean of its losses.

        Afterwards ``.grad`` of every optimised parameter holds ĝ (mean over batch and samples).
        """
        if closure is None:
            raise RuntimeError("VOGN.step needs a closure that runs forward and backward and returns the loss")
        params, tau, draws_per_step = self._params(), self.current_tau(), self.defaults["draws_per_step"]
        g_sum = [torch.zeros_like(p) for p in params]
        h_sum = [torch.zeros_like(p) for p in params]
        losses = []
        with self._perturbed(self._stds(tau)) as draw:
            try:
                for _ in range(draws_per_step):
                    draw()
                    for p in params:
                        p.grad = None
                    self._capture.clear()
                    self._capture.enabled = True
                    with torch.enable_grad():
                        losses.append(closure())
                    self._capture.enabled = False
                    self._accumulate(g_sum, h_sum)
            finally:
                self._capture.enabled = False
                self._capture.clear()

        with torch.no_grad():
            for group in self.param_groups:
                shift = self._delta_tilde(group, tau)
                for p in group["params"]:
                    state, i = self.state[p], self._index[p]
                    g_hat, h_hat = g_sum[i].div_(draws_per_step), h_sum[i].div_(draws_per_step)
                    m = state["momentum_buffer"].mul_(group["momentum"]).add_(g_hat + shift * p)
                    s = state["precision"].mul_(1.0 - group["beta2"]).add_(h_hat, alpha=group["beta2"])
                    p.addcdiv_(m, s + shift + group["damping"], value=-group["lr"])
                    state["step"] += 1
                    p.grad = g_hat
        if any(loss is None for loss in losses):
            return None
        if all(isinstance(loss, Tensor) for loss in losses):
            return torch.stack([loss.detach() for loss in losses]).mean()
        return sum(float(loss) for loss in losses) / len(losses)
