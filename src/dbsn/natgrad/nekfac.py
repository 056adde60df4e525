"""Noisy eigenvalue-corrected K-FAC (NEK-FAC; Bae, Zhang & Grosse 2018, arXiv:1811.12565), the
paper's NEK-FAC baseline (Tables 1-2).

Noisy natural gradient (Zhang et al. 2018): each Linear/Conv2d layer has a Gaussian posterior over
W̄ = [W, b] with mean M (the layer's parameters) and a covariance diagonal in its Kronecker
eigenbasis: the eigenvalue-corrected s* (George et al. 2018) of the *true* Fisher (labels sampled
from the model, `sampled_fisher_loss`). The mean moves by the damped natural gradient with the
prior term and KL clipping; the damping γ enters the update, never the noise. Convolutions follow
KFC (Grosse & Martens 2016). Every other trainable parameter is a point estimate: SGD with the
prior as weight decay. The equations: docs/methods.md ("NEK-FAC as implemented").

Usage::

    opt = NEKFAC(model, dataset_size=N)
    def closure():
        logits = model(x)
        return F.cross_entropy(logits, y), sampled_fisher_loss(logits)
    opt.step(closure)                  # samples W̄ ~ q, runs the closure, restores M, updates
    with opt.sample_weights():         # one posterior draw for prediction
        probs = model(x_test).softmax(-1)

The closure only runs the forward and returns ``(loss, fisher_loss)``: the MEAN NLL at the
observed labels and the SUM of the NLL at sampled labels (so captured output gradients are
per-example); the optimiser runs the backward passes. Each layer is applied once per forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.natgrad.per_example import LayerCapture, kfac_factors, per_example_grads
from dbsn.precision import float32

__all__ = ["NEKFAC", "kfac_layers", "sampled_fisher_loss"]


def sampled_fisher_loss(logits: Tensor) -> Tensor:
    """Summed NLL at labels drawn from softmax(logits) (classes on dim 1; (B, C) or (B, C, ...)).

    Its gradient w.r.t. the logits of example i is softmax − onehot(ỹ_i), ỹ_i ~ p(y | x_i), whose
    outer product averages to the true Fisher of the categorical likelihood. Summed over the
    batch (and over pixels for dense outputs) so that each example's output gradient is the
    gradient of its own loss.
    """
    with torch.no_grad():
        probs = logits.detach().float().movedim(1, -1).softmax(-1)
        labels = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(probs.shape[:-1])
    return F.cross_entropy(logits, labels, reduction="sum")


def kfac_layers(model: nn.Module) -> list[nn.Module]:
    """The Linear and Conv2d layers of ``model`` whose weight is trained, in module order."""
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.requires_grad]


def _groups(layer: nn.Module) -> int:
    return layer.groups if isinstance(layer, nn.Conv2d) else 1


def _as_matrix(layer: nn.Module, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """W̄ = [W, b] of shape (..., G, out/G, d_in + 1) (no bias column without a bias; G the conv
    groups, d_in = in/G · kh · kw); ``weight`` may have leading batch dims (..., *weight.shape)."""
    g, out = _groups(layer), layer.weight.shape[0]
    lead = weight.shape[: weight.dim() - layer.weight.dim()]
    mat = weight.reshape(*lead, g, out // g, -1)
    if layer.bias is None:
        return mat
    if bias is None:
        bias = mat.new_zeros(*lead, out)
    return torch.cat([mat, bias.reshape(*lead, g, out // g, 1)], dim=-1)


def _split(layer: nn.Module, mat: Tensor) -> tuple[Tensor, Tensor | None]:
    """Inverse of ``_as_matrix`` for one (G, out/G, d_in + 1) matrix: (weight, bias or None)."""
    if layer.bias is None:
        return mat.reshape(layer.weight.shape), None
    return mat[..., :-1].reshape(layer.weight.shape), mat[..., -1].reshape(-1)


def _eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clipped at 0) and eigenvectors of a batch of symmetric PSD matrices, in float64."""
    m64 = m.double()
    lam, u = torch.linalg.eigh(0.5 * (m64 + m64.mT))
    return lam.clamp(min=0).to(m.dtype), u.to(m.dtype)


