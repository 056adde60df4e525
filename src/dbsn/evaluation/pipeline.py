"""The evaluation of one trained model: every chosen evaluation's check, the test pass, then the
evaluations, each result written down and handed on in one place.

`Evaluator.evaluate(subject, trainer, folder, loggers, record)`:

1. `check`: each chosen evaluation looks at its inputs (sets, files, options) and refuses what
   would fail or be ignored, before anything expensive runs;
2. the test pass (`dbsn.evaluation.test_pass`): metrics, calibration beyond ECE, selective
   prediction, the reliability diagram, the MC-sample ablation, the structure posterior;
3. each evaluation in the order chosen (`evaluations=[ood,shift,adversarial]`), its numbers
   also in `<name>/summary.json`; what the test pass predicted is the subject's `test_pass`
   (its `dbsn.evaluation.recorder.PredictionRecorder`).

Each step returns `Results`; `write_results` writes them into `folder` and hands them to the
loggers. `train.py` runs the same test pass at the end of training (`Evaluator()` without
evaluations); `evaluate.py` runs it on a checkpoint, a list of checkpoints (a deep ensemble),
every run of a sweep, or a post-hoc posterior of a run (`dbsn.runtime.run.evaluate` builds the
model and hands it here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console

from dbsn.evaluation.base import Evaluation, EvaluationError, Subject
from dbsn.evaluation.cost import measure_cost
from dbsn.evaluation.results import write_results
from dbsn.evaluation.statistics import Statistics
from dbsn.evaluation.test_pass import add_calibrated_ablation, prediction_results, run_test_pass

__all__ = ["SUMMARY_FILE", "Evaluator"]

#: every evaluation's numbers under their flat names, in `<evaluation folder>/<name>/`: what the
#: report reads of an evaluation it has no section of its own for
SUMMARY_FILE = "summary.json"


class Evaluator:
    """The test pass and the chosen evaluations of one model (see the module docstring).

    Args:
        evaluations: the evaluations beyond the test pass, in the order they run; their names
            must differ (each writes into `<folder>/<name>/`).
        ablation_sizes: the ensemble sizes of the MC-sample ablation (None: every S up to 100, then
            200, 500, 1000, ... and S, `dbsn.metrics.ablation.default_sizes`; []: none).
        statistics: the evaluation's seed (set before the test pass: the same checkpoint gives
            the same numbers) and its bootstrap intervals.
        between_steps: called after the test pass and after each evaluation (the runtime hands
            the host memory each step freed back to the system: `dbsn.runtime.memory`).
    """

    def __init__(
        self,
        evaluations: Sequence[Evaluation] = (),
        ablation_sizes: Sequence[int] | None = None,
        statistics: Statistics | None = None,
        between_steps: Callable[[], Any] | None = None,
    ) -> None:
        self.statistics = statistics or Statistics()
        self.between_steps = between_steps or (lambda: None)
        self.evaluations = list(evaluations)
        names = [e.name for e in self.evaluations]
        if len(set(names)) != len(names) or not all(names):
            raise EvaluationError(f"evaluations need distinct, non-empty names; got {names}")
        self.ablation_sizes = None if ablation_sizes is None else [int(s) for s in ablation_sizes]

    def check(self, subject: Subject) -> None:
        """Every chosen evaluation's `check` (before the test pass)."""
        for evaluation in self.evaluations:
            evaluation.check(subject)

    def evaluate(
        self,
        subject: Subject,
        trainer,
        folder: Path,
        loggers: Sequence = (),
        record: Callable[[], dict[str, Any]] | None = None,
        structure: bool = True,
        checked: bool = False,
        epoch_seconds: float | None = None,
    ) -> dict[str, float]:
        """Check, test, evaluate; return every number under its flat name. `record()`: the facts
        metrics.json keeps beside the test metrics, asked for after the test pass (the method's
        `run_facts()` among them: some, such as the BatchNorm statistics used, are known only
        then); `structure`: draw the structure posterior
        (a training run has it already, from its callback); `checked`: the caller ran `check`
        on this subject already (before fitting a post-hoc posterior); `epoch_seconds`: the
        mean wall time of a training epoch, for the cost metrics.json records (`cost`: parameters,
        training and prediction FLOPs per image, peak memory; `dbsn.evaluation.cost`)."""
        if not checked:
            self.check(subject)
        model = subject.model
        seed_everything(self.statistics.seed, workers=True, verbose=False)
        metrics, recorded = run_test_pass(trainer, model, subject.datamodule, self.ablation_sizes)
        subject = replace(subject, statistics=self.statistics, test_pass=recorded)
        if trainer.world_size == 1:
            add_calibrated_ablation(recorded, self.statistics.seed)
        values = dict(metrics)
        if trainer.is_global_zero:
            facts = {**(record() if record else {}), "cost": cost_of(subject, epoch_seconds)}
            results = prediction_results(
                model,
                recorded,
                metrics,
                subject.title,
                record=facts,
                structure=structure,
                datamodule=subject.datamodule,
                statistics=self.statistics,
            )
            write_results(results, folder, loggers)
            values = results.values
        model.to(subject.device)
        self.between_steps()
        for evaluation in self.evaluations:
            results = evaluation.run(subject)
            results.files[f"{evaluation.name}/{SUMMARY_FILE}"] = {
                "evaluation": evaluation.name,
                "metrics": results.values,
            }
            write_results(results, folder, loggers)
            values.update(results.values)
            self.between_steps()
        _say_where(folder)
        return values


def cost_of(subject: Subject, epoch_seconds: float | None) -> dict[str, Any]:
    """`measure_cost` of the subject's model on (at most) 2 inputs of its test pass (FLOPs per
    image do not depend on the batch), counted on the subject's device with its peak memory
    (`trainer.test` leaves the model itself on the CPU)."""
    example = None if subject.test_pass is None else subject.test_pass.example
    if example is None:  # no test pass, or one that ran no batch (trainer.limit_test_batches=0): read them
        images, targets = next(iter(subject.datamodule.test_dataloader()))
        example = subject.datamodule.preprocess(images[:2].to(subject.device)), targets[:2]
    x, y = example[0][:2], example[1][:2]
    return measure_cost(
        subject.model, x.to(subject.device), y.to(subject.device), epoch_seconds, device=subject.device
    ).as_dict()


@rank_zero_only
def _say_where(folder: Path) -> None:
    Console().print(f"Outputs: {folder}")
