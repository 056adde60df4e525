"""Calibration maps beyond temperature scaling, as post-hoc posteriors: histogram binning
(`posthoc=histogram_binning`), isotonic regression (`posthoc=isotonic`) and Dirichlet calibration
(`posthoc=dirichlet`), fitted on the validation split of a finished run.

What a map is. An nn.Module from a classifier's predictive log-probabilities log p (..., C) to
calibrated log-probabilities log q, set as the method's `calibrator`: `Method.calibrate` applies it
(after the temperature, when the run has one) to the predictive and to each member, for the
uncertainty decomposition and the sample ablation, as it does the temperature. It applies to every
classifier: ensembles, DBSN, the Bayesian methods, a deep ensemble of runs (`ckpt_path=[a,b,c]`:
one map on the ensemble's predictive, log of averaged probabilities), and on top of another post-hoc
posterior (`base`, below). Its state is buffers, so it moves with the method to the device; it is
fitted in float64 on the CPU from the validation split's predictive log-probabilities and labels
(`validation_predictive`; never the test split) and applied in float64 on the device.

- Histogram binning (Zadrozny & Elkan, ICML 2001; multi-class as in Guo et al., ICML 2017, §4.1):
  one-vs-rest for every class c, p_c falls in one of M equal-width bins [m/M, (m+1)/M) (p_c = 1 in
  the last), and q_c is the fraction of the validation examples in that bin whose label is c. A bin
  no validation example fell in keeps its centre (m + ½)/M: with no evidence the map stays near the
  identity there (Guo et al.'s code, `HistogramBinning` in dirichletcal/experiments_dnn
  scripts/calibration/cal_methods.py, gives such a bin 0, which a test example landing there would
  pay for with the floor below). Then the q_c are renormalised to sum to one.
- Isotonic regression (Zadrozny & Elkan, KDD 2002; Guo et al. 2017): for every class c,
  scikit-learn's `IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1)` fitted to
  (p_c, 1[y = c]), i.e. the non-decreasing map of p_c closest to the labels in squared error;
  renormalised. Its thresholds are kept as buffers and applied by the linear interpolation
  scikit-learn's `predict` does (scipy's `interp1d`, inputs clipped to the fitted range).
- Dirichlet calibration (Kull et al., NeurIPS 2019, "Beyond temperature scaling"):
  q = softmax(W log p + b), fitted from the identity (W = I, b = 0) on the mean NLL plus the paper's
  ODIR (off-diagonal and intercept) regulariser λ / (C(C−1)) Σ_{i≠j} W_ij² + μ / C Σ_j b_j², by
  L-BFGS with the exact gradient (scipy's L-BFGS-B without bounds, line searches of up to 128
  steps, as the authors' `fmin_l_bfgs_b` call for more than 36 classes; `max_iter` iterations at
  most: log p as an input is badly conditioned, and near λ = 0 the last 10⁻⁴ nats take hundreds of
  iterations). The maps: `full` (W, b free), `diagonal` (W diagonal: Guo et al.'s vector scaling
  applied to log p) and `fixed_diagonal` (W = wI, b = 0: a temperature 1/w on log p, fitted as
  w = exp(s) > 0 so that it never moves the argmax). The regulariser's normalisation is the authors' `reg_norm=True` (λ / (k(k−1)),
  μ / k) in dirichletcal/dirichlet_python dirichletcal/calib/multinomial.py, `_objective`, on the
  matrix itself as in their Keras implementation for the neural-network experiments (`Dirichlet_NN`
  with `L2_offdiag` in dirichletcal/experiments_dnn scripts/calibration/cal_methods.py), not on
  dirichlet_python's reference-row reparametrisation (`ref_row`, which penalises the identity's
  last column). p is clipped at the float64 machine epsilon before the log (that Keras code's
  `_logFunc`), so log p ≥ −36.04 and a vanishing probability cannot dominate W log p. λ and μ:
  given, or (λ = None, full) chosen by `folds`-fold cross-validation on the validation split over
  the decade grid 10^-5 … 10^6 with μ = λ (the authors tuned both by 5-fold cross-validation over
  decade grids, tune_cal_odir.py and tune_dirichlet_nn_slim.py in experiments_dnn; `Dirichlet_NN`
  sets μ = λ when μ is not given), selected by the mean held-out NLL, then refitted on the whole
  split (12 × `folds` fits: for many classes, give λ and μ). The package's own defaults (`FullDirichletCalibrator`: reg_lambda = 0, no μ) regularise
  nothing, which for C = 100 classes leaves C(C+1) = 10,100 free parameters on a validation split of
  a few thousand images.

Zero probabilities. Histogram binning and isotonic regression give q_c = 0 to a class whose bin or
range held no positive example, and one such test example would make the NLL infinite: every q_c is
floored at `floor` (default 1e-6, so one such example costs at most −log 1e-6 ≈ 13.8 nats) before
the renormalisation. The Dirichlet map's softmax is positive everywhere.

The argmax. Temperature scaling and `fixed_diagonal` never change the predicted class
(`preserves_argmax`); histogram binning and isotonic regression (per-class maps, renormalised) and
the `diagonal` and `full` Dirichlet maps (class-specific scales and biases) may. When fitted, a map
prints one line with the validation NLL before and after and, for a map that may move the argmax,
the share of validation examples whose predicted class it changed; they are recorded as run facts
(`calibrator_nll_before`, `calibrator_nll_after`, `calibrator_argmax_changed`), which
metrics.json holds beside the test metrics (`Method.run_facts`).

With a temperature. A run trained with `temperature_scaling=true` predicts with its temperature; the
map is fitted on that predictive, the one the run makes, and applied after it. Stacking is not wrong:
each map is fitted on the validation predictions of what comes before it, and the temperature only
reshapes the input (for `fixed_diagonal` the two temperatures multiply into one). It is therefore
allowed, not refused as `posthoc=temperature` refuses a second temperature.

On top of another post-hoc posterior. `base` (a `PosthocPosterior`, e.g. `posthoc=isotonic
+posthoc@posthoc.base=laplace`) is fitted first and the map calibrates its predictive; the
posterior's name is then `<base>+<map>` (method `map_fixed+laplace+isotonic` in reports).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import Tensor, nn

from dbsn.methods.base import Method
from dbsn.methods.temperature import NoValidationSplitError, require_validation
from dbsn.posthoc.base import PosthocError, PosthocPosterior, use_samples

__all__ = [
    "CalibrationMap",
    "DirichletCalibration",
    "DirichletMap",
    "HistogramBinning",
    "HistogramBinningMap",
    "IsotonicCalibration",
    "IsotonicMap",
    "OneVsRestMap",
    "PosthocCalibration",
    "validation_predictive",
]

#: What a zero probability of histogram binning or isotonic regression is raised to before renormalising.
FLOOR = 1e-6
#: log of the float64 machine epsilon: the Dirichlet map's log p is clipped here (see the module docstring).
LOG_EPS = math.log(torch.finfo(torch.float64).eps)
DIRICHLET_MAPS = ("full", "diagonal", "fixed_diagonal")
#: The ODIR grid of the cross-validation (λ = μ), the authors' decades.
ODIR_GRID = tuple(10.0 ** k for k in range(-5, 7))


def floored_log(q: Tensor, floor: float) -> Tensor:
    """log of the per-class values q (..., C), each raised to at least `floor`, renormalised."""
    q = q.clamp_min(floor)
    return q.log() - q.sum(-1, keepdim=True).log()


class CalibrationMap(nn.Module):
    """A map from log-probabilities (..., C) to calibrated log-probabilities (see the module
    docstring); `fit` on validation predictions first.

    Attributes:
        preserves_argmax: whether the map can never change the predicted class.
        facts: how the last `fit` went (the run facts): the validation NLL before and after and,
            for a map that may move the argmax, the share of predicted classes it changed.
    """

    name: str = ""
    preserves_argmax: bool = False

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"a calibration map needs at least 2 classes, got {num_classes}")
        self.num_classes = int(num_classes)
        self.facts: dict = {}

    def forward(self, log_probs: Tensor) -> Tensor:
        """Calibrated log-probabilities, computed in float64, returned in `log_probs`'s dtype."""
        return self.transform(log_probs.to(torch.float64)).to(log_probs.dtype)

    def transform(self, log_probs: Tensor) -> Tensor:
        raise NotImplementedError

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        """Set the buffers from float64 CPU log-probabilities (N, C) and labels (N,)."""
        raise NotImplementedError

    def settings(self) -> dict:
        """The map's settings, recorded with the facts."""
        return {}

    def label(self) -> str:
        """What the one line of `summary` calls the fitted map."""
        return self.name

    def fit(self, log_probs: Tensor, targets: Tensor) -> CalibrationMap:
        """Fit on validation log-probabilities (N, C) and labels (N,), in float64 on the CPU
        (detached: nothing reaches the model); record `facts`. Returns the map."""
        z, y = self._check_inputs(log_probs, targets)
        self.to("cpu")
        self.fit_map(z, y)
        with torch.no_grad():
            after = self.transform(z)
        self.facts = {"calibrator": self.name, **self.settings(), "calibrator_examples": int(len(y)),
                      "calibrator_nll_before": F.nll_loss(z, y).item(),
                      "calibrator_nll_after": F.nll_loss(after, y).item()}
        if not self.preserves_argmax:
            self.facts["calibrator_argmax_changed"] = (after.argmax(-1) != z.argmax(-1)).double().mean().item()
        return self

    def summary(self) -> str:
        """One line on the last fit."""
        facts = self.facts
        line = (f"{self.label()} fitted on {facts['calibrator_examples']} validation examples: NLL "
                f"{facts['calibrator_nll_before']:.4f} -> {facts['calibrator_nll_after']:.4f}")
        if "calibrator_argmax_changed" in facts:
            line += f"; predicted class changed for {100 * facts['calibrator_argmax_changed']:.2f} % of them"
        return line

    def _check_inputs(self, log_probs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if log_probs.ndim != 2 or log_probs.shape[0] == 0 or log_probs.shape[1] != self.num_classes:
            raise ValueError(f"log_probs must be (N, {self.num_classes}) with N > 0, got {tuple(log_probs.shape)}")
        if targets.shape != log_probs.shape[:1] or targets.dtype.is_floating_point:
            raise ValueError(f"targets must be ({log_probs.shape[0]},) integer labels, got {tuple(targets.shape)} "
                             f"{targets.dtype}")
        z = log_probs.detach().to("cpu", torch.float64)
        y = targets.detach().to("cpu", torch.long)
        if torch.isnan(z).any() or (z == math.inf).any():
            raise ValueError("log_probs hold NaN or +inf: a calibration map needs log-probabilities")
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"targets must lie in 0..{self.num_classes - 1}, got {y.min()}..{y.max()}")
        return z, y


