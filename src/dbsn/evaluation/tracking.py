"""What our runs send to Weights & Biases, and under which names.

Names are stable and shared with `metrics.json` and the dashboard (`dbsn.tools.dashboard`):

- per-epoch metrics (`val/*`, `structure/*`, `posterior/*`, `*_epoch`) use the epoch as their
  x axis (`define_metric(step_metric="epoch")`);
- summaries mean what they say: an error, NLL, Brier score, ECE, FPR95, AURC, E-AURC, AUGRC or
  risk at 80 % coverage summarises to its minimum (`<name>.min`), an AUROC, AUPR, mIoU or IoU to
  its maximum (`<name>.max`), under `val/`, `test/`, `ood/`, `selective/` and `shift/`; everything
  else to W&B's default, the last value;
- a metric's interval is `<name>/ci_low`, `<name>/ci_high` (within the metric's limits) and
  `<name>/ci_misses_estimate` (`dbsn.evaluation.interval_rule`, `results.interval_numbers`);
- curves over another variable get it as their step metric (`log_curve`: attacks against
  `adversarial/epsilon`, the MC-sample ablation against `ablation/n_samples`);
- figures compared across runs also go in as W&B tables (`log_to_wandb(tables=...)`), the PNGs stay.

Every metric is defined by its exact name just before it is first logged (W&B's globs match
suffixes only, and Lightning's logger defines `*` against the global step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities import rank_zero_only

MINIMISED = frozenset(
    {"error", "nll", "brier", "ece", "adaptive_ece", "classwise_ece", "fpr95", "aurc", "eaurc", "augrc", "risk@80"}
)
MAXIMISED = frozenset({"auroc", "aupr", "aupr_in", "miou", "global_acc"})
SUMMARISED_PREFIXES = ("val/", "test/", "ood/", "selective/", "shift/")
PER_EPOCH_PREFIXES = ("val/", "structure/", "posterior/")
EPOCH = "epoch"  # Lightning logs the epoch with every row


def summary_of(name: str) -> str | None:
    """'min' or 'max' for a metric whose best value is its summary, else None (W&B keeps the last)."""
    if not name.startswith(SUMMARISED_PREFIXES):
        return None
    leaf = name.rsplit("/", 1)[-1]
    if leaf in MINIMISED:
        return "min"
    if leaf in MAXIMISED or "/iou/" in name:  # test/iou/<class>
        return "max"
    return None


def step_metric_of(name: str) -> str | None:
    """The x axis of a metric logged once per epoch; None for per-step metrics."""
    return EPOCH if name.startswith(PER_EPOCH_PREFIXES) or name.endswith("_epoch") else None


def summary_key(name: str) -> str:
    """The key under which W&B's run summary holds a metric: `name.min` / `name.max` where its
    summary is the best value, else the name itself."""
    summary = summary_of(name)
    return f"{name}.{summary}" if summary else name


def define_metrics(run, names: Iterable[str], defined: set[str], prefix: str = "") -> None:
    """`run.define_metric` for each name not yet in `defined` (updated in place), under the
    logger's `prefix` (Lightning's `<prefix>-<name>`) if it has one."""
    for name in names:
        if name in defined or name == EPOCH or name.startswith("trainer/"):
            continue
        summary, step = summary_of(name), step_metric_of(name)
        if summary or step:
            named = lambda key: f"{prefix}-{key}" if prefix and key else key  # Lightning prefixes every key
            run.define_metric(named(name), step_metric=named(step), summary=summary)
        defined.add(name)


class WandbLogger(LightningWandbLogger):
    """Lightning's W&B logger, plus the definitions of the module docstring: each metric's
    summary and x axis is declared before its first value."""

    @property
    def _defined(self) -> set[str]:
        """Names already defined in this process (made here, not in an __init__ of ours: the config
        check reads the constructor's signature, which stays Lightning's)."""
        return self.__dict__.setdefault("_defined_names", set())

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        define_metrics(self.experiment, metrics, self._defined, self._prefix)
        super().log_metrics(metrics, step)

    @rank_zero_only
    def log_curve(self, step_metric: str, rows: list[dict[str, float]]) -> None:
        """One W&B row per point of a curve, `step_metric` its x axis (e.g. accuracy against ε)."""
        run = self.experiment
        if step_metric not in self._defined:
            run.define_metric(step_metric, hidden=True)
            self._defined.add(step_metric)
        for name in {k for row in rows for k in row} - self._defined - {step_metric}:
            run.define_metric(name, step_metric=step_metric)
            self._defined.add(name)
        for row in rows:
            run.log(dict(row))


def wandb_loggers(loggers) -> list[LightningWandbLogger]:
    return [logger for logger in loggers or () if isinstance(logger, LightningWandbLogger)]


def log_to_wandb(
    loggers,
    metrics: Mapping[str, float] | None = None,
    images: Mapping[str, Path] | None = None,
    tables: Mapping[str, tuple[list[str], list[list[Any]]]] | None = None,
    curves: Mapping[str, list[dict[str, float]]] | None = None,
) -> None:
    """Send numbers, PNGs, tables (`key: (columns, rows)`) and curves (`step metric: rows`, see
    `WandbLogger.log_curve`) to every W&B logger among `loggers`; nothing without one."""
    for logger in wandb_loggers(loggers):
        if metrics:
            logger.log_metrics(dict(metrics))
        for key, path in (images or {}).items():
            logger.log_image(key=key, images=[str(path)])
        for key, (columns, rows) in (tables or {}).items():
            logger.log_table(key=key, columns=list(columns), data=[list(r) for r in rows])
        for step_metric, rows in (curves or {}).items():
            if isinstance(logger, WandbLogger):
                logger.log_curve(step_metric, rows)
            else:  # Lightning's own logger: the rows without their x axis
                for row in rows:
                    logger.log_metrics(dict(row))
