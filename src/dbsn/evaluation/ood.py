"""Out-of-distribution detection: AUROC, AUPR, FPR at 95% TPR, entropy CDFs, and the evaluation
`OODDetection` (`evaluations=[ood] ood=[<set>,...]`).

Convention: out-of-distribution (OOD) examples are the POSITIVE class and a HIGHER score
means MORE likely OOD, as for every score of :func:`dbsn.metrics.uncertainty.ood_scores`;
so FPR95 is the FPR on in-distribution at 95% TPR on OOD, as in OpenOOD v1.5
(`fpr_at_95_tpr` also gives the in-distribution-positive one).

The metrics are computed exactly (every distinct score is a threshold) with torchmetrics,
whose results agree with scikit-learn's ``roc_auc_score``, ``average_precision_score`` and
``roc_curve``, ties included: tied scores form a single threshold, so a tie between an
in-distribution and an OOD example counts as half a correctly ordered pair in the AUROC.
torchmetrics applies a sigmoid to scores outside [0, 1], which rounds nearby scores together
and saturates (in float64 every score above about 37 becomes 1.0: spurious ties), so the
scores are replaced by their dense rank scaled to [0, 1] first; the metrics depend only on
the order of the scores, so nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor
from torchmetrics.functional.classification import binary_average_precision, binary_roc

from dbsn.evaluation.base import Evaluation, EvaluationError, Subject
from dbsn.evaluation.detection import DetectionScores, OODScore
from dbsn.evaluation.ood_groups import group_coverage, group_means, openood_groups, per_set_metrics
from dbsn.evaluation.progress import progress
from dbsn.evaluation.results import ConsoleTable, Results
from dbsn.evaluation.statistics import intervals_of
from dbsn.metrics.intervals import weighted_auroc, weighted_average_precision, weighted_fpr95
from dbsn.metrics.uncertainty import detection_scores, ood_scores

__all__ = ["OOD_SCORES", "OODDetection", "detection_metrics", "entropy_cdf_figure", "fpr_at_95_tpr", "ood_report"]

#: The predictive's own scores, from the test pass (every method has them), and what each is
#: computed on; OpenOOD's post-hoc scores follow them (`dbsn.evaluation.detection`).
OOD_SCORES = ("entropy", "mutual_information", "max_probability")
_PREDICTIVE_COMPUTED_ON = {
    "entropy": "averaged predictive",
    "mutual_information": "members (their disagreement)",
    "max_probability": "averaged predictive",
}


def _as_scores(scores: Tensor | np.ndarray, name: str) -> Tensor:
    """Flat float64 tensor of scores; ValueError if empty or not finite."""
    scores = torch.as_tensor(scores).detach().double().flatten()
    if scores.numel() == 0:
        raise ValueError(f"{name} is empty: need at least one score")
    bad = int((~torch.isfinite(scores)).sum())
    if bad:
        raise ValueError(f"{name} has {bad} non-finite score(s) (NaN or ±inf) out of {scores.numel()}")
    return scores


def _dense_rank(scores: Tensor) -> Tensor:
    """Order-preserving map of the scores onto [0, 1]: ties stay ties, nothing new ties."""
    _, rank = torch.unique(scores, sorted=True, return_inverse=True)
    return rank.double() / max(int(rank.max()), 1)


def detection_metrics(scores_in: Tensor, scores_out: Tensor) -> dict[str, float]:
    """How well a score separates OOD (positive) from in-distribution examples.

    ``scores_in`` and ``scores_out`` are per-example scores (higher = more OOD) of the two
    sets, of any sizes. Returns:

    * ``auroc``: area under the ROC curve, ``P(s_out > s_in) + 1/2 P(s_out = s_in)``;
    * ``aupr``: average precision with OOD as positive (AUPR-Out),
      ``sum_k (R_k - R_{k-1}) P_k`` over the distinct thresholds;
    * ``aupr_in``: average precision with in-distribution as positive, scores negated;
    * ``fpr95``: the share of in-distribution examples flagged as OOD at the first
      threshold, going down from the highest score, at which at least 95% of the OOD
      examples are flagged (TPR ≥ 0.95). Lower is better.

    FPR95 depends on which class is positive, and both conventions are in use. Here OOD is
    positive: the FPR on in-distribution at 95% TPR on OOD, which is what OpenOOD v1.5's
    code computes (``openood/evaluators/metrics.py``, `auc_and_fpr_recall`: "we treat OOD as
    positive", ``roc_curve(ood_indicator, -conf)``). The other one, in-distribution positive
    (ODIN, Liang et al., 2018; OpenOOD v1.0's `fpr_recall`), is the FPR on OOD at 95% TPR on
    in-distribution: ``fpr_at_95_tpr(..., positive="in")``. The two differ whenever the score
    distributions are not mirror images of each other.

    Raises ValueError when a set is empty or holds NaN/inf scores.
    """
    scores_in, scores_out = _as_scores(scores_in, "scores_in"), _as_scores(scores_out, "scores_out")
    scores = torch.cat([scores_in, scores_out])
    is_out = torch.cat([torch.zeros_like(scores_in), torch.ones_like(scores_out)]).long()
    ranked, ranked_neg = _dense_rank(scores), _dense_rank(-scores)
    ones_in, ones_out = (
        torch.ones(1, len(scores_in), dtype=torch.float64),
        torch.ones(1, len(scores_out), dtype=torch.float64),
    )
    return {  # the AUROC exactly, in float64 (torchmetrics' float32 area passes 1 by an ulp on separated sets)
        "auroc": weighted_auroc(scores_in.double(), scores_out.double(), ones_in, ones_out).item(),
        "aupr": binary_average_precision(ranked, is_out).item(),
        "aupr_in": binary_average_precision(ranked_neg, 1 - is_out).item(),
        "fpr95": _fpr95(ranked, is_out),
    }


def _fpr95(ranked: Tensor, is_positive: Tensor) -> float:
    """FPR at the first threshold, going down from the highest (dense-ranked) score, with
    TPR ≥ 0.95; positives are the examples where `is_positive` is 1."""
    fpr, tpr, _ = binary_roc(ranked, is_positive)
    # TPR ≥ 0.95 in exact integer arithmetic: 20 TP ≥ 19 n_positive.
    n_positive = int(is_positive.sum())
    reached = 20 * (tpr.double() * n_positive).round().long() >= 19 * n_positive
    return fpr[reached.nonzero()[0, 0]].item()


def detection_statistics(
    scores_in: Tensor, scores_out: Tensor, weights_in: Tensor, weights_out: Tensor, chunk: int = 64
) -> dict[str, Tensor]:
    """`detection_metrics` at every row of the two sets' count matrices (B, n_in) and (B, n_out):
    {"auroc", "aupr", "aupr_in", "fpr95"} -> (B,), computed `chunk` rows at a time (a row holds
    one weight per distinct score of both sets)."""
    scores_in, scores_out = scores_in.double(), scores_out.double()
    parts: dict[str, list[Tensor]] = {"auroc": [], "aupr": [], "aupr_in": [], "fpr95": []}
    for start in range(0, len(weights_in), chunk):
        w_in, w_out = weights_in[start : start + chunk], weights_out[start : start + chunk]
        parts["auroc"].append(weighted_auroc(scores_in, scores_out, w_in, w_out))
        parts["aupr"].append(weighted_average_precision(scores_in, scores_out, w_in, w_out))
        parts["aupr_in"].append(weighted_average_precision(-scores_out, -scores_in, w_out, w_in))
        parts["fpr95"].append(weighted_fpr95(scores_in, scores_out, w_in, w_out))
    return {k: torch.cat(v) for k, v in parts.items()}


def fpr_at_95_tpr(scores_in: Tensor | np.ndarray, scores_out: Tensor | np.ndarray, positive: str = "ood") -> float:
    """FPR at 95% TPR with either class as positive (scores: higher = more OOD, as always).

    * ``positive="ood"`` (this module's convention, `detection_metrics`' ``fpr95``, OpenOOD
      v1.5): the share of in-distribution examples with a score ≥ t, for the highest threshold
      t that flags at least 95% of the OOD examples;
    * ``positive="in"`` (ODIN; OpenOOD v1.0): the share of OOD examples with a score ≤ t, for
      the lowest threshold t that accepts at least 95% of the in-distribution examples.
    """
    scores_in, scores_out = _as_scores(scores_in, "scores_in"), _as_scores(scores_out, "scores_out")
    if positive == "ood":
        negatives, positives = scores_in, scores_out
    elif positive == "in":  # the same computation with the roles swapped and the scores negated
        negatives, positives = -scores_out, -scores_in
    else:
        raise ValueError(f"positive must be 'ood' or 'in', got {positive!r}")
    scores = torch.cat([negatives, positives])
    is_positive = torch.cat([torch.zeros_like(negatives), torch.ones_like(positives)]).long()
    return _fpr95(_dense_rank(scores), is_positive)


def ood_report(members_in: Tensor, members_out: Tensor) -> dict[str, dict[str, float]]:
    """Detection metrics of each score in :data:`OOD_SCORES`.

    ``members_in`` and ``members_out`` are the member log-probabilities (S, N, C) of an
    ensemble on in-distribution and on OOD inputs (N may differ). Returns
    ``{score: detection_metrics(score_in, score_out)}`` for ``entropy``,
    ``mutual_information`` and ``max_probability`` (as ``1 - max p``).
    """
    scores_in, scores_out = ood_scores(members_in), ood_scores(members_out)
    return {name: detection_metrics(scores_in[name], scores_out[name]) for name in OOD_SCORES}


def entropy_cdf_figure(
    curves: dict[str, Tensor | np.ndarray], title: str | None = None, num_classes: int | None = None
) -> Figure:
    """Empirical CDF of the predictive entropy, one step curve per entry (DBSN paper, fig. 3 c/d).

    Caption: each curve shows, for every entropy x, the fraction of examples whose
    predictive entropy is at most x. On out-of-distribution data a good model should be
    uncertain, so its curve should rise late: lower and further to the right is better. On
    in-distribution data a curve high on the left means confident predictions.

    ``curves`` maps a legend label (a method name, or "in-distribution" / "OOD") to that
    set's per-example entropies. In ``fig.axes[0]`` the first ``len(curves)`` lines are the
    curves, in order: x data the sorted entropies, y data ``1/n, 2/n, ..., 1`` (drawn as a
    step that rises at each example). With ``num_classes`` = C the x axis runs to the
    maximum entropy log C, marked by a dotted vertical line with a text label.
    """
    fig = Figure(figsize=(7.5, 4.0), layout="constrained")
    ax = fig.subplots()
    for label, values in curves.items():
        x = np.sort(_as_scores(values, f"curve {label!r}").numpy())
        ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)
    if num_classes is not None:
        max_entropy = math.log(num_classes)
        ax.axvline(max_entropy, color="black", linestyle=":", linewidth=1)
        ax.text(
            max_entropy,
            0.5,
            f"max entropy log {num_classes} = {max_entropy:.2f}  ",
            rotation=90,
            ha="right",
            va="center",
            fontsize="small",
        )
        ax.set_xlim(0, 1.03 * max_entropy)
    else:
        ax.set_xlim(left=0)
    ax.set(
        ylim=(0, 1.02),
        xlabel="Predictive entropy (nats)",
        ylabel="Fraction of examples with entropy ≤ x",
        title=title if title is not None else "Empirical CDF of predictive entropy",
    )
    ax.grid(alpha=0.3)
    # Outside the axes, on the right, so that it hides no curve and not the max-entropy label.
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.02, 1),
        title="curve lower / further right\n= more uncertain",
        title_fontsize="small",
    )
    return fig


def cdf_points(values: Tensor, max_points: int = 101) -> list[list[float]]:
    """Points (x, F(x)) of the empirical CDF of `values` at up to `max_points` evenly spaced
    ranks, the largest value included: F(x) is the share of values <= x, ties counted."""
    ordered = torch.sort(values.double().flatten()).values
    n = ordered.numel()
    ranks = torch.unique(torch.linspace(0, n - 1, min(n, max_points)).round().long())
    x = ordered[ranks]
    below = torch.searchsorted(ordered, x, right=True)  # how many values are <= each x
    return [[float(v), float(k) / n] for v, k in zip(x, below)]


class OODDetection(Evaluation):
    """How well the model's uncertainty tells each OOD set's test split from its own test set.

    For every set of `sets` (`ood=<set>` or `ood=[<set>,...]`, by config name): AUROC, AUPR
    (OOD and in-distribution as positive) and FPR95 of the predictive's three scores
    (`OOD_SCORES`) and of the post-hoc scores (`dbsn.evaluation.detection`: OpenOOD's max-logit,
    energy, Mahalanobis, KNN, ViM, ODIN, or your own; fitted on the training split where they fit)
    under `ood/<set>/<score>/<metric>`, in `ood/<set>/`: `metrics.json`, per-example scores of both
    sets (`scores.npz`) and the empirical CDF of predictive entropy (`entropy_cdf.png`). OOD
    images are normalised with the in-distribution statistics, as the model saw its training
    data; the in-distribution scores are the test pass's (`subject.test_pass.scores`), not predicted
    again. Then near / far means over `groups` (`ood/<group>/<score>/<metric>`, `ood/groups.json`):
    the given groups, else OpenOOD v1.5's for CIFAR-10 / -100, else none.

    Args:
        sets: set name -> its data module (built from `conf/ood/<set>.yaml`).
        groups: group name -> set names, e.g. {near: [cifar100, tinyimagenet], far: [svhn]}.
        available: the post-hoc scores chosen with `ood_score=[...]`, by name (built from
            `conf/ood_score/<name>.yaml`, or your package's).
        scores: which of `available` to compute, by name, in table order (None: all; []: none).
        members: how many members they use (`DetectionScores`).
        fit_images: how many training images they use (`DetectionScores`).
    """

    name = "ood"

    def __init__(
        self,
        sets: Mapping[str, Any] | None = None,
        groups: Mapping[str, Sequence[str]] | None = None,
        available: Mapping[str, OODScore] | None = None,
        scores: Sequence[str] | None = None,
        members: int | None = 10,
        fit_images: int | None = None,
    ) -> None:
        self.sets = dict(sets or {})
        self._rows: dict[str, dict[str, Tensor]] = {}  # set -> "<score>/<metric>" -> its bootstrap rows
        self.groups = {str(k): [str(s) for s in v] for k, v in groups.items()} if groups else None
        available = dict(available or {})
        names = list(available) if scores is None else [str(s) for s in scores]
        unknown = [s for s in names if s not in available]
        if unknown:
            every = ",".join(dict.fromkeys([*available, *unknown]))
            raise EvaluationError(
                f"evaluations.ood.scores names {unknown}, which ood_score=[...] does not choose "
                f"(it chooses {list(available)}): add them there, e.g. ood_score=[{every}] "
                "(conf/ood_score/ holds dbsn's scores; a score of your own: docs/extending.md)"
            )
        try:
            self.detection = DetectionScores({s: available[s] for s in names}, members, fit_images)
        except ValueError as err:
            raise EvaluationError(f"evaluations.ood: {err}") from err
        self._in_network: dict[str, Tensor] = {}

    def check(self, subject: Subject) -> None:
        """A set is chosen; each set's files are there (downloaded first where `download=true`)
        and its test split reads (a `size` larger than the set is found here)."""
        super().check(subject)
        if not self.sets:
            raise EvaluationError(
                "evaluations=[ood] scores OOD sets and none is chosen: add ood=<set> or "
                "ood=[<set>,<set>] (conf/ood/ lists them, e.g. ood=svhn, ood=openood_cifar10)."
            )
        if self.groups:
            unknown = sorted({s for sets in self.groups.values() for s in sets} - set(self.sets))
            if unknown:
                raise EvaluationError(
                    f"evaluations.ood.groups names {unknown}, which are not among the chosen sets "
                    f"{sorted(self.sets)}: add them to ood=[...] or leave them out of the groups."
                )
        for name, datamodule in self.sets.items():
            if getattr(datamodule, "download", False):
                datamodule.prepare_data()  # ood.<set>.download=true fetches it now
            try:
                datamodule.setup("test")
            except ValueError as err:
                if type(err) is not ValueError:
                    raise  # a missing or corrupt data set says so itself
                raise EvaluationError(f"ood.{name}: {err}") from err

    @torch.no_grad()
    def scores_of(self, subject: Subject, datamodule) -> dict[str, Tensor]:
        """The per-example uncertainty scores of `datamodule`'s test split (normalised as the
        in-distribution data), on the CPU."""
        model, out = subject.model, {}
        model.eval()
        model.enable_test_noise()
        for images, _ in progress(
            datamodule.test_dataloader(), desc=f"OOD: {datamodule.name}", enabled=subject.progress
        ):
            x = subject.datamodule.preprocess(images.to(subject.device))
            for name, value in model.uncertainty_scores(x).items():
                out.setdefault(name, []).append(value.float().cpu())
        return {k: torch.cat(v) for k, v in out.items()}

    def run(self, subject: Subject) -> Results:
        results, self._rows = Results(), {}
        model, detection = subject.model, self.detection
        model.eval()
        model.enable_test_noise()
        with detection.holding(model):  # DBSN's members: the same structures for training, test and OOD images
            detection.fit(model, subject.datamodule, subject.device, subject.progress)
            self._in_network = detection.of(
                model,
                subject.datamodule,
                subject.datamodule.test_dataloader(),
                subject.device,
                "OOD scores: in-distribution test",
                subject.progress,
            )
            for name, datamodule in self.sets.items():  # one in-distribution pass for all sets
                results.add(self.one_set(subject, name, datamodule))
        results.add(self.group_results(subject, results.metrics))
        return results

    def one_set(self, subject: Subject, set_name: str, datamodule) -> Results:
        in_data, model = subject.datamodule, subject.model
        datamodule.setup("test")
        out_scores = detection_scores(self.scores_of(subject, datamodule))
        in_scores = detection_scores(subject.test_pass.scores)
        if self.detection.scores:
            out_scores.update(
                self.detection.of(
                    model,
                    datamodule,
                    datamodule.test_dataloader(),
                    subject.device,
                    f"OOD scores: {datamodule.name}",
                    subject.progress,
                    in_data=in_data,
                )
            )
            in_scores.update(self._in_network)
        n = self.detection.count(model)
        names = [s for s in (*OOD_SCORES, *self.detection.names(n)) if s in in_scores and s in out_scores]
        computed_on = {**_PREDICTIVE_COMPUTED_ON, **self.detection.computed_on(n)}
        statistics = subject.statistics
        weights_in = statistics.weights(len(in_scores["entropy"]))  # the same in-set resamples for every set
        weights_out = statistics.weights(len(out_scores["entropy"]), stream=1 + sorted(self.sets).index(set_name))
        rows = {
            f"{score}/{k}": v
            for score in names
            for k, v in detection_statistics(in_scores[score], out_scores[score], weights_in, weights_out).items()
        }
        self._rows[set_name] = rows
        intervals = intervals_of(rows, statistics.level)
        record = {
            "in_distribution": in_data.name,
            "ood": datamodule.name,
            "n_samples": model.num_members,
            "n_in": len(in_scores["entropy"]),
            "n_out": len(out_scores["entropy"]),
            "scores": {name: detection_metrics(in_scores[name], out_scores[name]) for name in names},
            "intervals": {
                score: {k: intervals[f"{score}/{k}"] for k in ("auroc", "aupr", "aupr_in", "fpr95")} for score in names
            },
            "statistics": {
                **statistics.record(),
                "interval": "percentile bootstrap, the in- and OOD sets resampled independently",
            },
            "mean_entropy": {"in": float(in_scores["entropy"].mean()), "out": float(out_scores["entropy"].mean())},
            "computed_on": {name: computed_on[name] for name in names},
            "detection": self.detection.record(n),
            "note": "OOD is the positive class; every score is higher for 'more OOD' "
            "(max_probability is stored as 1 - max probability).",
        }
        folder, prefix = f"ood/{set_name}", f"ood/{set_name}"
        figure = entropy_cdf_figure(
            {
                f"in-distribution ({in_data.name} test)": in_scores["entropy"],
                f"out-of-distribution ({datamodule.name})": out_scores["entropy"],
            },
            title=f"{subject.title}: predictive entropy",
            num_classes=in_data.num_classes,
        )
        return Results(
            metrics={f"{prefix}/{score}/{k}": v for score, m in record["scores"].items() for k, v in m.items()},
            intervals={f"{prefix}/{key}": value for key, value in intervals.items()},
            files={
                f"{folder}/metrics.json": record,
                f"{folder}/scores.npz": {
                    **{f"in_{k}": v.numpy() for k, v in in_scores.items()},
                    **{f"out_{k}": v.numpy() for k, v in out_scores.items()},
                },
                f"{folder}/entropy_cdf.png": figure,
            },
            images={f"{prefix}/entropy_cdf": f"{folder}/entropy_cdf.png"},
            tables={
                f"{prefix}/entropy_cdf_{split}": (["entropy", "cdf"], cdf_points(scores["entropy"]))
                for split, scores in (("in", in_scores), ("ood", out_scores))
            },
            console=[
                ConsoleTable(
                    f"OOD detection: {in_data.name} vs {datamodule.name}",
                    ["score", "AUROC", "AUPR", "FPR95"],
                    [[name, m["auroc"], m["aupr"], m["fpr95"]] for name, m in record["scores"].items()],
                )
            ],
        )

    def group_results(self, subject: Subject, per_set_results: Mapping[str, float]) -> Results:
        """Near- and far-OOD means (`ood/near/...`, `ood/far/...`) over the evaluated sets of each group."""
        groups = self.groups
        if not groups:
            try:
                groups = openood_groups(subject.datamodule.name)
            except KeyError:  # no standard grouping for this in-distribution set
                return Results()
        per_set = per_set_metrics(per_set_results)
        groups = {name: c["evaluated"] for name, c in group_coverage(per_set, groups).items() if c["evaluated"]}
        if not groups:
            return Results()
        means = group_means(per_set, groups)
        intervals = {}
        for group, sets in groups.items():  # the mean of the sets' resampled metrics, resample by resample
            if not all(s in self._rows for s in sets):
                continue
            for key in self._rows[sets[0]]:
                rows = torch.stack([self._rows[s][key] for s in sets]).mean(0)
                intervals[f"ood/{group}/{key}"] = intervals_of({key: rows}, subject.statistics.level)[key]
        return Results(
            metrics=means,
            intervals=intervals,
            files={"ood/groups.json": {"groups": groups, "metrics": means, "intervals": intervals}},
        )
