"""Post-hoc last-layer Laplace approximation of a finished point-estimate run (MacKay 1992;
Ritter et al. 2018; Kristiadi et al. 2020; Daxberger et al. 2021, "Laplace Redux", whose library
laplace-torch computes the curvature, the posterior samples and the evidence).

A MAP network f(x) = W φ(x) + b (map, map_fixed, or one deep-ensemble member, its structure α
held fixed by `FixedStructureNetwork`) gets a Gaussian on its last layer θ = (W, b) only:
q(θ) = N(θ*, P⁻¹), P = Σ_n J_nᵀ Λ_n J_n + λ I, the generalised Gauss-Newton summed over every
training image once (unaugmented, eval mode), kept `full`, `kron` or `diag`. φ stays at the MAP
and is computed once, so laplace-torch gets the head alone on the features
(`last_layer_laplace`; the same posterior, tested). The last layer enters f linearly, so S drawn
last layers (`sample_last_layers`, seeded, kept) sample the GLM predictive exactly, and
`LaplaceMethod` predicts with their softmax average, like every other Bayes ensemble here.
The probit approximation is not used: it sees only each logit's variance, including the shift
common to every class that the softmax ignores, so it can rank the prior precisions λ unlike
the predictor evaluated (docs/evaluation.md, "Post-hoc posteriors").

λ: `"gridsearch"` (default) takes the λ of 10^[-4, 4] (100 points; the first on ties, a failed
draw counts as infinitely bad) with the smallest validation NLL of exactly the S members the
method then keeps (common random numbers across λ); `"marglik"` maximises the Laplace evidence
on the training data (Adam on log λ); a number fixes λ. The test set is never touched.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from copy import deepcopy

import torch
from rich.console import Console
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dbsn.data.base import in_memory_loader
from dbsn.methods.base import Method
from dbsn.methods.temperature import NoValidationSplitError, require_validation
from dbsn.posthoc.base import PosthocError, PosthocPosterior, point_estimate_classifier
from dbsn.posthoc.fixed import FixedStructureNetwork, FixedStructurePosterior

__all__ = [
    "LaplaceMethod",
    "LastLayerLaplace",
    "fit_laplace",
    "fit_laplace_on",
    "last_layer_laplace",
    "member_logits",
    "sample_last_layers",
    "sampled_validation_nll",
    "tune_prior_precision",
]

HESSIAN_STRUCTURES = ("kron", "full", "diag")
PRIOR_FITS = ("gridsearch", "marglik")


class _Head(nn.Module):
    """The head alone, fed with features: laplace-torch's model for a cached-feature fit."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.classifier = head

    def forward(self, features: Tensor) -> Tensor:
        return self.classifier(features)


def last_layer_laplace(
    head: nn.Linear,
    features: Tensor,
    targets: Tensor,
    *,
    likelihood: str = "classification",
    hessian_structure: str = "kron",
    prior_precision: float = 1.0,
    sigma_noise: float = 1.0,
    batch_size: int = 512,
):
    """laplace-torch's last-layer Laplace of `head` (a copy; the network's is untouched) at its
    current weights, with the curvature summed over (features, targets).

    For a classification head, targets are class labels (N,); for regression
    (`likelihood="regression"`, Gaussian noise `sigma_noise`), real values (N, outputs).
    Returns the fitted `laplace.BaseLaplace` (prior precision `prior_precision` until
    `tune_prior_precision` changes it)."""
    from laplace import Laplace

    if hessian_structure not in HESSIAN_STRUCTURES:
        raise ValueError(f"hessian_structure must be one of {HESSIAN_STRUCTURES}, got {hessian_structure!r}")
    model = _Head(deepcopy(head)).to(features.device)
    la = Laplace(
        model,
        likelihood,
        subset_of_weights="last_layer",
        hessian_structure=hessian_structure,
        sigma_noise=sigma_noise,
        prior_precision=prior_precision,
        last_layer_name="classifier",
    )
    la.fit(DataLoader(TensorDataset(features, targets), batch_size=batch_size))
    return la


def sample_last_layers(la, n_samples: int, seed: int = 0) -> Tensor:
    """The `n_samples` last layers θ_s ~ N(θ*, P(λ)⁻¹) at `la`'s current prior precision, (S, P)
    in the head's parameter order (weight row-major, then bias): laplace-torch's `la.sample`
    with a generator seeded `seed`. The one draw both `LaplaceMethod.draw_members` and the
    prior's grid search use; with the same seed, the standard normals behind the draws are the
    same whatever λ is."""
    generator = torch.Generator(device=la._device).manual_seed(seed)
    return la.sample(n_samples, generator=generator).detach()