_CHUNK_ELEMENTS = 2**24
"""Per-example gradient elements formed at once for s* (memory budget)."""


class NEKFAC(torch.optim.Optimizer):
    """Noisy EK-FAC over every trainable Linear/Conv2d layer of ``model`` (see the module docstring).

    Args:
        model: the network; its Linear/Conv2d layers get Gaussian posteriors, all other trainable
            parameters SGD with momentum and weight decay λ/(N η).
        dataset_size: N, the number of training examples (times the augmentation factor if
            wanted), which scales the prior and the posterior.
        lr, kl_weight (λ), prior_var (η), damping (γ, extrinsic), kl_clip (κ; None/0 disables),
        momentum: defaults are the paper's CIFAR settings (1e-2, 0.1, 1.0, 1e-3, 1e-3, 0.9).
        cov_update_every: refresh A, S and s* every this many steps (10).
        eigen_update_every: eigendecompose A and S every this many steps (200).
        stat_decay: EMA decay of A, S and s* (0.99).

    ``step(closure)``: see the module docstring for the closure contract. Step 0 runs at the mean
    (no basis yet), collects statistics and eigendecomposes; every later step runs the closure
    at one posterior sample.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset_size: int,
        lr: float = 1e-2,
        kl_weight: float = 0.1,
        prior_var: float = 1.0,
        damping: float = 1e-3,
        kl_clip: float | None = 1e-3,
        momentum: float = 0.9,
        cov_update_every: int = 10,
        eigen_update_every: int = 200,
        stat_decay: float = 0.99,
    ) -> None:
        if dataset_size <= 0 or kl_weight <= 0 or prior_var <= 0:
            raise ValueError("dataset_size, kl_weight and prior_var must be > 0")
        if cov_update_every < 1 or eigen_update_every < 1:
            raise ValueError("cov_update_every and eigen_update_every must be >= 1")
        self.layers = kfac_layers(model)
        kfac_ids = {id(p) for m in self.layers for p in (m.weight, m.bias) if p is not None}
        kfac_params = [p for m in self.layers for p in (m.weight, m.bias) if p is not None]
        other = [p for p in model.parameters() if p.requires_grad and id(p) not in kfac_ids]
        defaults = dict(
            lr=lr,
            kl_weight=kl_weight,
            prior_var=prior_var,
            damping=damping,
            kl_clip=kl_clip,
            momentum=momentum,
            dataset_size=dataset_size,
            cov_update_every=cov_update_every,
            eigen_update_every=eigen_update_every,
            stat_decay=stat_decay,
        )
        super().__init__(kfac_params + other, defaults)
        self.other_params = other
        self.steps = 0
        self.capture = LayerCapture(model, self.layers)
        self.capture.enabled = False

    # ----------------------------------------------------------------- hyperparameters
    @property
    def _group(self) -> dict:
        return self.param_groups[0]

    @property
    def prior_precision(self) -> float:
        """λ/(N η): the prior term's coefficient (and the weight decay of the other parameters)."""
        g = self._group
        return g["kl_weight"] / (g["dataset_size"] * g["prior_var"])

    def layer_state(self, layer: nn.Module) -> dict:
        """The layer's A, S, U_A, U_S, lam_A, lam_S, s_star (whichever exist yet) and the weight's
        momentum buffer. Every factor has a leading group dim G (1 except for grouped convs):
        A, U_A (G, d_in+1, d_in+1), S, U_S (G, out/G, out/G), s_star (G, out/G, d_in+1)."""
        return self.state[layer.weight]

    def noise_std(self, layer: nn.Module) -> Tensor:
        """Σ = sqrt((λ/N) / (s* + λ/(N η))), shaped like s*: the posterior std in the eigenbasis."""
        g = self._group
        return (
            (g["kl_weight"] / g["dataset_size"]) / (self.layer_state(layer)["s_star"] + self.prior_precision)
        ).sqrt()

    # ----------------------------------------------------------------- weight noise
    def _has_basis(self, layer: nn.Module) -> bool:
        return "s_star" in self.layer_state(layer)

    @torch.no_grad()
    def _perturb(self) -> list[tuple[Tensor, Tensor]]:
        """Writes W̄ = M + U_S (ε ⊙ Σ) U_Aᵀ into every layer with a basis; returns (param, mean)."""
        saved = []
        for layer in self.layers:
            if not self._has_basis(layer):
                continue
            st = self.layer_state(layer)
            eps = torch.randn_like(st["s_star"])
            dw, db = _split(layer, st["U_S"] @ (eps * self.noise_std(layer)) @ st["U_A"].mT)
            for p, d in ((layer.weight, dw), (layer.bias, db)):
                if p is not None:
                    saved.append((p, p.detach().clone()))
                    p.add_(d)
        return saved

    @staticmethod
    @torch.no_grad()
    def _restore(saved: list[tuple[Tensor, Tensor]]) -> None:
        for p, mean in saved:
            p.copy_(mean)

    @contextmanager
    def sample_weights(self) -> Iterator[None]:
        """One posterior draw of every layer's weights for the duration of the block."""
        if self.steps == 0:
            raise RuntimeError("NEKFAC.sample_weights needs at least one step (no eigenbasis yet)")
        saved = self._perturb()
        try:
            yield
        finally:
            self._restore(saved)

    # ----------------------------------------------------------------- statistics
    def _projected_second_moment(self, layer: nn.Module, inputs: Tensor, grads: Tensor, st: dict) -> Tensor:
        """E_i[(U_Sᵀ ∇W̄_i U_A)²] over the batch, forming per-example gradients a chunk at a time."""
        u_s, u_a = st["U_S"], st["U_A"]
        chunk = max(1, _CHUNK_ELEMENTS // st["s_star"].numel())
        total = torch.zeros_like(st["s_star"])
        for i in range(0, inputs.shape[0], chunk):
            g = _as_matrix(layer, *per_example_grads(layer, inputs[i : i + chunk], grads[i : i + chunk]))
            total += (u_s.mT @ g @ u_a).square().sum(0)  # U_Sᵀ ∇W̄_i U_A, (b, G, out/G, d_in+1)
        return total / inputs.shape[0]

    @torch.no_grad()
    def _update_stats(self, reset: bool) -> None:
        """EMA of A and S from the capture, and of s* in the current basis unless the basis is
        about to be recomputed (``reset``; s* is then reset to λ_S ⊗ λ_A instead).

        ``kfac_factors`` returns plain means over the B·T (example, position) pairs; KFC
        (Grosse & Martens 2016) approximates E_i[vec ∇W̄_i vec ∇W̄_iᵀ] by T (A ⊗ S), so T (the
        positions per example: 1 for a Linear on (B, in), H'W' for a conv) is folded into S
        here, making λ_S ⊗ λ_A an estimate of the same quantity as s*."""
        decay = self._group["stat_decay"]
        for layer in self.layers:
            if not self.capture.has(layer):
                continue
            if self.capture.num_calls(layer) != 1:
                raise RuntimeError(
                    f"NEKFAC needs each layer applied once per forward; {layer} ran "
                    f"{self.capture.num_calls(layer)} times"
                )
            inputs, grads = self.capture.input(layer), self.capture.output_grad(layer)
            st = self.layer_state(layer)
            a, s = kfac_factors(layer, inputs, grads)
            if a.dim() == 2:
                a, s = a[None], s[None]
            s = s * (grads.numel() // (grads.shape[0] * layer.weight.shape[0]))
            for key, new in (("A", a), ("S", s)):
                if key in st:
                    st[key].mul_(decay).add_(new, alpha=1 - decay)
                else:
                    st[key] = new.clone()
            if not reset and self._has_basis(layer):
                new = self._projected_second_moment(layer, inputs, grads, st)
                st["s_star"].mul_(decay).add_(new, alpha=1 - decay)
        self.capture.clear()

    @torch.no_grad()
    def _update_eigenbasis(self, scheduled: bool) -> None:
        """A = U_A diag(λ_A) U_Aᵀ, S = U_S diag(λ_S) U_Sᵀ, and s* ← λ_S ⊗ λ_A: for every layer on
        a scheduled step, else only for layers with factors but no basis yet."""
        for layer in self.layers:
            st = self.layer_state(layer)
            if "A" not in st or not (scheduled or "s_star" not in st):
                continue
            st["lam_A"], st["U_A"] = _eigh(st["A"])
            st["lam_S"], st["U_S"] = _eigh(st["S"])
            st["s_star"] = st["lam_S"][..., :, None] * st["lam_A"][..., None, :]

    # ----------------------------------------------------------------- the step
    def step(self, closure: Callable[[], tuple[Tensor, Tensor]]) -> Tensor:  # type: ignore[override]
        """Sample W̄ ~ q, run ``closure() -> (mean NLL, summed sampled-label NLL)``, backpropagate,
        restore the means, update the statistics and take the natural-gradient step. Returns the
        (detached) loss."""
        if closure is None:
            raise ValueError("NEKFAC.step needs a closure returning (loss, fisher_loss)")
        g = self._group
        stats = self.steps % g["cov_update_every"] == 0
        eigen = self.steps % g["eigen_update_every"] == 0
        weights = [m.weight for m in self.layers]
        saved = self._perturb()
        try:
            self.capture.enabled = stats
            with torch.enable_grad():
                loss, fisher_loss = closure()
                if stats:
                    torch.autograd.grad(fisher_loss, weights, retain_graph=True, allow_unused=True)
                    self.capture.enabled = False
                    with float32():  # the statistics' matrix products, not in bfloat16 under autocast
                        self._update_stats(reset=eigen)
                self.zero_grad(set_to_none=True)
                loss.backward()
        finally:
            self.capture.enabled = False
            self.capture.clear()
            self._restore(saved)
        with float32():
            self._update_eigenbasis(scheduled=eigen)
            self._update_means()
        self.steps += 1
        return loss.detach()

    @torch.no_grad()
    def _update_means(self) -> None:
        g = self._group
        lr, prior = g["lr"], self.prior_precision
        directions: list[tuple[Tensor, Tensor]] = []
        vg: Tensor | float = 0.0
        for layer in self.layers:
            if layer.weight.grad is None:
                continue
            bias_grad = None if layer.bias is None else layer.bias.grad
            grad = _as_matrix(layer, layer.weight.grad, bias_grad) + prior * _as_matrix(layer, layer.weight, layer.bias)
            st = self.layer_state(layer)
            if self._has_basis(layer):
                u_s, u_a = st["U_S"], st["U_A"]
                v = u_s @ ((u_s.mT @ grad @ u_a) / (st["s_star"] + prior + g["damping"])) @ u_a.mT
            else:  # a layer the forward never reached: no statistics, plain SGD
                v = grad
            vg = vg + (v * grad).sum()
            dw, db = _split(layer, v)
            directions += [(layer.weight, dw)] + ([(layer.bias, db)] if layer.bias is not None else [])
        vg = float(vg)  # Σ V ⊙ G over all layers, one device sync
        if g["kl_clip"] and vg > 0:
            nu = min(1.0, math.sqrt(g["kl_clip"] / (lr**2 * vg)))
            directions = [(p, nu * d) for p, d in directions]
        directions += [(p, p.grad + prior * p) for p in self.other_params if p.grad is not None]
        for p, d in directions:
            st = self.state[p]
            if "momentum_buffer" in st:
                st["momentum_buffer"].mul_(g["momentum"]).add_(d)
            else:
                st["momentum_buffer"] = d.clone()
            p.add_(st["momentum_buffer"], alpha=-lr)

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["nekfac_steps"] = self.steps
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.steps = int(state_dict.pop("nekfac_steps", 0))
        super().load_state_dict(state_dict)

    def remove(self) -> None:
        """Remove the capture hooks from the model."""
        self.capture.remove()
