"""Post-hoc temperature scaling (Guo et al., 2017, "On Calibration of Modern Neural Networks").

A trained classifier's logits ``z`` are divided by one scalar temperature ``T > 0`` before the
softmax, ``p = softmax(z / T)``. ``T`` is fitted by minimising the negative log-likelihood on a
held-out validation split; it changes confidences but never the predicted class. ``T > 1``
softens an over-confident model, ``T < 1`` sharpens an under-confident one.

For an ensemble (or any Bayesian model average) the same scaler takes the log of the averaged
probabilities, ``log p̄ = log(1/S Σ_s softmax(f_s(x)))``, in place of logits, giving
``p̄^(1/T) / Σ_c p̄_c^(1/T)``. This is the standard way to temperature-scale an ensemble (e.g.
the "calibrated log-likelihood" of Ashukha et al., 2020): ``log_softmax(log p̄) = log p̄``, so
``T = 1`` leaves the ensemble's prediction unchanged, as it does a single model's.

The temperature must be fitted on a validation split carved from the training set, never on
the test set: `require_validation` checks that a DataModule has one, and `fit_temperature`
only ever iterates the loader it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "NoValidationSplitError",
    "TemperatureScaler",
    "fit_temperature",
    "require_validation",
]


class NoValidationSplitError(ValueError):
    """Temperature scaling was asked for, but there is no validation split to fit it on."""


#: Appended to every `NoValidationSplitError` message.
_VALIDATION_ADVICE = (
    "temperature scaling needs a held-out validation split carved from the training set "
    "(e.g. data.val_size=5000, or a fraction such as data.val_size=0.1); "
    "it is never fitted on the test set"
)


class TemperatureScaler(nn.Module):
    """``log_softmax(z / T)`` with one temperature ``T > 0``, stored as ``log T``.

    ``log T`` is a buffer, not a parameter: it is saved in the state dict, but an optimiser
    built from ``model.parameters()`` never sees it; only `fit` changes it.

    Attributes:
        nll_before: validation NLL at ``T = 1`` in the last `fit` (None before any fit).
        nll_after: validation NLL at the fitted ``T`` (None before any fit).
    """

    log_temperature: Tensor
    preserves_argmax = True  # T > 0 divides every class's logit alike: the predicted class stays

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
        self.register_buffer("log_temperature", torch.tensor(math.log(temperature), dtype=torch.float64))
        self.nll_before: float | None = None
        self.nll_after: float | None = None

    @property
    def temperature(self) -> float:
        """The current temperature ``T``."""
        return math.exp(self.log_temperature.item())

    def forward(self, logits: Tensor) -> Tensor:
        """Scaled log-probabilities ``log_softmax(z / T)`` over the last dimension.

        ``logits`` (..., C) are a model's logits or an ensemble's log of averaged probabilities.
        """
        scale = torch.exp(-self.log_temperature).to(device=logits.device, dtype=logits.dtype)
        return F.log_softmax(logits * scale, dim=-1)

    def fit(self, logits: Tensor, targets: Tensor, max_iter: int = 100) -> float:
        """Set ``T`` to minimise the mean NLL of `targets` under ``softmax(logits / T)``.

        L-BFGS with a strong-Wolfe line search on ``log T``, starting from ``T = 1``, so the
        result depends only on the data (not on an earlier fit). The fit runs in float64 on the
        CPU, where it is deterministic; the inputs are detached, so no gradient reaches them or
        the model that made them. The NLL before (``T = 1``) and after is kept in `nll_before`
        and `nll_after`.

        Args:
            logits: (N, C) validation logits, or log of averaged probabilities of an ensemble.
            targets: (N,) integer class labels.
            max_iter: most L-BFGS iterations.

        Returns:
            The fitted temperature.

        Raises:
            ValueError: wrong shapes, labels outside ``0..C-1``, or non-finite logits.
        """
        z, y = self._check_inputs(logits, targets)
        log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(z * torch.exp(-log_t), y)
            loss.backward()
            return loss

        with torch.enable_grad():
            nll_before = closure().item()
            optimizer.step(closure)
        if not torch.isfinite(log_t):
            raise RuntimeError(f"temperature fit diverged (log T = {log_t.item()})")
        with torch.no_grad():
            self.log_temperature.copy_(log_t.detach())
            nll_after = F.cross_entropy(z * torch.exp(-log_t), y).item()
        self.nll_before, self.nll_after = nll_before, nll_after
        return self.temperature

    @staticmethod
    def _check_inputs(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Validated float64 CPU logits (N, C) and int64 CPU targets (N,)."""
        if logits.ndim != 2 or logits.shape[0] == 0:
            raise ValueError(f"logits must be (N, C) with N > 0, got shape {tuple(logits.shape)}")
        if targets.shape != logits.shape[:1]:
            raise ValueError(f"targets must have shape ({logits.shape[0]},), got {tuple(targets.shape)}")
        if targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise ValueError(f"targets must be integer class labels, got {targets.dtype}")
        z = logits.detach().to("cpu", torch.float64)
        y = targets.detach().to("cpu", torch.long)
        bad = ~torch.isfinite(z)
        if bad.any():
            rows = bad.any(dim=1).sum().item()
            raise ValueError(
                f"logits hold non-finite values (NaN or ±inf) in {rows} of {z.shape[0]} rows; "
                "temperature scaling needs finite logits or log-probabilities (an ensemble's "
                "log of averaged probabilities should come from logsumexp, not log(mean(p)))"
            )
        if y.min() < 0 or y.max() >= z.shape[1]:
            raise ValueError(f"targets must lie in 0..{z.shape[1] - 1}, got {y.min()}..{y.max()}")
        return z, y