def member_logits(head: nn.Module, weights: Tensor, features: Tensor) -> Tensor:
    """The logits of `head` (an `nn.Linear`, or a module holding exactly its parameters) fed
    `features` (b, D) with each row of `weights` (S, P) as its parameters: (S, b, C)."""
    names = [name for name, _ in head.named_parameters()]
    shapes = [p.shape for _, p in head.named_parameters()]

    def member(row: Tensor) -> Tensor:
        parts = row.split([math.prod(s) for s in shapes])
        params = {name: part.view(shape) for name, part, shape in zip(names, parts, shapes)}
        return torch.func.functional_call(head, params, (features,))

    return torch.func.vmap(member)(weights.to(features.dtype))


@torch.no_grad()
def sampled_validation_nll(
    la, features: Tensor, targets: Tensor, n_samples: int, seed: int = 0, batch_size: int = 512
) -> float:
    """−mean log 1/S Σ_s softmax(W_s φ + b_s)[y] over (`features`, `targets`), the S members
    `sample_last_layers(la, S, seed)` at `la`'s current prior precision: the validation NLL of
    the `LaplaceMethod` that keeps those members (before any temperature)."""
    weights = sample_last_layers(la, n_samples, seed).to(features.device)
    head = la.model.last_layer
    total = 0.0
    for start in range(0, len(features), batch_size):
        log_probs = member_logits(head, weights, features[start : start + batch_size]).float().log_softmax(-1)
        mixture = torch.logsumexp(log_probs, dim=0) - math.log(n_samples)  # (b, C)
        total -= mixture.gather(1, targets[start : start + batch_size, None].long()).sum().item()
    return total / len(features)


def tune_prior_precision(
    la,
    val_features: Tensor | None = None,
    val_targets: Tensor | None = None,
    *,
    method: str = "gridsearch",
    log10_range: tuple[float, float] = (-4.0, 4.0),
    grid_size: int = 100,
    n_samples: int,
    seed: int = 0,
    batch_size: int = 512,
) -> float:
    """Set `la`'s scalar prior precision λ and return it.

    "gridsearch": the λ of the log-spaced grid 10^log10_range (`grid_size` points) with the
    smallest `sampled_validation_nll` on the validation features and labels, i.e. the validation
    NLL of the `LaplaceMethod(n_samples=n_samples, seed=seed)` built on it (pass the method's
    S and seed). The same seed at every grid point: common random numbers. A λ whose draw fails
    (a precision that is not positive definite) or whose NLL is not finite is never chosen.
    "marglik": the λ that maximises the Laplace evidence of the training data (no validation
    data; Adam on log λ)."""
    if method not in PRIOR_FITS:
        raise ValueError(f"prior precision fit must be one of {PRIOR_FITS} or a number, got {method!r}")
    if method == "marglik":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")  # no predictive used
            la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar")
        return float(torch.as_tensor(la.prior_precision).reshape(-1)[0])
    if val_features is None or len(val_features) == 0:
        raise NoValidationSplitError(
            "the prior precision's grid search needs validation data (it is never fitted on the test set)"
        )
    if la.likelihood != "classification":  # a str or laplace-torch's str enum
        raise ValueError(
            f"the prior precision's grid search scores a classifier's NLL; got likelihood {la.likelihood!r}"
        )
    grid = torch.logspace(log10_range[0], log10_range[1], grid_size)  # laplace-torch's own grid (float32)
    best, best_nll = None, math.inf
    for lam in grid:
        la.prior_precision = lam
        try:
            nll = sampled_validation_nll(la, val_features, val_targets, n_samples, seed, batch_size)
        except RuntimeError as err:  # as laplace-torch's own grid search: a failed factorisation rules λ out
            if isinstance(err, torch.linalg.LinAlgError) or "not positive definite" in str(err):
                continue
            raise
        if nll < best_nll:  # strict: the first λ on ties; NaN never wins
            best, best_nll = lam, nll
    if best is None:
        raise RuntimeError(f"no prior precision of 10^{list(log10_range)} gave a finite validation NLL")
    la.prior_precision = best
    return float(torch.as_tensor(la.prior_precision).reshape(-1)[0])