class OneVsRestMap(CalibrationMap):
    """A map of each class's probability on its own, q_c = g_c(p_c), floored at `floor` and
    renormalised (histogram binning, isotonic regression)."""

    def __init__(self, num_classes: int, floor: float = FLOOR) -> None:
        super().__init__(num_classes)
        if not 0 < floor < 1 / num_classes:
            raise ValueError(f"floor must lie in (0, 1/C), got {floor}")
        self.floor = float(floor)

    def class_probabilities(self, log_probs: Tensor) -> Tensor:
        """g_c(p_c) for every class, (..., C), before the floor and the renormalisation."""
        raise NotImplementedError

    def transform(self, log_probs: Tensor) -> Tensor:
        return floored_log(self.class_probabilities(log_probs), self.floor)

    def settings(self) -> dict:
        return {"calibrator_floor": self.floor}


class HistogramBinningMap(OneVsRestMap):
    """One-vs-rest histogram binning with `bins` equal-width bins per class, renormalised (see
    the module docstring). Until fitted every bin holds its centre."""

    name = "histogram_binning"

    def __init__(self, num_classes: int, bins: int = 15, floor: float = FLOOR) -> None:
        super().__init__(num_classes, floor)
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        self.bins = int(bins)
        edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
        self.register_buffer("inner_edges", edges[1:-1].clone())  # bin m: [m/M, (m+1)/M), p = 1 in the last
        self.register_buffer("centres", (edges[:-1] + edges[1:]) / 2)
        self.register_buffer("values", self.centres.expand(num_classes, bins).clone())  # (C, M)

    def label(self) -> str:
        return f"Histogram binning ({self.bins} bins)"

    def bin_index(self, probs: Tensor) -> Tensor:
        """Each probability's bin, 0 .. M − 1, in the shape of `probs`."""
        return torch.bucketize(probs, self.inner_edges.to(probs.dtype), right=True)

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        index = self.bin_index(log_probs.exp()).T  # (C, N)
        positive = F.one_hot(targets, self.num_classes).T.to(torch.float64)
        counts = torch.zeros_like(self.values).scatter_add_(1, index, torch.ones_like(positive))
        positives = torch.zeros_like(self.values).scatter_add_(1, index, positive)
        self.values = torch.where(counts > 0, positives / counts.clamp_min(1), self.centres.expand_as(counts))

    def class_probabilities(self, log_probs: Tensor) -> Tensor:
        flat = log_probs.reshape(-1, self.num_classes)
        return self.values.T.gather(0, self.bin_index(flat.exp())).view_as(log_probs)  # values[c, bin of p_c]

    def settings(self) -> dict:
        return {"calibrator_bins": self.bins, **super().settings()}


