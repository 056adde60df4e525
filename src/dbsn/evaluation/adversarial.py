"""Adversarial robustness as an evaluation (`evaluations=[adversarial]`): FGSM and BIM against the
posterior predictive, the paper's Figures 3 a/b and 4 (the attacks: `dbsn.evaluation.attacks`).

Reported per attack and ε as `adversarial/<attack>/<accuracy|mean_entropy>@<ε>`; in
`adversarial/`: `results.csv`, `results.json`, `adversarial.png`; on W&B as curves against
their own x axis `adversarial/epsilon`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from dbsn.data.augment import normalize, to_unit_range
from dbsn.evaluation.attacks import (
    ATTACKS,
    PAPER_EPSILONS,
    RESULT_COLUMNS,
    ExampleChunkedNLL,
    adversarial_evaluation,
    adversarial_figure,
)
from dbsn.evaluation.base import Evaluation, EvaluationError, Subject
from dbsn.evaluation.results import ConsoleTable, CsvTable, Results

__all__ = ["AdversarialRobustness", "PixelBatches", "adversarial_curve"]


class PixelBatches:
    """Re-iterable test batches in [0, 1] pixel space on `device` (at most `max_examples`)."""

    def __init__(self, loader, device: torch.device, max_examples: int | None = None) -> None:
        self.loader, self.device, self.max_examples = loader, device, max_examples

    def __len__(self) -> int:  # batches, for the progress bar
        if self.max_examples is None:
            return len(self.loader)
        return min(len(self.loader), math.ceil(self.max_examples / self.loader.batch_size))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        seen = 0
        for images, labels in self.loader:
            if self.max_examples is not None:
                images, labels = images[: self.max_examples - seen], labels[: self.max_examples - seen]
            if len(labels) == 0:
                return
            seen += len(labels)
            yield to_unit_range(images.to(self.device)), labels.to(self.device)


def adversarial_curve(rows: list[dict]) -> list[dict[str, float]]:
    """One W&B row per ε: `adversarial/epsilon` and `adversarial/<attack>/{accuracy,mean_entropy}`."""
    points: dict[float, dict[str, float]] = {}
    for r in rows:
        point = points.setdefault(float(r["epsilon"]), {"adversarial/epsilon": float(r["epsilon"])})
        point.update({f"adversarial/{r['attack']}/{k}": float(r[k]) for k in ("accuracy", "mean_entropy")})
    return [points[eps] for eps in sorted(points)]


class AdversarialRobustness(Evaluation):
    """FGSM and BIM against the posterior predictive, on the test split.

    Args:
        attacks: any of "fgsm", "bim".
        epsilons: perturbation sizes in [0, 1] pixel units (the paper's 0, 0.01, ..., 0.1).
        bim_steps: BIM's steps of ε / steps.
        attack_samples: members of the predictive whose NLL is attacked (paper: 30).
        eval_samples: other members, which evaluate the attacked images (paper: 30).
        max_examples: attack only the first N test images (None: all).
        batch_size: images per attacked batch.
        examples_per_backward: images whose autograd graph is held at once in an attack's input
            gradient (it holds their forwards through the attack_samples members;
            `ExampleChunkedNLL`); None: the whole batch.
    Attacks run in [0, 1] pixel space; the model sees the images normalised as in training.
    """

    name = "adversarial"

    def __init__(
        self,
        attacks: Sequence[str] = ("fgsm", "bim"),
        epsilons: Sequence[float] = PAPER_EPSILONS,
        bim_steps: int = 3,
        attack_samples: int = 30,
        eval_samples: int = 30,
        max_examples: int | None = None,
        batch_size: int | None = 100,
        examples_per_backward: int | None = 10,
    ) -> None:
        self.attacks, self.epsilons = list(attacks), [float(e) for e in epsilons]
        self.bim_steps, self.attack_samples, self.eval_samples = int(bim_steps), int(attack_samples), int(eval_samples)
        self.max_examples, self.batch_size = max_examples, batch_size
        self.examples_per_backward = examples_per_backward

    def check(self, subject: Subject) -> None:
        super().check(subject)
        unknown = [a for a in self.attacks if a not in ATTACKS]
        if unknown:
            raise EvaluationError(f"evaluations.adversarial.attacks: unknown {unknown}; choose from {sorted(ATTACKS)}.")
        bad = [e for e in self.epsilons if not 0 <= e <= 1]
        if bad or not self.epsilons:
            raise EvaluationError(
                f"evaluations.adversarial.epsilons: sizes in [0, 1] pixel units, got {self.epsilons}."
            )
        for key in ("bim_steps", "attack_samples", "eval_samples"):
            if getattr(self, key) < 1:
                raise EvaluationError(f"evaluations.adversarial.{key} must be >= 1, got {getattr(self, key)}.")
        if self.examples_per_backward is not None and self.examples_per_backward < 1:
            raise EvaluationError(
                "evaluations.adversarial.examples_per_backward must be >= 1 or null (the whole batch in "
                f"one graph), got {self.examples_per_backward}."
            )
        if self.max_examples is not None and self.max_examples < 1:
            raise EvaluationError(
                f"evaluations.adversarial.max_examples must be >= 1 or null, got {self.max_examples}."
            )

    def run(self, subject: Subject) -> Results:
        model, datamodule, device = subject.model, subject.datamodule, subject.device
        model.eval()
        model.enable_test_noise()
        # cached by the test pass under inference mode; autograd needs normal tensors
        mean, std = (stat.clone() for stat in datamodule.statistics_on(device))

        def attack_log_probs(x: Tensor) -> Tensor:
            return model.predict_log_probs(normalize(x, mean, std), self.attack_samples)

        def attack_loss(y: Tensor) -> ExampleChunkedNLL:
            # members drawn at every call (DBSN without per-structure BatchNorm) drawn once a gradient
            return ExampleChunkedNLL(
                attack_log_probs, y, self.examples_per_backward, hold=lambda: model.fixed_members(self.attack_samples)
            )

        def eval_log_probs(x: Tensor) -> Tensor:  # other members than the attacked ones
            return model.predict_log_probs(normalize(x, mean, std), self.eval_samples, first=self.attack_samples)

        datamodule.setup("test")
        if self.batch_size:  # gradients through `attack_samples` members: batches are heavier
            datamodule.eval_batch_size = int(self.batch_size)
        batches = PixelBatches(datamodule.test_dataloader(), device, self.max_examples)
        rows = adversarial_evaluation(
            attack_log_probs,
            eval_log_probs,
            batches,
            epsilons=tuple(self.epsilons),
            attacks=tuple(self.attacks),
            bim_steps=self.bim_steps,
            progress=subject.progress,
            attack_loss=None if self.examples_per_backward is None else attack_loss,
        )
        title = subject.title
        return Results(
            shown_as_curves={
                f"adversarial/{r['attack']}/{k}@{r['epsilon']:g}": r[k]
                for r in rows
                for k in ("accuracy", "mean_entropy")
            },
            files={
                "adversarial/results.csv": CsvTable(list(RESULT_COLUMNS), rows),
                "adversarial/results.json": rows,
                "adversarial/adversarial.png": adversarial_figure(
                    {title: rows}, title=f"{title}: adversarial robustness"
                ),
            },
            images={"adversarial/curves": "adversarial/adversarial.png"},
            curves={"adversarial/epsilon": adversarial_curve(rows)},
            console=[
                ConsoleTable(
                    "Adversarial accuracy / mean entropy",
                    ["attack", "ε", "accuracy", "entropy"],
                    [[r["attack"], f"{r['epsilon']:.2f}", r["accuracy"], r["mean_entropy"]] for r in rows],
                )
            ],
        )
