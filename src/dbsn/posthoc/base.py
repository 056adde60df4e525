"""The door for a post-hoc posterior: fitted on a finished run, predicting with S members.

A post-hoc posterior turns a trained method into a new method without training it again: a
last-layer Laplace approximation (`laplace`), SWAG (`swag`), a calibrator (`temperature`,
`histogram_binning`, `isotonic`, `dirichlet`: `dbsn.posthoc.calibrators`, whose door is smaller),
or one of your own. `evaluate.py ckpt_path=<run> posthoc=<name>` fits it (`conf/posthoc/<name>.yaml`
builds it) and evaluates what `fit` returns as every other method, into `<run>/posthoc/<name>/`,
reported as method `<run's method>+<name>`. A posterior says three things:

- `why_not(method, checkpoint)`: None where it applies, else the reason (shown, or the run
  skipped in a sweep);
- `check(method, datamodule, checkpoint, n_samples)`: every input it needs, before anything is
  fitted (a validation split, collected moments, settings, an S where it `draws_members`); raise
  `PosthocError`;
- `fit(method, datamodule, checkpoint, n_samples)`: a `dbsn.methods.Method` that predicts with
  exactly `n_samples` members (None: the method's own S, for a posterior that keeps its members).

S is resolved once by the runtime (`dbsn.runtime.evaluation.evaluation_samples`) and given to
`check` and `fit` as it is. `docs/extending.md` shows a complete one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dbsn.methods.base import Method

__all__ = ["PosthocError", "PosthocPosterior", "point_estimate_classifier"]


class PosthocError(ValueError):
    """A post-hoc posterior cannot be fitted as asked: the message says why and how to fix it."""


class PosthocPosterior:
    """A post-hoc posterior (see the module docstring).

    Args:
        name: the method's name in reports and on W&B (after the run's method: `map+laplace`)
            and the folder `<run>/posthoc/<name>/`; None: the class's `name`.
        n_samples: S, the members it predicts with, unless `evaluate.py n_samples=` says;
            None: the method's own S (refused by `check` where it `draws_members`).
    """

    name: str = ""
    #: It draws members of its own (SWAG's weights, Laplace's last layers), so it needs an S:
    #: `check` refuses None.
    draws_members: bool = False

    def __init__(self, name: str | None = None, n_samples: int | None = None) -> None:
        self.name = str(name or type(self).name)
        if not self.name:
            raise ValueError(f"{type(self).__name__} needs a name (a class attribute or name=)")
        if n_samples is not None and int(n_samples) < 1:
            raise PosthocError(f"posthoc.n_samples must be >= 1 (or null), got {n_samples}")
        self.n_samples = None if n_samples is None else int(n_samples)

    def why_not(self, method: Method, checkpoint: dict[str, Any]) -> str | None:
        """None when the posterior applies to `method` (whose run wrote `checkpoint`), else why not."""
        return None

    def check(self, method: Method, datamodule, checkpoint: dict[str, Any], n_samples: int | None = None) -> None:
        """Raise `PosthocError` for an input the fit would fail on (here: no S for a posterior
        that `draws_members`; a subclass with checks of its own calls this one too)."""
        if self.draws_members and n_samples is None:
            raise PosthocError(
                f"posthoc={self.name} draws members of its own and needs their number S: set "
                "posthoc.n_samples (e.g. 30) or evaluate.py n_samples=, not null."
            )

    def fit(self, method: Method, datamodule, checkpoint: dict[str, Any], n_samples: int | None = None) -> Method:
        raise NotImplementedError


def point_estimate_classifier(method: Method, name: str) -> str | None:
    """The reason `name` does not apply to `method` unless it is one point-estimate classifier
    (map, map_fixed) whose last layer `classifier` is an nn.Linear; None when it is."""
    if getattr(method, "members", None) is not None or method.is_stochastic or not method.task.keeps_test_outputs:
        return (
            f"posthoc={name} works on a point-estimate classifier (map, map_fixed: one network, which may be one "
            f"member of an ensemble trained as separate runs); this checkpoint is {type(method).__name__}"
        )
    head = getattr(getattr(method, "net", None), "classifier", None)
    if not isinstance(head, nn.Linear):
        return (
            f"posthoc={name} needs the network's last layer `classifier` to be an nn.Linear; this checkpoint's "
            f"{type(method).__name__} has a {type(head).__name__} there (SNGP: a Gaussian-process output layer "
            "with its own posterior)"
        )
    return None