class IsotonicMap(OneVsRestMap):
    """One-vs-rest isotonic regression, renormalised (see the module docstring): scikit-learn's
    per-class thresholds, padded to one length by repeating each class's last one, as buffers
    (C, K). Until fitted every class maps [0, 1] onto itself."""

    name = "isotonic"

    def __init__(self, num_classes: int, floor: float = FLOOR) -> None:
        super().__init__(num_classes, floor)
        identity = torch.tensor([0.0, 1.0], dtype=torch.float64).expand(num_classes, 2).clone()
        self.register_buffer("x_thresholds", identity)
        self.register_buffer("y_thresholds", identity.clone())

    @staticmethod
    def regression(probs: np.ndarray, positive: np.ndarray):
        """scikit-learn's isotonic regression of one class's labels on its probabilities."""
        from sklearn.isotonic import IsotonicRegression

        return IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1).fit(probs, positive)

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        probs, labels = log_probs.exp().numpy(), targets.numpy()
        fits = [self.regression(probs[:, c], (labels == c).astype(np.float64)) for c in range(self.num_classes)]
        length = max(len(f.X_thresholds_) for f in fits)
        pad = lambda a: np.pad(np.asarray(a, dtype=np.float64), (0, length - len(a)), mode="edge")  # noqa: E731
        self.x_thresholds = torch.from_numpy(np.stack([pad(f.X_thresholds_) for f in fits]))
        self.y_thresholds = torch.from_numpy(np.stack([pad(f.y_thresholds_) for f in fits]))

    def class_probabilities(self, log_probs: Tensor) -> Tensor:
        """scipy's `interp1d(kind="linear")` on each class's thresholds, the input clipped to them
        first (`out_of_bounds="clip"`): searchsorted (left), index clipped to 1 .. K − 1, then
        slope · (x − x_lo) + y_lo, in that order of operations. A class with one threshold (all its
        validation probabilities equal) maps everything to its one value, as scikit-learn does."""
        xs, ys = self.x_thresholds, self.y_thresholds
        x = log_probs.reshape(-1, self.num_classes).exp().T.contiguous()  # (C, n)
        x = torch.minimum(torch.maximum(x, xs[:, :1]), xs[:, -1:])
        hi = torch.searchsorted(xs, x).clamp(min(1, xs.shape[1] - 1), xs.shape[1] - 1)
        lo = (hi - 1).clamp_min(0)
        x_lo, x_hi, y_lo, y_hi = xs.gather(1, lo), xs.gather(1, hi), ys.gather(1, lo), ys.gather(1, hi)
        slope = (y_hi - y_lo) / (x_hi - x_lo)
        return torch.where(x_hi > x_lo, slope * (x - x_lo) + y_lo, y_lo).T.reshape(log_probs.shape)

    def label(self) -> str:
        return "Isotonic regression"


