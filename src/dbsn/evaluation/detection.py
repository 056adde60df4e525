"""OpenOOD's post-hoc detection scores of any method, beside the predictive's own (entropy, mutual
information, 1 − max probability): what the OOD evaluation (`evaluations=[ood]`) adds per set.

A score is an `OODScore`: one class that says how a posterior's members enter it (`members`, one of
its `treatments`), learns what it needs from the training split (`fit`; nothing by default) and
gives a score per image, higher = more OOD (`score`). The maths of each is in
:mod:`dbsn.metrics.ood_scores`; the classes here know about members and methods. A score is chosen
by config: `conf/ood_score/<name>.yaml` names its class and settings, `ood_score=[...]` chooses
which are built and `evaluations.ood.scores` which are computed (null: all); its name everywhere is
its config's file name. A score of your own: docs/extending.md.

The built-in scores (max_logit, energy, mahalanobis, knn, vim, odin; with `_members` variants
computed per member and averaged where the method has more than one member) are listed with their
sources in docs/evaluation.md ("OpenOOD's post-hoc OOD scores"). The feature scores fit on the
training split, unaugmented, in eval mode, with `Method.fixed_members` holding DBSN's sampled
structures fixed for the whole evaluation; a score a method cannot give (ViM without a linear last
layer; feature scores where no `classifier` layer sees the features) is left out, and the
evaluation's record says why.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dbsn.data.augment import normalize, to_unit_range
from dbsn.data.base import in_memory_loader
from dbsn.evaluation.progress import progress
from dbsn.methods.features import FeaturesUnavailable
from dbsn.metrics.ood_scores import KNN, Mahalanobis, ViM, energy, max_logit, odin

__all__ = [
    "DetectionScores",
    "EnergyScore",
    "FeatureScore",
    "KNNScore",
    "MahalanobisScore",
    "MaxLogitScore",
    "Members",
    "ODINScore",
    "OODScore",
    "ScoreUnavailable",
    "Training",
    "ViMScore",
]

#: what a score can read of a batch (`OODScore.reads`)
READS = ("logits", "features", "images")


class ScoreUnavailable(Exception):
    """A method cannot give a score (the message says why; the evaluation leaves the score out)."""


@dataclass
class Training:
    """What a score fits on: the training split as the first n members see it.

    Attributes:
        logits: (n, N, C) and features: (n, N, D), the members' logits and the inputs of their
            last layer (`Method.member_outputs`), float32 on the CPU.
        labels: (N,) the training labels; num_classes: C.
        heads: each member's linear last layer (W (C, D), b (C,)) on those features (float32,
            CPU); None where the last layer is not linear.
        method: the method's class name (for a score's reason to be left out).
    """

    logits: Tensor
    features: Tensor
    labels: Tensor
    num_classes: int
    heads: list[tuple[Tensor, Tensor]] | None
    method: str


@dataclass
class Members:
    """What a score reads of one batch of images for the first n members of a method.

    Attributes:
        n: how many members.
        images: (b, 3, H, W) in [0, 1] pixel units.
        logits: (n, b, C) float32, where a chosen score reads logits or features; else None.
        features: (n, b, D) float32, where a chosen score reads features; else None.
        logits_of: `logits_of(x, k, first)`: the logits (k, b, C) of members first .. first + k - 1
            on images x in [0, 1], differentiable in x (ODIN).
        per_forward: members per batched forward (`Method.samples_per_forward`).
    """

    n: int
    images: Tensor
    logits: Tensor | None
    features: Tensor | None
    logits_of: Callable[[Tensor, int, int], Tensor]
    per_forward: int


class OODScore:
    """A post-hoc OOD score of a method's members; higher = more OOD.

    A subclass sets `reads` (what `score` needs of a batch: "logits", "features" or "images") and
    `treatments` (each way the members can enter -> one line saying what the score is computed on,
    for the record and the docs), optionally `variant` (a treatment also computed, as
    ``<name>_members``, when the method has several members), and defines `score`. A score that
    learns from the training split defines `fit` (only then are the training features computed).
    `members` chooses the treatment (None: the first). As in scikit-learn, each constructor argument
    is kept as the attribute of the same name (`params` reads them: the record, the variant's copy).
    """

    reads: ClassVar[str] = "logits"
    treatments: ClassVar[Mapping[str, str]] = {}
    variant: ClassVar[str | None] = None

    def __init__(self, members: str | None = None) -> None:
        members = next(iter(self.treatments), None) if members is None else members
        if members not in self.treatments:
            raise ValueError(f"members={members!r}: {type(self).__name__} takes {' or '.join(self.treatments)}")
        self.members = members

    @property
    def computed_on(self) -> str:
        """What the score is computed on, in one line."""
        return self.treatments[self.members]

    @property
    def fits(self) -> bool:
        """Whether the score learns from the training split (its class defines `fit`)."""
        return type(self).fit is not OODScore.fit

    def fit(self, training: Training) -> None:
        """Learn from the training split (nothing by default); raise `ScoreUnavailable` where the
        method cannot give this score."""

    def score(self, members: Members) -> Tensor:
        """The score (b,) of each image of the batch."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The constructor's arguments, by name."""
        return {name: getattr(self, name) for name in inspect.signature(type(self)).parameters}

    def with_members(self, members: str) -> OODScore:
        """The same score, unfitted, with another treatment."""
        return type(self)(**{**self.params(), "members": members})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"


# ---------------------------------------------------------------------------------- of the logits
class LogitScore(OODScore):
    """A function of the logits (`of_logits`: (N, C) -> (N,)): of the members' mean logits, or each
    member's, averaged (the variant ``<name>_members``)."""

    treatments: ClassVar[Mapping[str, str]] = {"mean_logits": "members' mean logits", "per_member": "mean over members"}
    variant: ClassVar[str | None] = "per_member"

    def of_logits(self, logits: Tensor) -> Tensor:
        raise NotImplementedError

    def score(self, members: Members) -> Tensor:
        if self.members == "mean_logits":
            return self.of_logits(members.logits.mean(0))
        return torch.stack([self.of_logits(z) for z in members.logits]).mean(0)


class MaxLogitScore(LogitScore):
    """−max_c z_c (Hendrycks et al. 2022; :func:`dbsn.metrics.ood_scores.max_logit`)."""

    def of_logits(self, logits: Tensor) -> Tensor:
        return max_logit(logits)


class EnergyScore(LogitScore):
    """−T·logsumexp(z / T) (Liu et al. 2020; :func:`dbsn.metrics.ood_scores.energy`), T = `temperature`."""

    def __init__(self, members: str, temperature: float) -> None:
        super().__init__(members)
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.temperature = float(temperature)

    def of_logits(self, logits: Tensor) -> Tensor:
        return energy(logits, self.temperature)


# -------------------------------------------------------------------------------- of the features
class FeatureScore(OODScore):
    """A score fitted on the training features (`fit_one` makes one fitted
    :mod:`dbsn.metrics.ood_scores` module from features (N, D)), in one of two treatments:

    * ``per_member``: each member fitted on its own training features and scoring its own
      features; the members' scores averaged.
    * ``pooled``: one fit on the members' mean feature h̄ = 1/S Σ_s h_s, scoring the mean feature
      (ViM: with the members' mean head W̄ = 1/S Σ_s W_s, b̄ likewise). Where the members share
      their last layer (DBSN's structures, MC dropout: one `classifier`), W h̄ + b is exactly the
      members' mean logits, so the pooled score treats the posterior as `max_logit` and `energy`
      do: as the one network whose logits are the members' mean, with D features like a single
      network (ViM's `dim` and KNN's k mean what they mean for one). It presumes that the members
      read one feature space; members trained apart (a deep ensemble, Packed-Ensembles' groups)
      do not, and their pooled score is not meaningful.

    For one member both are the same number.
    """

    reads: ClassVar[str] = "features"
    treatments: ClassVar[Mapping[str, str]] = {"per_member": "mean over members", "pooled": "members' mean feature"}

    def fit_one(self, features: Tensor, training: Training, head: tuple[Tensor, Tensor] | None) -> nn.Module:
        """One fitted score from training features (N, D) and the head that reads them."""
        raise NotImplementedError

    def fit(self, training: Training) -> None:
        heads = training.heads
        if self.members == "pooled":
            head = None if heads is None else tuple(torch.stack(p).mean(0) for p in zip(*heads))
            self._fitted = [self.fit_one(training.features.mean(0), training, head)]
        else:
            self._fitted = [
                self.fit_one(f, training, None if heads is None else heads[s]) for s, f in enumerate(training.features)
            ]

    def score(self, members: Members) -> Tensor:
        features = members.features
        if self.members == "pooled":
            return self._fitted[0].to(features.device).score(features.mean(0))
        return torch.stack([f.to(features.device).score(features[s]) for s, f in enumerate(self._fitted)]).mean(0)


class MahalanobisScore(FeatureScore):
    """min_c Mahalanobis distance to the training class means under a tied covariance (Lee et al.
    2018 as OpenOOD's MDS; :class:`dbsn.metrics.ood_scores.Mahalanobis`)."""

    def fit_one(self, features: Tensor, training: Training, head) -> nn.Module:
        return Mahalanobis().fit(features, training.labels, training.num_classes)


class KNNScore(FeatureScore):
    """Distance to the k-th nearest normalised training feature (Sun et al. 2022;
    :class:`dbsn.metrics.ood_scores.KNN`)."""

    def __init__(self, members: str, k: int) -> None:
        super().__init__(members)
        if int(k) < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = int(k)

    def fit_one(self, features: Tensor, training: Training, head) -> nn.Module:
        return KNN(k=self.k).fit(features)


class ViMScore(FeatureScore):
    """The virtual-logit score on the residual of the training features' principal subspace, on
    the linear head (Wang et al. 2022; :class:`dbsn.metrics.ood_scores.ViM`); `dim`: the principal
    dimension (None: :func:`dbsn.metrics.ood_scores.vim_dim` of the feature size)."""

    treatments: ClassVar[Mapping[str, str]] = {
        "per_member": "mean over members",
        "pooled": "members' mean feature and mean head",
    }

    def __init__(self, members: str, dim: int | None) -> None:
        super().__init__(members)
        self.dim = dim

    def fit(self, training: Training) -> None:
        if training.heads is None:
            raise ScoreUnavailable(
                f"{training.method}'s last layer is not linear (ViM needs its weights and bias: "
                "e.g. SNGP's is a Gaussian process)"
            )
        super().fit(training)

    def fit_one(self, features: Tensor, training: Training, head) -> nn.Module:
        return ViM(dim=self.dim).fit(features, *head)


# ----------------------------------------------------------------------------------- of the input
class ODINScore(OODScore):
    """ODIN (Liang et al. 2018; :func:`dbsn.metrics.ood_scores.odin`): temperature `temperature`
    and an input step `epsilon` (in [0, 1] pixel units) towards confidence; on the averaged
    tempered predictive, or each member with its own step, averaged (``odin_members``).
    `batch_size` images per input gradient: its graph holds every member's activations of them (a
    single-pass ensemble's tiled batch too; its size: docs/performance.md); the scores do not depend on it (each image's gradient is its own)."""

    reads: ClassVar[str] = "images"
    treatments: ClassVar[Mapping[str, str]] = {"predictive": "averaged predictive", "per_member": "mean over members"}
    variant: ClassVar[str | None] = "per_member"

    def __init__(self, members: str, temperature: float, epsilon: float, batch_size: int = 16) -> None:
        super().__init__(members)
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.temperature, self.epsilon, self.batch_size = float(temperature), float(epsilon), int(batch_size)

    def score(self, members: Members) -> Tensor:
        on = "predictive" if self.members == "predictive" else "members"
        return torch.cat(
            [
                odin(
                    members.logits_of,
                    x,
                    members.n,
                    temperature=self.temperature,
                    epsilon=self.epsilon,
                    on=on,
                    chunk=members.per_forward,
                )
                for x in members.images.split(self.batch_size)
            ]
        )


# ------------------------------------------------------------------------------------- the runner
@dataclass
class DetectionScores:
    """Fits and computes `scores` (name -> `OODScore`, in table order) on a method's members.

    Args:
        scores: the scores by name.
        members: how many of the prediction's members the scores use (the first ones; None: all S).
        fit_images: training images the scores that fit learn from (the first ones; None: all).
    """

    scores: Mapping[str, OODScore] = field(default_factory=dict)
    members: int | None = 10
    fit_images: int | None = None
    notes: dict[str, str] = field(default_factory=dict)  # score -> why it was left out

    def __post_init__(self) -> None:
        self.scores = dict(self.scores)
        for name, score in self.scores.items():
            if not isinstance(score, OODScore):
                raise ValueError(
                    f"ood_score.{name} builds a {type(score).__name__}, not a "
                    "dbsn.evaluation.detection.OODScore (docs/extending.md: an OOD score)"
                )
            if score.reads not in READS:
                raise ValueError(
                    f"ood_score.{name}: {type(score).__name__}.reads is {score.reads!r}, not one of {READS}"
                )
        if self.members is not None and int(self.members) < 1:
            raise ValueError(f"members must be >= 1 (or null: all), got {self.members}")
        if self.fit_images is not None and int(self.fit_images) < 1:
            raise ValueError(f"fit_images must be >= 1 (or null: all), got {self.fit_images}")
        self._outputs: dict[str, OODScore] | None = None  # set by `fit`: the scores and their variants

    def count(self, model) -> int:
        """The members the scores use."""
        return model.num_members if self.members is None else min(int(self.members), model.num_members)

    def holding(self, model):
        """The context of a whole evaluation: the members fixed (see `Method.fixed_members`)."""
        return model.fixed_members(self.count(model)) if self.scores else nullcontext()

    def outputs(self, n: int) -> dict[str, OODScore]:
        """Every score computed for a method with n members, in table order: each chosen score,
        then its variant ``<name>_members`` where it has one and n > 1."""
        out = {}
        for name, score in self.scores.items():
            out[name] = score
            if n > 1 and score.variant is not None and score.variant != score.members:
                out[f"{name}_members"] = score.with_members(score.variant)
        return out

    # ------------------------------------------------------------------ fit
    @torch.no_grad()
    def fit(self, model, datamodule, device: torch.device, show: bool = True) -> None:
        """Fit the scores that learn from the training split (call inside `holding`)."""
        n = self.count(model)
        self.notes, self._outputs = {}, self.outputs(n)
        fitting = {name: score for name, score in self._outputs.items() if score.fits}
        if not fitting:
            return
        try:
            training = self._training(model, datamodule, device, n, show)
        except FeaturesUnavailable as err:
            self.notes.update({name: str(err) for name in fitting})
            return
        for name, score in fitting.items():
            try:
                score.fit(training)
            except ScoreUnavailable as err:
                self.notes[name] = str(err)

    def _training(self, model, datamodule, device: torch.device, n: int, show: bool) -> Training:
        """The first n members' logits and features of the training split (the first `fit_images`)."""
        if getattr(datamodule, "train_set", None) is None:
            datamodule.setup("fit")
        features, labels, logits = [], [], []
        seen = 0
        loader = in_memory_loader(datamodule, datamodule.train_set, train=False)
        for images, targets in progress(loader, desc="Detection scores: training features", enabled=show):
            if self.fit_images is not None and seen >= self.fit_images:
                break
            keep = len(targets) if self.fit_images is None else min(len(targets), self.fit_images - seen)
            z, f = model.member_outputs(datamodule.preprocess(images[:keep].to(device)), n)
            features.append(f.float().cpu())
            logits.append(z.float().cpu())
            labels.append(targets[:keep].cpu())
            seen += keep
        heads = model.member_heads(n)
        heads = None if heads is None else [(w.float().cpu(), b.float().cpu()) for w, b in heads]
        return Training(
            torch.cat(logits, 1),
            torch.cat(features, 1),
            torch.cat(labels),
            model.num_classes,
            heads,
            type(model).__name__,
        )

    # ------------------------------------------------------------------ score
    def of(
        self, model, datamodule, loader: Iterable, device: torch.device, desc: str, show: bool = True, in_data=None
    ) -> dict[str, Tensor]:
        """Every score of the images of `loader` (uint8, normalised as `in_data`, the
        in-distribution data module; default `datamodule`), on the CPU (call after `fit`, inside
        `holding`)."""
        in_data = in_data or datamodule
        if self._outputs is None:
            raise RuntimeError("DetectionScores.of before fit: call fit(model, datamodule, device) first")
        n = self.count(model)
        scores = {name: score for name, score in self._outputs.items() if name not in self.notes}
        reads = {score.reads for score in scores.values()}
        mean, std = (t.clone() for t in in_data.statistics_on(device))  # not inference tensors: ODIN differentiates

        def logits_of(x: Tensor, count: int, first: int) -> Tensor:
            return model.stochastic_forward(normalize(x, mean, std), count, first)

        out: dict[str, list[Tensor]] = {}
        for images, _ in progress(loader, desc=desc, enabled=show):
            x_unit = to_unit_range(images.to(device))
            logits = features = None
            with torch.no_grad():  # one forward for every score that reads logits or features
                if "features" in reads:
                    logits, features = model.member_outputs(normalize(x_unit, mean, std), n)
                    features = features.float()
                elif "logits" in reads:
                    logits = model.stochastic_forward(normalize(x_unit, mean, std), n, 0)
                batch = Members(
                    n,
                    x_unit,
                    None if logits is None else logits.float(),
                    features,
                    logits_of,
                    model.samples_per_forward,
                )
                for name, score in scores.items():  # ODIN takes its gradient inside
                    out.setdefault(name, []).append(score.score(batch).detach().float().cpu())
        return {k: torch.cat(v) for k, v in out.items()}

    def names(self, n: int) -> list[str]:
        """The score names computed for a method with n members, in table order."""
        return [name for name in self.outputs(n) if name not in self.notes]

    def computed_on(self, n: int) -> dict[str, str]:
        """What each score of a method with n members is computed on, in one line."""
        return {name: score.computed_on for name, score in self.outputs(n).items() if name not in self.notes}

    def record(self, n: int) -> Mapping:
        return {
            "members": n,
            "fit_images": self.fit_images,
            "scores": {
                name: {"class": f"{type(score).__module__}.{type(score).__qualname__}", **score.params()}
                for name, score in self.scores.items()
            },
            "left_out": dict(self.notes),
        }
