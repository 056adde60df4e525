"""The field's published CIFAR figures beside this report's runs on the same backbones.

The figures are uncertainty-baselines' WideResNet-28-10 table (google/uncertainty-baselines,
baselines/cifar/README.md: trained by its authors on TPUs, ensembles of 4, ECE with 15 bins as
here) and, for ResNet-18, the deterministic 94.71 % (CIFAR-10) and 77.40 % (CIFAR-100) of 200
epochs that Zhang et al. (2020) report beside cSG-MCMC (the same README's related results); SWAG's
WideResNet-28-10 row is Izmailov et al.'s (2019, 300 epochs). `../shared/reference/field-baselines-facts.md`
lists them with their sources. The methods' own papers add theirs: cSGHMC and cSGLD on ResNet-18
(Zhang et al., ICLR 2020: the test errors of ruqizhang/csgmcmc's README, 12 samples), DDU on
WideResNet-28-10 (Mukhoti et al.: accuracy, ECE and the AUROC of the feature density with SVHN as
the OOD set, omegafragger/DDU's README, 5 runs). Each row's `source` says where its figures are
read. Set-ups differ between sources (augmentation, epochs, batch, hardware), so a row says how far
a run here is from the published figure, not which is right.

A run here is matched by its method and backbone (`map_fixed@wrn28_10` is uncertainty-baselines'
"deterministic": on a backbone without structure MAP and MAP-fixed α are the same network). The
corrupted-data columns are the means over every corruption and severity of the run's shift
evaluation (CIFAR-10-C), as the published cA / cNLL / cCE are. The SVHN column is the AUROC of the
row's OOD score (`svhn_score`, e.g. DDU's `gda`) in the run's OOD evaluation with `ood=svhn`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.format import DATASET_ORDER, INTERVAL_MARKS_NOTE, fmt, md_table, mean_std, order, run_bounds
from dbsn.evaluation.report.writer import write_csv


class Published(NamedTuple):
    """One published row: accuracy in %, NLL, ECE; on corrupted data mean accuracy in %, NLL, ECE."""

    name: str
    accuracy: float | None
    nll: float | None = None
    ece: float | None = None
    c_accuracy: float | None = None
    c_nll: float | None = None
    c_ece: float | None = None
    source: str = "uncertainty-baselines, WideResNet-28-10"
    svhn_auroc: float | None = None  # AUROC in %, SVHN as the OOD set, of the run's OOD score `svhn_score`
    svhn_score: str | None = None


_DETERMINISTIC = "deterministic"
_CSGMCMC = "Zhang et al. 2020, ruqizhang/csgmcmc README (100 - test error), 200 epochs"
#: (dataset, backbone) -> {method config name: the published row}
PUBLISHED: dict[tuple[str, str], dict[str, Published]] = {
    ("cifar10", "wrn28_10"): {
        "map_fixed": Published(_DETERMINISTIC, 96.0, 0.159, 0.0231, 76.1, 1.05, 0.153),
        "batch_ensemble": Published("BatchEnsemble (4)", 96.3, 0.136, 0.0177, 77.8, 0.97, 0.124),
        "rank1_bnn": Published("rank-1 BNN, Gaussian (4)", 96.3, 0.128, 0.008, 76.7, 0.84, 0.080),
        "mimo": Published("MIMO", 96.4, 0.123, 0.010, 76.6, 0.927, 0.112),
        "sngp": Published("SNGP", 96.0, 0.134, 0.007, 78.5, 0.74, 0.078),
        "mc_dropout": Published("MC dropout (30 samples)", 96.1, 0.145, 0.019, 70.0, 1.27, 0.167),
        "deep_ensemble": Published("deep ensemble (4)", 96.6, 0.114, 0.010, 77.9, 0.81, 0.087),
        "bbb": Published("mean-field VI (1 sample)", 94.7, 0.211, 0.029, 71.3, 1.46, 0.181),
        "map_fixed+swag": Published("SWAG", 96.41, 0.1122, source="Izmailov et al. 2019, 300 epochs"),
        "ddu": Published(
            "DDU (GMM density)",
            95.97,
            ece=0.0085,
            svhn_auroc=98.09,
            svhn_score="gda",
            source="Mukhoti et al., omegafragger/DDU README (SN + architecture changes, 350 epochs, 5 runs)",
        ),
    },
    ("cifar100", "wrn28_10"): {
        "map_fixed": Published(_DETERMINISTIC, 79.8, 0.875, 0.0857),
        "batch_ensemble": Published("BatchEnsemble (4)", 81.9, 0.690, 0.0265),
        "rank1_bnn": Published("rank-1 BNN, Gaussian (4)", 81.3, 0.692, 0.018),
        "mimo": Published("MIMO", 82.0, 0.690, 0.022),
        "sngp": Published("SNGP", 80.2, 0.805, 0.020),
        "mc_dropout": Published("MC dropout (30 samples)", 80.7, 0.785, 0.0487),
        "deep_ensemble": Published("deep ensemble (4)", 82.7, 0.666, 0.021),
    },
    ("cifar10", "resnet18"): {
        "map_fixed": Published(_DETERMINISTIC, 94.71, source="ResNet-18 (CIFAR), 200 epochs"),
        "csghmc": Published("cSGHMC (12 samples)", 95.73, source=_CSGMCMC),  # test error 4.27 %
        "csgld": Published("cSGLD (12 samples)", 95.71, source=_CSGMCMC),  # 4.29 %
    },
    ("cifar100", "resnet18"): {
        "map_fixed": Published(_DETERMINISTIC, 77.40, source="Zhang et al. 2020 (uncertainty-baselines), 200 epochs"),
        "csghmc": Published("cSGHMC (12 samples)", 79.50, source=_CSGMCMC),  # 20.50 %
        "csgld": Published("cSGLD (12 samples)", 79.45, source=_CSGMCMC),  # 20.55 %
    },
}
for _rows in PUBLISHED.values():  # MAP learns no structure on a backbone: the same network as MAP-fixed α
    if "map_fixed" in _rows:
        _rows.setdefault("map", _rows["map_fixed"])


def published_row(method: str, dataset: str) -> Published | None:
    """The published figure for a run's method name (`<method>@<backbone>[+posthoc]`), or None."""
    base, _, rest = method.partition("@")
    backbone, _, posthoc = rest.partition("+")
    return PUBLISHED.get((dataset, backbone), {}).get(base + (f"+{posthoc}" if posthoc else ""))