class DirichletMap(CalibrationMap):
    """q = softmax(W log p + b) (Kull et al. 2019), `map` full | diagonal | fixed_diagonal, with
    the ODIR regulariser; see the module docstring. W = I, b = 0 until fitted (the identity on
    log-probabilities above the clip).

    Args:
        num_classes: C.
        map: "full", "diagonal" or "fixed_diagonal".
        reg_lambda: ODIR's off-diagonal λ (full only); None: chosen by cross-validation.
        reg_mu: ODIR's intercept μ (full, diagonal); None: λ for full, 0 for diagonal.
        folds: folds of the cross-validation that chooses λ = μ.
        max_iter: most L-BFGS iterations of one fit.
        seed: of the cross-validation's folds.
    """

    name = "dirichlet"

    def __init__(self, num_classes: int, map: str = "full", reg_lambda: float | None = None,
                 reg_mu: float | None = None, folds: int = 5, max_iter: int = 1000, seed: int = 0) -> None:
        super().__init__(num_classes)
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
        self.register_buffer("weight", torch.eye(num_classes, dtype=torch.float64))
        self.register_buffer("bias", torch.zeros(num_classes, dtype=torch.float64))
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
        start = {"full": np.concatenate([np.eye(c).ravel(), np.zeros(c)]),
                 "diagonal": np.concatenate([np.ones(c), np.zeros(c)]), "fixed_diagonal": np.zeros(1)}[self.map]
        result = minimize(dirichlet_objective, start, args=(z, onehot, self.map, lam, mu), jac=True, method="L-BFGS-B",
                          options={"maxiter": self.max_iter, "maxls": 128})
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
            facts.update(odir_lambda=self.chosen[0], odir_mu=self.chosen[1],
                         odir_chosen_by=f"{self.folds}-fold cross-validation" if self.reg_lambda is None
                         and self.map == "full" else "given")
        else:
            facts["dirichlet_temperature"] = 1 / self.weight[0, 0].item()
        return facts


