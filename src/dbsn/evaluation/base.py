"""The door for an evaluation: what one is, and what it is given.

An evaluation runs on a trained model after its test pass, is chosen by name on the command line
(`evaluate.py ... evaluations=[ood,shift]`, one `conf/evaluations/<name>.yaml` each, whose
`_target_` builds it) and returns a `dbsn.evaluation.results.Results`. It does two things:

- `check(subject)`: look at every input it will need (data sets, files, options that do not fit
  this model) and raise `EvaluationError` with what is wrong and how to fix it. The pipeline
  calls every chosen evaluation's `check` before the test pass, so nothing expensive runs
  before a mistake is found.
- `run(subject) -> Results`: evaluate; return numbers under stable names starting with its
  `name` (`<name>/...`), and the files it made, relative to the evaluation folder (under
  `<name>/`). It writes nothing itself and logs nothing: `write_results` does, for all.

`docs/extending.md` shows a complete one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from dbsn.evaluation.recorder import PredictionRecorder
from dbsn.evaluation.results import Results
from dbsn.evaluation.statistics import Statistics

__all__ = ["Evaluation", "EvaluationError", "Subject"]


class EvaluationError(ValueError):
    """An evaluation cannot run as asked: the message says what is wrong and how to fix it."""


@dataclass
class Subject:
    """What an evaluation looks at.

    Attributes:
        model: the trained method (`dbsn.methods.Method`: a run's own method, a deep ensemble
            of runs, or a post-hoc posterior of a run) in eval mode.
        datamodule: the data the model was trained on (`preprocess` maps loader images to
            the network's input).
        title: what the figures call the model, e.g. "DBSN on Digits (S = 100)".
        device: where to predict.
        progress: show progress bars.
        statistics: the evaluation's seed and bootstrap (set by the `Evaluator`).
        test_pass: what the model's test pass predicted (set by the `Evaluator` after it, so
            None in `check`): a `PredictionRecorder` whose `log_probs`, `targets` and `scores`
            are the test set's ensemble log-probabilities, targets and per-example uncertainty
            scores (classifiers).
        cache: what one evaluation predicted that another may need, by key, so that nothing
            is predicted twice (`dbsn.evaluation.shift.corrupted_log_probs` keeps each
            corrupted set's log-probabilities here for `shift` and `conformal`). It lives as
            long as the subject, one model's evaluation.
    """

    model: Any
    datamodule: Any
    title: str
    device: torch.device
    progress: bool = True
    statistics: Statistics = field(default_factory=Statistics)
    test_pass: PredictionRecorder | None = None
    cache: dict = field(default_factory=dict)

    @property
    def is_classifier(self) -> bool:
        """One label per input (not segmentation): per-example test outputs are kept."""
        return bool(self.model.task.keeps_test_outputs)


class Evaluation:
    """An evaluation beyond the test pass; subclasses set `name` and implement `run` (and
    `check` where they have inputs to check). See the module docstring."""

    #: the folder (`<evaluation folder>/<name>/`) and the first part of the metric names
    name: ClassVar[str] = ""
    #: whether it applies to segmentation models too (the suite's evaluations are per image)
    segmentation: ClassVar[bool] = False

    def check(self, subject: Subject) -> None:
        """Raise `EvaluationError` for any input that would fail or be ignored; the default
        refuses segmentation models where `segmentation` is False."""
        if not self.segmentation and not subject.is_classifier:
            raise EvaluationError(
                f"evaluations=[{self.name}] is defined for classifiers; this is a segmentation "
                "model (its test pass reports mIoU, pixel ECE and uncertainty maps)."
            )

    def run(self, subject: Subject) -> Results:
        raise NotImplementedError
