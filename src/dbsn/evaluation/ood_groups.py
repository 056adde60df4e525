"""Near- and far-OOD groups of OpenOOD v1.5 (Zhang et al., 2023) and the means over a group.

OpenOOD v1.5 reports OOD detection on CIFAR models per group of OOD sets
(``openood/evaluation_api/datasets.py``, `DATA_INFO`): near-OOD sets share much of the
in-distribution's image statistics and semantics, far-OOD sets do not. A group's number is the
plain mean over its sets of each per-set metric. The set names here are the config names of
conf/ood/ (``ood=openood_cifar10`` selects all six sets of the CIFAR-10 groups), so the
per-set results ``ood/<set>/<score>/<metric>`` of an evaluation (`dbsn.evaluation.ood.OODDetection`)
feed `group_means` directly:

    group_means(per_set_metrics(results), openood_groups("cifar10"))
    -> {"ood/near/entropy/auroc": ..., "ood/far/entropy/fpr95": ..., ...}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

__all__ = ["FAR_OOD", "OOD_GROUPS", "group_coverage", "group_means", "openood_groups", "per_set_metrics"]

#: OpenOOD v1.5's far-OOD sets of both CIFAR benchmarks.
FAR_OOD = ("mnist", "svhn", "textures", "places365")

#: In-distribution set -> {group: OOD sets}, named as the configs in conf/ood/.
OOD_GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "cifar10": {"near": ("cifar100", "tinyimagenet"), "far": FAR_OOD},
    "cifar100": {"near": ("cifar10", "tinyimagenet"), "far": FAR_OOD},
}


def openood_groups(in_distribution: str) -> dict[str, tuple[str, ...]]:
    """The groups of `in_distribution`, named as a data config ("cifar10") or as a data
    module's `name` ("CIFAR-10"); KeyError naming the known ones otherwise."""
    key = in_distribution.lower().replace("-", "").replace("_", "")
    if key not in OOD_GROUPS:
        raise KeyError(f"no OpenOOD v1.5 OOD groups for {in_distribution!r}; known: {sorted(OOD_GROUPS)}")
    return OOD_GROUPS[key]


def per_set_metrics(results: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """{set: {"<score>/<metric>": value}} of the ``ood/<set>/<score>/<metric>`` entries of flat
    results (other entries are ignored)."""
    per_set: dict[str, dict[str, float]] = {}
    for key, value in results.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "ood":
            per_set.setdefault(parts[1], {})[f"{parts[2]}/{parts[3]}"] = float(value)
    return per_set


def _flat(metrics: Mapping) -> dict[str, float]:
    """{"<score>/<metric>": value} of flat or nested ({score: {metric: value}}) metrics."""
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}/{k}": v for k, v in _flat(value).items()})
        else:
            flat[str(key)] = float(value)
    return flat


def group_coverage(
    per_set: Mapping[str, Mapping], groups: Mapping[str, tuple[str, ...]]
) -> dict[str, dict[str, list[str]]]:
    """{group: {"evaluated": [...], "missing": [...]}}: which sets of each group have results."""
    return {
        group: {"evaluated": [s for s in sets if s in per_set], "missing": [s for s in sets if s not in per_set]}
        for group, sets in groups.items()
    }


def group_means(per_set: Mapping[str, Mapping], groups: Mapping[str, tuple[str, ...]]) -> dict[str, float]:
    """``ood/<group>/<score>/<metric>``: the mean over the group's evaluated sets of each metric.

    `per_set` maps a set name to its metrics, flat (``{"entropy/auroc": 0.9, ...}``, as
    `per_set_metrics` gives) or nested (``{"entropy": {"auroc": 0.9, ...}}``, as the
    `scores` of an `OODDetection` record): every metric there is averaged
    (AUROC, AUPR, AUPR-In, FPR95 of each score). `groups` maps a group name to its sets, e.g.
    `openood_groups("cifar10")`. Sets without results are left out of the mean and named in a
    `UserWarning` (`group_coverage` returns them); a group with no evaluated set gives no entry.
    Raises ValueError when the evaluated sets of a group do not have the same metrics.
    """
    means: dict[str, float] = {}
    for group, coverage in group_coverage(per_set, groups).items():
        if coverage["missing"]:
            over = ", ".join(coverage["evaluated"]) or "no set: the group is left out"
            warnings.warn(
                f"OOD group {group!r}: no results for {', '.join(coverage['missing'])}; its means are over {over}",
                UserWarning,
                stacklevel=2,
            )
        metrics = [_flat(per_set[name]) for name in coverage["evaluated"]]
        if not metrics:
            continue
        for name, m in zip(coverage["evaluated"], metrics):
            if set(m) != set(metrics[0]):
                differ = sorted(set(m) ^ set(metrics[0]))
                raise ValueError(
                    f"OOD group {group!r}: {name} and {coverage['evaluated'][0]} do not have "
                    f"the same metrics (differing: {differ})"
                )
        for key in metrics[0]:
            means[f"ood/{group}/{key}"] = sum(m[key] for m in metrics) / len(metrics)
    return means
