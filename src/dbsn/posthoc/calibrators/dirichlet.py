"""Dirichlet calibration (Kull et al., NeurIPS 2019, "Beyond temperature scaling"), `posthoc=dirichlet`.

q = softmax(W log p + b), fitted from the identity on the mean NLL plus the paper's ODIR regulariser
λ / (C(C−1)) Σ_{i≠j} W_ij² + μ / C Σ_j b_j², by L-BFGS with the exact gradient (scipy's L-BFGS-B,
line searches of up to 128 steps as the authors' `fmin_l_bfgs_b`; `max_iter` iterations at most:
log p as an input is badly conditioned, and near λ = 0 the last 10⁻⁴ nats take hundreds of
iterations). Maps: `full`, `diagonal` (vector scaling on log p) and `fixed_diagonal` (W = wI,
b = 0, w = exp(s) > 0: never moves the argmax). The normalisation is the authors' `reg_norm=True`,
on W itself as their Keras `Dirichlet_NN` (not dirichlet_python's `ref_row` reparametrisation,
which penalises the identity's last column); p is clipped at the float64 machine epsilon before
the log (their `_logFunc`), so log p ≥ −36.04.

λ and μ: given, or (λ = None, full) chosen with μ = λ by `folds`-fold cross-validation on the
validation split over 10^-5 … 10^6 by the held-out NLL, then refitted on the whole split (12 ×
`folds` fits: for many classes, give λ and μ). The package's own default regularises nothing,
which for C = 100 leaves 10,100 free parameters on a few thousand validation images. Sources:
docs/evaluation.md ("Calibrators").
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dbsn.posthoc.calibrators.base import Calibrator

__all__ = ["DIRICHLET_MAPS", "LOG_EPS", "ODIR_GRID", "DirichletCalibration", "dirichlet_objective", "dirichlet_weights"]

#: log of the float64 machine epsilon: log p is clipped here (see the module docstring).
LOG_EPS = math.log(torch.finfo(torch.float64).eps)
DIRICHLET_MAPS = ("full", "diagonal", "fixed_diagonal")
#: The ODIR grid of the cross-validation (λ = μ), the authors' decades.
ODIR_GRID = tuple(10.0**k for k in range(-5, 7))


class DirichletCalibration(Calibrator):
    """q = softmax(W log p + b), `map` full | diagonal | fixed_diagonal, with the ODIR
    regulariser; see the module docstring.

    Args:
        map: "full", "diagonal" or "fixed_diagonal".
        reg_lambda: ODIR's off-diagonal λ (full only); None: chosen by cross-validation.
        reg_mu: ODIR's intercept μ (full, diagonal); None: λ for full, 0 for diagonal.
        folds: folds of the cross-validation that chooses λ = μ.
        max_iter: most L-BFGS iterations of one fit.
        seed: of the cross-validation's folds.
    """

    name = "dirichlet"

    def __init__(
        self,
        map: str = "full",
        reg_lambda: float | None = None,
        reg_mu: float | None = None,
        folds: int = 5,
        max_iter: int = 1000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if map not in DIRICHLET_MAPS:
            raise ValueError(f"map must be one of {DIRICHLET_MAPS}, got {map!r}")
        for key, value in (("reg_lambda", reg_lambda), ("reg_mu", reg_mu)):
            if value is not None and not float(value) >= 0:
                raise ValueError(f"{key} must be >= 0 (or null), got {value}")
        if folds < 2:
            raise ValueError(f"folds must be >= 2, got {folds}")
        self.map, self.folds, self.max_iter, self.seed = map, int(folds), int(max_iter), int(seed)
        self.reg_lambda = None if reg_lambda is None else float(reg_lambda)
        self.reg_mu = None if reg_mu is None else float(reg_mu)
        self.register_buffer("weight", torch.empty(0, 0, dtype=torch.float64))  # (C, C) once fitted
        self.register_buffer("bias", torch.empty(0, dtype=torch.float64))  # (C,)
        self.chosen: tuple[float, float] = (0.0, 0.0)  # the (λ, μ) of the last fit

    @property
    def preserves_argmax(self) -> bool:
        return self.map == "fixed_diagonal"

    def transform(self, log_probs: Tensor) -> Tensor:
        z = log_probs.clamp_min(LOG_EPS)
        if self.map == "full":
            return F.log_softmax(z @ self.weight.T + self.bias, dim=-1)
        return F.log_softmax(z * self.weight.diagonal() + self.bias, dim=-1)

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        if self.map == "fixed_diagonal":
            lam, mu = 0.0, 0.0
        elif self.map == "diagonal":
            lam, mu = 0.0, self.reg_mu or 0.0
        elif self.reg_lambda is None:
            lam, mu = self.cross_validate(log_probs, targets)
        else:
            lam, mu = self.reg_lambda, self.reg_lambda if self.reg_mu is None else self.reg_mu
        self.weight, self.bias = self.solve(log_probs, targets, lam, mu)
        self.chosen = (lam, mu)

    def cross_validate(self, log_probs: Tensor, targets: Tensor) -> tuple[float, float]:
        """The (λ, μ) of `ODIR_GRID` (λ = μ, or μ as given) with the smallest mean held-out NLL over
        `folds` seeded folds of the data (the first on ties)."""
        order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(self.seed))
        parts = order.tensor_split(self.folds)
        best, best_nll = ODIR_GRID[0], math.inf
        for lam in ODIR_GRID:
            mu = self.reg_mu if self.reg_mu is not None else lam
            total = 0.0
            for k, held_out in enumerate(parts):
                fit = torch.cat([p for j, p in enumerate(parts) if j != k])
                weight, bias = self.solve(log_probs[fit], targets[fit], lam, mu)
                z = log_probs[held_out].clamp_min(LOG_EPS)
                total += F.cross_entropy(z @ weight.T + bias, targets[held_out], reduction="sum").item()
            if total < best_nll:
                best, best_nll = lam, total
        return best, (self.reg_mu if self.reg_mu is not None else best)

    def solve(self, log_probs: Tensor, targets: Tensor, lam: float, mu: float) -> tuple[Tensor, Tensor]:
        """(W, b) minimising `dirichlet_objective` over the map's family by L-BFGS (scipy's
        L-BFGS-B without bounds, as the authors' code for many classes) from W = I, b = 0, in
        float64 with the exact gradient."""
        from scipy.optimize import minimize

        c = self.num_classes
        z = log_probs.clamp_min(LOG_EPS).numpy()
        onehot = np.eye(c)[targets.numpy()]
        start = {
            "full": np.concatenate([np.eye(c).ravel(), np.zeros(c)]),
            "diagonal": np.concatenate([np.ones(c), np.zeros(c)]),
            "fixed_diagonal": np.zeros(1),
        }[self.map]
        result = minimize(
            dirichlet_objective,
            start,
            args=(z, onehot, self.map, lam, mu),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": self.max_iter, "maxls": 128},
        )
        if not np.isfinite(result.x).all():
            raise RuntimeError(f"the Dirichlet calibration fit ({self.map}, λ = {lam}, μ = {mu}) diverged")
        weight, bias = dirichlet_weights(result.x, c, self.map)
        return torch.from_numpy(weight.copy()), torch.from_numpy(bias.copy())

    def label(self) -> str:
        if self.map == "fixed_diagonal":
            return f"Dirichlet calibration (fixed_diagonal: T = {1 / self.weight[0, 0].item():.4f})"
        lam, mu = self.chosen
        how = f", by {self.folds}-fold cross-validation" if self.map == "full" and self.reg_lambda is None else ""
        return f"Dirichlet calibration ({self.map}, ODIR λ = {lam:g}, μ = {mu:g}{how})"

    def settings(self) -> dict:
        facts = {"dirichlet_map": self.map}
        if self.map != "fixed_diagonal":
            facts.update(
                odir_lambda=self.chosen[0],
                odir_mu=self.chosen[1],
                odir_chosen_by=f"{self.folds}-fold cross-validation"
                if self.reg_lambda is None and self.map == "full"
                else "given",
            )
        else:
            facts["dirichlet_temperature"] = 1 / self.weight[0, 0].item()
        return facts


def dirichlet_weights(params: np.ndarray, c: int, map: str) -> tuple[np.ndarray, np.ndarray]:
    """(W (C, C), b (C,)) of a Dirichlet map's free parameters: full: W then b; diagonal: W's
    diagonal then b; fixed_diagonal: s, with W = exp(s) I and b = 0."""
    if map == "full":
        return params[: c * c].reshape(c, c), params[c * c :]
    if map == "diagonal":
        return np.diag(params[:c]), params[c:]
    return np.exp(params[0]) * np.eye(c), np.zeros(c)


def dirichlet_objective(
    params: np.ndarray, z: np.ndarray, onehot: np.ndarray, map: str, lam: float, mu: float
) -> tuple[float, np.ndarray]:
    """Kull et al.'s ODIR objective and its gradient in `params` (`dirichlet_weights`):
    mean NLL of softmax(W z + b) + λ/(C(C−1)) Σ_{i≠j} W_ij² + μ/C Σ_j b_j², with z the clipped
    log-probabilities (N, C) and the labels one-hot (N, C)."""
    n, c = z.shape
    weight, bias = dirichlet_weights(params, c, map)
    logits = z @ weight.T + bias
    logits -= logits.max(axis=1, keepdims=True)
    log_q = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    off = weight - np.diag(np.diag(weight))
    loss = -(onehot * log_q).sum() / n + lam / (c * (c - 1)) * (off**2).sum() + mu / c * (bias**2).sum()
    residual = (np.exp(log_q) - onehot) / n  # d mean NLL / d logits
    grad_weight, grad_bias = residual.T @ z, residual.sum(axis=0) + 2 * mu / c * bias
    if map == "full":
        return loss, np.concatenate([(grad_weight + 2 * lam / (c * (c - 1)) * off).ravel(), grad_bias])
    if map == "diagonal":
        return loss, np.concatenate([np.diag(grad_weight), grad_bias])
    return loss, np.array([np.exp(params[0]) * np.trace(grad_weight)])