def dirichlet_weights(params: np.ndarray, c: int, map: str) -> tuple[np.ndarray, np.ndarray]:
    """(W (C, C), b (C,)) of a Dirichlet map's free parameters: full: W then b; diagonal: W's
    diagonal then b; fixed_diagonal: s, with W = exp(s) I and b = 0."""
    if map == "full":
        return params[:c * c].reshape(c, c), params[c * c:]
    if map == "diagonal":
        return np.diag(params[:c]), params[c:]
    return np.exp(params[0]) * np.eye(c), np.zeros(c)


def dirichlet_objective(params: np.ndarray, z: np.ndarray, onehot: np.ndarray, map: str, lam: float, mu: float
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
    loss = -(onehot * log_q).sum() / n + lam / (c * (c - 1)) * (off ** 2).sum() + mu / c * (bias ** 2).sum()
    residual = (np.exp(log_q) - onehot) / n  # d mean NLL / d logits
    grad_weight, grad_bias = residual.T @ z, residual.sum(axis=0) + 2 * mu / c * bias
    if map == "full":
        return loss, np.concatenate([(grad_weight + 2 * lam / (c * (c - 1)) * off).ravel(), grad_bias])
    if map == "diagonal":
        return loss, np.concatenate([np.diag(grad_weight), grad_bias])
    return loss, np.array([np.exp(params[0]) * np.trace(grad_weight)])


@torch.no_grad()
def validation_predictive(method: Method, datamodule) -> tuple[Tensor, Tensor]:
    """The method's predictive log-probabilities on the validation split, (N, C) on the CPU, and
    its labels (N,): what it predicts (with its temperature, when it has one), before any
    calibrator. Only the validation loader is read, never the test split."""
    require_validation(datamodule)
    method.eval()
    method.enable_test_noise()
    method.prepare_prediction(datamodule)  # the predictor the test pass uses
    device = next(itertools.chain(method.parameters(), method.buffers())).device
    calibrator, method.calibrator = method.calibrator, None
    try:
        batches = [(method.predict_log_probs(datamodule.preprocess(x.to(device))).cpu(), y.cpu())
                   for x, y in datamodule.val_dataloader()]
    finally:
        method.calibrator = calibrator
    if not batches:
        raise NoValidationSplitError(f"{type(datamodule).__name__}'s validation loader yielded no batches")
    return torch.cat([lp for lp, _ in batches]), torch.cat([y for _, y in batches])


class PosthocCalibration(PosthocPosterior):
    """A calibration map as a post-hoc posterior: the finished method (or `base` fitted on it)
    with the map `make_map` builds fitted on its validation predictive and set as its
    `calibrator`. Applies to every classifier (see the module docstring).

    Args:
        name: see `PosthocPosterior`; None: the class's name, after `base`'s (`laplace+isotonic`).
        n_samples: S, unless `evaluate.py n_samples=` says; None: the method's own (with a
            `base`: the base's own).
        base: a post-hoc posterior fitted first, whose predictive the map calibrates.
    """

    def __init__(self, name: str | None = None, n_samples: int | None = None,
                 base: PosthocPosterior | None = None) -> None:
        if base is not None and not isinstance(base, PosthocPosterior):
            raise PosthocError(f"posthoc.base must be a post-hoc posterior (e.g. +posthoc@posthoc.base=laplace), got "
                               f"{type(base).__name__}")
        super().__init__(name or (f"{base.name}+{type(self).name}" if base is not None else None), n_samples)
        self.base = base

    def make_map(self, num_classes: int) -> CalibrationMap:
        raise NotImplementedError

    def checked_settings(self) -> None:
        """Refuse a setting the map would refuse, naming its key, before any checkpoint is read."""
        try:
            self.make_map(2)
        except ValueError as err:
            raise PosthocError(f"posthoc.{err} (posthoc={self.name})") from None

    def why_not(self, method: Method, checkpoint: dict) -> str | None:
        if not method.task.keeps_test_outputs:
            return f"posthoc={self.name} is defined for classifiers; this is a segmentation model"
        return self.base.why_not(method, checkpoint) if self.base is not None else None

    def check(self, method: Method, datamodule, checkpoint: dict) -> None:
        if self.base is not None:
            self.base.check(method, datamodule, checkpoint)
        if not datamodule.has_val:
            raise PosthocError(f"posthoc={self.name} is fitted on the validation split, and this run has none "
                               "(data.val_size=0): train with a validation split (e.g. data.val_size=5000 or 0.1); it "
                               "is never fitted on the test set.")

    def fit(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> Method:
        if self.base is not None:
            method = self.base.fit(method, datamodule, checkpoint, n_samples)
        else:
            use_samples(method, n_samples)
        datamodule.setup("fit")
        log_probs, targets = validation_predictive(method, datamodule)
        calibrator = self.make_map(method.num_classes).fit(log_probs, targets)
        method.calibrator = calibrator.to(next(itertools.chain(method.parameters(), method.buffers())).device)
        Console().print(calibrator.summary(), soft_wrap=True)
        return method


class HistogramBinning(PosthocCalibration):
    """Histogram binning as a post-hoc posterior (`posthoc=histogram_binning`).

    Args:
        bins: M, equal-width bins per class (Guo et al. 2017: 15).
        floor: the least probability before renormalising.
        name, n_samples, base: see `PosthocCalibration`.
    """

    name = "histogram_binning"

    def __init__(self, bins: int = 15, floor: float = FLOOR, name: str | None = None, n_samples: int | None = None,
                 base: PosthocPosterior | None = None) -> None:
        super().__init__(name, n_samples, base)
        self.bins, self.floor = int(bins), float(floor)
        self.checked_settings()

    def make_map(self, num_classes: int) -> HistogramBinningMap:
        return HistogramBinningMap(num_classes, self.bins, self.floor)


class IsotonicCalibration(PosthocCalibration):
    """Isotonic regression as a post-hoc posterior (`posthoc=isotonic`).

    Args:
        floor: the least probability before renormalising.
        name, n_samples, base: see `PosthocCalibration`.
    """

    name = "isotonic"

    def __init__(self, floor: float = FLOOR, name: str | None = None, n_samples: int | None = None,
                 base: PosthocPosterior | None = None) -> None:
        super().__init__(name, n_samples, base)
        self.floor = float(floor)
        self.checked_settings()

    def make_map(self, num_classes: int) -> IsotonicMap:
        return IsotonicMap(num_classes, self.floor)


class DirichletCalibration(PosthocCalibration):
    """Dirichlet calibration as a post-hoc posterior (`posthoc=dirichlet`); the arguments are
    `DirichletMap`'s (and `PosthocCalibration`'s)."""

    name = "dirichlet"

    def __init__(self, map: str = "full", reg_lambda: float | None = None, reg_mu: float | None = None,
                 folds: int = 5, max_iter: int = 1000, seed: int = 0, name: str | None = None,
                 n_samples: int | None = None, base: PosthocPosterior | None = None) -> None:
        super().__init__(name, n_samples, base)
        self.settings = dict(map=map, reg_lambda=reg_lambda, reg_mu=reg_mu, folds=folds, max_iter=max_iter, seed=seed)
        self.checked_settings()

    def make_map(self, num_classes: int) -> DirichletMap:
        return DirichletMap(num_classes, **self.settings)