def fit_temperature(
    model_fn: Callable[[Tensor], Tensor],
    val_loader: Iterable[tuple[Tensor, Tensor]],
    device: torch.device | str = "cpu",
    max_iter: int = 100,
) -> TemperatureScaler:
    """Fit a `TemperatureScaler` on a model's predictions over a validation loader.

    Iterates `val_loader` once, moving each ``(x, y)`` batch's ``x`` to `device`, and calls
    ``model_fn(x)`` under `torch.no_grad`; nothing else is read. `model_fn` returns logits
    (b, C), or an ensemble's log of averaged probabilities, and does any preprocessing the loader
    leaves out (the DataModules here yield uint8 images, e.g.
    ``model_fn = lambda x: model(datamodule.preprocess(x))``); put the model in eval mode first.

    Pass the validation loader, never the test loader: the temperature is a fitted parameter.

    Raises:
        NoValidationSplitError: the loader yields no batches (e.g. ``val_dataloader()`` of a
            DataModule without a validation split, which returns ``[]``).
    """
    outputs, labels = [], []
    with torch.no_grad():
        for x, y in val_loader:
            outputs.append(model_fn(x.to(device)).detach().cpu())
            labels.append(y.cpu())
    if not outputs:
        raise NoValidationSplitError(f"the validation loader yielded no batches: {_VALIDATION_ADVICE}")
    scaler = TemperatureScaler()
    scaler.fit(torch.cat(outputs), torch.cat(labels), max_iter=max_iter)
    return scaler


def require_validation(datamodule) -> None:
    """Raise `NoValidationSplitError` unless `datamodule` has a validation split.

    Checks ``datamodule.has_val``; after ``setup("fit")`` it also checks that the split is not
    empty (a small fractional ``val_size`` can round to zero images).
    """
    name = type(datamodule).__name__
    val_size = getattr(datamodule, "val_size", "?")
    if not datamodule.has_val:
        raise NoValidationSplitError(f"{name} has no validation split (val_size={val_size}): {_VALIDATION_ADVICE}")
    if getattr(datamodule, "train_set", None) is not None and getattr(datamodule, "val_set", None) is None:
        raise NoValidationSplitError(
            f"{name}'s validation split is empty (val_size={val_size} rounds to 0 images): {_VALIDATION_ADVICE}"
        )