@torch.no_grad()
def head_features(
    network: FixedStructureNetwork, loader: Iterable, preprocess: Callable[[Tensor], Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """φ(x) of every example of `loader`, (N, D), and the labels (N,), on the network's device;
    each batch's x goes through `preprocess` first (the data modules' loaders yield uint8)."""
    device = network.alpha.device
    features, labels = [], []
    for x, y in loader:
        x = x.to(device)
        phi, _ = network.features(preprocess(x) if preprocess is not None else x)
        features.append(phi.float())
        labels.append(y.to(device))
    if not features:
        return torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
    return torch.cat(features), torch.cat(labels)


def fit_laplace(
    method: Method,
    train_loader: Iterable,
    val_loader: Iterable | None = None,
    *,
    preprocess: Callable[[Tensor], Tensor] | None = None,
    hessian_structure: str = "kron",
    prior_precision: str | float = "gridsearch",
    log10_range: tuple[float, float] = (-4.0, 4.0),
    grid_size: int = 100,
    n_samples: int,
    seed: int = 0,
    head: str = "classifier",
) -> LaplaceMethod:
    """A `LaplaceMethod` around the finished point-estimate `method` (see the module docstring).

    The curvature is summed over `train_loader` (every training example once, unaugmented);
    `prior_precision` is "gridsearch" (on `val_loader`), "marglik" (training data only) or a
    fixed λ. `preprocess` maps a loader's x to the network's input (`datamodule.preprocess`).
    `n_samples` last layers are drawn with `seed` and kept as the method's members; the grid
    search scores each λ with those same S and seed."""
    network = FixedStructureNetwork.of(method, head)
    method.eval()
    features, labels = head_features(network, train_loader, preprocess)
    if len(features) == 0:
        raise ValueError("the training loader yielded no batches")
    la = last_layer_laplace(
        network.head,
        features,
        labels,
        hessian_structure=hessian_structure,
        prior_precision=prior_precision if isinstance(prior_precision, (int, float)) else 1.0,
    )
    if not isinstance(prior_precision, (int, float)):
        val_features, val_labels = (None, None)
        if prior_precision == "gridsearch":
            if val_loader is None:
                raise NoValidationSplitError("prior_precision='gridsearch' needs a validation loader")
            val_features, val_labels = head_features(network, val_loader, preprocess)
        tune_prior_precision(
            la,
            val_features,
            val_labels,
            method=prior_precision,
            log10_range=log10_range,
            grid_size=grid_size,
            n_samples=n_samples,
            seed=seed,
        )
    return LaplaceMethod(method, la, n_samples=n_samples, seed=seed, head=head)


def fit_laplace_on(method: Method, datamodule, **kwargs) -> LaplaceMethod:
    """`fit_laplace` on a data module: the curvature over its whole training split (in order,
    unaugmented, the last short batch included), λ on its validation split (required for the
    grid search). Never reads the test split."""
    if getattr(datamodule, "train_set", None) is None:
        datamodule.setup("fit")
    if kwargs.get("prior_precision", "gridsearch") == "gridsearch":
        require_validation(datamodule)
    train_loader = in_memory_loader(datamodule, datamodule.train_set, train=False)
    return fit_laplace(method, train_loader, datamodule.val_dataloader(), preprocess=datamodule.preprocess, **kwargs)


class LaplaceMethod(FixedStructurePosterior):
    """A point-estimate method with a last-layer Laplace posterior: S fixed last layers
    θ_s ~ N(θ*, Σ) on the MAP features; prediction 1/S Σ_s softmax(W_s φ(x) + b_s).

    Built by `fit_laplace` / `fit_laplace_on`. The drawn members are a buffer
    (`member_weights`, (S, P), P = C·D + C in the head's parameter order), so a saved
    LaplaceMethod predicts again without laplace-torch: build it with `laplace=None` and the
    same `n_samples`, then load the state dict.

    Args:
        base: the finished point-estimate method (its network is shared, not copied).
        laplace: the fitted laplace-torch posterior of `base`'s head (or None, see above).
        n_samples: S, last layers drawn and kept.
        seed: seed of the draw.
        head: name of the network's last layer.
        temperature_scaling: a post-hoc temperature on top (fitted by `fit_temperature`).
    """

    def __init__(
        self,
        base: Method,
        laplace,
        n_samples: int,
        seed: int = 0,
        head: str = "classifier",
        temperature_scaling: bool = False,
    ) -> None:
        super().__init__(base, n_samples, head, temperature_scaling)
        self.laplace = laplace
        self.hessian_structure = None if laplace is None else str(getattr(type(laplace), "_key", (None, None))[1])
        self.prior_precision = (
            None if laplace is None else float(torch.as_tensor(laplace.prior_precision).reshape(-1)[0])
        )
        size = sum(p.numel() for p in self.network_fixed.head.parameters())
        self.register_buffer("member_weights", torch.zeros(n_samples, size))
        if laplace is not None:
            self.draw_members(n_samples, seed)

    def draw_members(self, n_samples: int, seed: int = 0) -> None:
        """Draw (again) the S = `n_samples` last layers the method predicts with, from `seed`."""
        if self.laplace is None:
            raise ValueError("this LaplaceMethod was loaded without its laplace-torch posterior: refit it to draw")
        self.member_weights = sample_last_layers(self.laplace, n_samples, seed).to(self.member_weights.device)
        self.n_samples = self.val_samples = n_samples

    # ------------------------------------------------------------------ the method
    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits of the members first .. first + n - 1, (n, b, C): the features once, then
        each member's last layer."""
        if first + n > self.member_weights.shape[0]:
            raise ValueError(
                f"{self.member_weights.shape[0]} last layers were drawn; members up to {first + n} "
                f"were asked for (call draw_members({first + n}))"
            )
        features, _ = self.network_fixed.features(x)
        return member_logits(self.network_fixed.head, self.member_weights[first : first + n], features)

    def predict_members(self, x: Tensor, n_samples: int | None = None, first: int = 0) -> Tensor:
        """Log-probabilities of members first .. first + S - 1, (S, b, C), from one pass through
        the network (only the last layer differs between members)."""
        return self.stochastic_forward(x, n_samples or self.n_samples, first).float().log_softmax(-1)

    def member_chunks(self, x: Tensor):
        yield self.predict_members(x)  # one pass: the S last layers are held anyway

    def predict_log_probs(self, x: Tensor, n_samples: int | None = None, first: int = 0) -> Tensor:
        """The Monte Carlo GLM predictive log 1/S Σ_s softmax(W_s φ(x) + b_s) (then the
        temperature and the calibrator, when fitted: `calibrate`)."""
        members = self.predict_members(x, n_samples, first)
        return self.calibrate(torch.logsumexp(members, dim=0) - math.log(members.shape[0]))

    def run_facts(self) -> dict:
        return {
            **super().run_facts(),
            "posterior": "last-layer Laplace",
            "laplace": self.hessian_structure,
            "prior_precision": self.prior_precision,
        }


class LastLayerLaplace(PosthocPosterior):
    """A last-layer Laplace approximation as a post-hoc posterior (`posthoc=laplace`): the
    curvature on the run's training split, the prior precision on its validation split (or by
    the marginal likelihood, or given), S last layers drawn and kept (`fit_laplace_on`).

    Args:
        name: see `PosthocPosterior`.
        n_samples: S, see `PosthocPosterior` (default 30).
        hessian: "kron" (default), "full" or "diag".
        prior_precision: "gridsearch" (the validation split), "marglik" (the training split), a
            positive number, or None: gridsearch where the run has a validation split, else marglik.
        seed: of the S last layers (and of the grid search's draws, which are the same).
    """

    name = "laplace"
    draws_members = True

    def __init__(
        self,
        name: str | None = None,
        n_samples: int | None = 30,
        hessian: str = "kron",
        prior_precision: str | float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(name, n_samples)
        if hessian not in HESSIAN_STRUCTURES:
            raise PosthocError(f"posthoc.hessian={hessian!r}: choose one of {list(HESSIAN_STRUCTURES)}")
        if isinstance(prior_precision, str) and prior_precision not in PRIOR_FITS:
            raise PosthocError(
                f"posthoc.prior_precision={prior_precision!r}: choose {' or '.join(PRIOR_FITS)}, a "
                "positive number, or null"
            )
        if prior_precision is not None and not isinstance(prior_precision, str) and not float(prior_precision) > 0:
            raise PosthocError(
                f"posthoc.prior_precision={prior_precision}: a prior precision must be positive (or "
                "gridsearch, marglik, null)."
            )
        self.hessian, self.prior_precision, self.seed = hessian, prior_precision, int(seed)

    def prior_for(self, datamodule) -> str | float:
        """The prior precision fit: as given, else gridsearch where the data has a validation split."""
        if self.prior_precision is not None:
            return self.prior_precision if isinstance(self.prior_precision, str) else float(self.prior_precision)
        return "gridsearch" if datamodule.has_val else "marglik"

    def why_not(self, method: Method, checkpoint: dict) -> str | None:
        return point_estimate_classifier(method, self.name)

    def check(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> None:
        super().check(method, datamodule, checkpoint, n_samples)
        if self.prior_for(datamodule) == "gridsearch" and not datamodule.has_val:
            raise PosthocError(
                f"posthoc={self.name} with posthoc.prior_precision=gridsearch fits the prior precision "
                "on the validation split, and this run has none (data.val_size=0): use "
                "posthoc.prior_precision=marglik (training data only), or train with data.val_size."
            )

    def fit(self, method: Method, datamodule, checkpoint: dict, n_samples: int) -> LaplaceMethod:
        prior = self.prior_for(datamodule)
        datamodule.setup("fit")
        Console().print(f"Fitting a last-layer Laplace ({self.hessian} Hessian, prior precision: {prior})")
        fitted = fit_laplace_on(
            method,
            datamodule,
            hessian_structure=self.hessian,
            prior_precision=prior,
            n_samples=n_samples,
            seed=self.seed,
        )
        Console().print(f"Prior precision λ = {fitted.prior_precision:.4g}")
        return fitted