def _shift_means(run: Run) -> dict[str, float] | None:
    """The run's means over every corruption and severity (accuracy in %, NLL, ECE), or None."""
    path = run.path / "evaluation" / "shift" / "metrics.json"
    if not path.is_file():
        return None
    rows = json.loads(path.read_text()).get("rows") or []
    if not rows:
        return None
    return {
        "c_accuracy": 100.0 * (1.0 - float(np.mean([r["error"] for r in rows]))),
        "c_nll": float(np.mean([r["nll"] for r in rows])),
        "c_ece": float(np.mean([r["ece"] for r in rows])),
    }


def _svhn_auroc(run: Run, score: str | None) -> tuple[float, list[float] | None] | None:
    """The AUROC in % of `score` in the run's OOD evaluation with SVHN as the OOD set (`ood=svhn`), with its
    bootstrap interval, or None."""
    path = run.path / "evaluation" / "ood" / "svhn" / "metrics.json"
    if score is None or not path.is_file():
        return None
    record = json.loads(path.read_text())
    value = (record.get("scores") or {}).get(score, {}).get("auroc")
    if value is None:
        return None
    bounds = (record.get("intervals") or {}).get(score, {}).get("auroc")
    return 100.0 * value, None if bounds is None else [100.0 * b for b in bounds]


