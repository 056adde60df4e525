"""Any calibrator as a post-hoc posterior (`PosthocCalibration`), written once for all of them:
`conf/posthoc/<name>.yaml` names this class and, under `calibrator`, the calibrator it fits.

The fitted calibrator is set as the method's `calibrator`: `Method.calibrate` applies it (after
the temperature, when the run has one) to the predictive and to each member, for the uncertainty
decomposition and the sample ablation. It applies to every classifier: ensembles, DBSN, the
Bayesian methods, a deep ensemble of runs (`ckpt_path=[a,b,c]`: one calibrator on the ensemble's
predictive, log of averaged probabilities), and on top of another post-hoc posterior (`base`).
It is fitted in float64 on the CPU from the validation split's predictive log-probabilities and
labels (`validation_predictive`; never the test split).

With a temperature. A run trained with `temperature_scaling=true` predicts with its temperature;
the calibrator is fitted on that predictive, the one the run makes, and applied after it. Stacking
is not wrong: each stage is fitted on the validation predictions of what comes before it, and the
temperature only reshapes the input (a second temperature multiplies into the first).

On top of another post-hoc posterior. `base` (a `PosthocPosterior`, e.g. `posthoc=isotonic
+posthoc@posthoc.base=laplace`) is fitted first and the calibrator calibrates its predictive; the
posterior's name is then `<base>+<calibrator>` (method `map_fixed+laplace+isotonic` in reports).
"""

from __future__ import annotations

import copy
import itertools

import torch
from rich.console import Console
from torch import Tensor

from dbsn.methods.base import Method
from dbsn.methods.temperature import NoValidationSplitError, require_validation
from dbsn.posthoc.base import PosthocError, PosthocPosterior
from dbsn.posthoc.calibrators.base import Calibrator

__all__ = ["PosthocCalibration", "validation_predictive"]


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
        batches = [
            (method.predict_log_probs(datamodule.preprocess(x.to(device))).cpu(), y.cpu())
            for x, y in datamodule.val_dataloader()
        ]
    finally:
        method.calibrator = calibrator
    if not batches:
        raise NoValidationSplitError(f"{type(datamodule).__name__}'s validation loader yielded no batches")
    return torch.cat([lp for lp, _ in batches]), torch.cat([y for _, y in batches])


class PosthocCalibration(PosthocPosterior):
    """The finished method (or `base` fitted on it) with a copy of `calibrator` fitted on its
    validation predictive and set as its `calibrator` (see the module docstring).

    Args:
        calibrator: the calibrator, unfitted (each run gets a fitted copy).
        name: see `PosthocPosterior`; None: the calibrator's `name`, after `base`'s
            (`laplace+isotonic`).
        n_samples: S, unless `evaluate.py n_samples=` says; None: the method's own (with a
            `base`: the base's own `n_samples`, which is then this posterior's).
        base: a post-hoc posterior fitted first, whose predictive the calibrator calibrates.
    """

    def __init__(
        self,
        calibrator: Calibrator,
        name: str | None = None,
        n_samples: int | None = None,
        base: PosthocPosterior | None = None,
    ) -> None:
        if not isinstance(calibrator, Calibrator):
            raise PosthocError(
                f"posthoc.calibrator must be a dbsn.posthoc.calibrators.Calibrator (its _target_), got "
                f"{type(calibrator).__name__}"
            )
        if not calibrator.name:
            raise PosthocError(
                f"posthoc.calibrator: {type(calibrator).__name__} needs a name (a class attribute "
                "name = '...': the metrics.json of its runs name it, and the report's table reads it)"
            )
        if base is not None and not isinstance(base, PosthocPosterior):
            raise PosthocError(
                f"posthoc.base must be a post-hoc posterior (e.g. +posthoc@posthoc.base=laplace), got "
                f"{type(base).__name__}"
            )
        if n_samples is None and base is not None:
            n_samples = base.n_samples
        super().__init__(name or (f"{base.name}+{calibrator.name}" if base is not None else calibrator.name), n_samples)
        self.calibrator, self.base = calibrator, base

    def why_not(self, method: Method, checkpoint: dict) -> str | None:
        if not method.task.keeps_test_outputs:
            return f"posthoc={self.name} is defined for classifiers; this is a segmentation model"
        return self.base.why_not(method, checkpoint) if self.base is not None else None

    def check(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> None:
        if self.base is not None:
            self.base.check(method, datamodule, checkpoint, n_samples)
        if not datamodule.has_val:
            raise PosthocError(
                f"posthoc={self.name} is fitted on the validation split, and this run has none "
                "(data.val_size=0): train with a validation split (e.g. data.val_size=5000 or 0.1); it "
                "is never fitted on the test set."
            )
        try:
            self.calibrator.check(method.num_classes)
        except ValueError as err:
            raise PosthocError(f"posthoc.calibrator: {err} (posthoc={self.name})") from None

    def fit(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> Method:
        if self.base is not None:
            method = self.base.fit(method, datamodule, checkpoint, n_samples)
        else:
            method.use_samples(n_samples)
        datamodule.setup("fit")
        log_probs, targets = validation_predictive(method, datamodule)
        calibrator = copy.deepcopy(self.calibrator).fit(log_probs, targets)
        method.calibrator = calibrator.to(next(itertools.chain(method.parameters(), method.buffers())).device)
        Console().print(calibrator.summary(), soft_wrap=True)
        return method