def _published(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _cell(group: list[Run], key: str):
    """The cell of `key` over the runs of `group` that have it, or None where none does."""
    found = [r for r in group if key in r.metrics]
    return mean_std([r.metrics[key] for r in found], [run_bounds(r, key) for r in found]) if found else None


def published_section(report: Report, ok: list[Run]) -> str:
    """Each run on a field backbone that has a published figure, beside it (module docstring)."""
    runs = defaultdict(list)
    for r in ok:
        if published_row(r.method, r.dataset) is not None:
            runs[r.method, r.dataset].append(r)
    if not runs:
        return ""
    header = [
        "method",
        "dataset",
        "published as",
        "accuracy (%)",
        "published",
        "NLL",
        "published",
        "ECE",
        "published",
        "cA (%)",
        "published",
        "cNLL",
        "published",
        "cECE",
        "published",
        "SVHN AUROC (%)",
        "published",
        "source",
    ]
    rows, csv_rows = [], []
    for dataset in order({d for _, d in runs}, DATASET_ORDER):
        for method in sorted({m for m, d in runs if d == dataset}):
            group, pub = runs[method, dataset], published_row(method, dataset)
            error = [r for r in group if "test/error" in r.metrics]
            accuracy = (
                mean_std(
                    [100.0 * (1.0 - r.metrics["test/error"]) for r in error],
                    [
                        None if (b := run_bounds(r, "test/error", 100.0)) is None else [100.0 - b[1], 100.0 - b[0]]
                        for r in error
                    ],
                )
                if error
                else None
            )
            nll, ece = (_cell(group, key) for key in ("test/nll", "test/ece"))
            shifts = [s for s in (_shift_means(r) for r in group) if s]
            shifted = {k: mean_std([s[k] for s in shifts]) for k in ("c_accuracy", "c_nll", "c_ece")} if shifts else {}
            aurocs = [a for a in (_svhn_auroc(r, pub.svhn_score) for r in group) if a]
            auroc = mean_std([a[0] for a in aurocs], [a[1] for a in aurocs]) if aurocs else None
            rows.append(
                [
                    method,
                    dataset,
                    pub.name,
                    fmt(accuracy, 2, "accuracy", 100.0),
                    _published(pub.accuracy, 2),
                    fmt(nll, 3, "nll"),
                    _published(pub.nll, 3),
                    fmt(ece, 4, "ece"),
                    _published(pub.ece, 4),
                    fmt(shifted.get("c_accuracy"), 1, "accuracy", 100.0),
                    _published(pub.c_accuracy, 1),
                    fmt(shifted.get("c_nll"), 3, "nll"),
                    _published(pub.c_nll, 3),
                    fmt(shifted.get("c_ece"), 3, "ece"),
                    _published(pub.c_ece, 3),
                    fmt(auroc, 2, "auroc", 100.0) + (f" ({pub.svhn_score})" if auroc else ""),
                    _published(pub.svhn_auroc, 2),
                    pub.source,
                ]
            )
            csv_rows.append(
                [
                    method,
                    dataset,
                    pub.name,
                    accuracy and accuracy.mean,
                    pub.accuracy,
                    nll and nll.mean,
                    pub.nll,
                    ece and ece.mean,
                    pub.ece,
                    shifted.get("c_accuracy") and shifted["c_accuracy"].mean,
                    pub.c_accuracy,
                    shifted.get("c_nll") and shifted["c_nll"].mean,
                    pub.c_nll,
                    shifted.get("c_ece") and shifted["c_ece"].mean,
                    pub.c_ece,
                    auroc and auroc.mean,
                    pub.svhn_auroc,
                    pub.source,
                ]
            )
    write_csv(
        report,
        "published.csv",
        [h if h != "published" else f"published_{header[i - 1]}" for i, h in enumerate(header)],
        csv_rows,
    )
    return (
        "## Beside the published figures\n\n"
        "Runs on the field's backbones next to the figures their authors published for the same method and "
        "backbone (uncertainty-baselines' WideResNet-28-10 table, ensembles of 4; ResNet-18: the deterministic "
        "200-epoch figures; the methods' own papers for cSG-MCMC and DDU; each row's source). Ours: mean ± std "
        "[95 % interval] (seeds). " + INTERVAL_MARKS_NOTE + " Corrupted-data columns: means over every corruption "
        "and severity of the run's shift evaluation. SVHN AUROC: the AUROC of the score in brackets (DDU's "
        "feature density `gda`) in the run's OOD evaluation with ood=svhn. Set-ups differ between sources; a gap "
        "is a question to ask, not a verdict.\n\n" + md_table(header, rows) + "\n"
    )
