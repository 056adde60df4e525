"""The report's runs on the field's backbones beside the published figures (dbsn.evaluation.report.published)."""

from __future__ import annotations

import csv
import json

import pytest

from dbsn.evaluation.report import build_report
from dbsn.evaluation.report.format import order
from dbsn.evaluation.report.published import PUBLISHED, published_row
from dbsn.methods.registry import METHOD_ORDER
from tests.support.fakeruns import write_run

WRN = {"_target_": "dbsn.nets.WideResNet"}


def test_a_run_finds_its_published_row_by_method_backbone_and_dataset():
    assert published_row("batch_ensemble@wrn28_10", "cifar10").accuracy == 96.3
    assert (
        published_row("rank1_bnn@wrn28_10", "cifar10").nll == 0.128
        and published_row("rank1_bnn@wrn28_10", "cifar100").ece == 0.018
    )
    assert published_row("map@wrn28_10", "cifar100") == published_row("map_fixed@wrn28_10", "cifar100")
    assert published_row("map_fixed@wrn28_10+swag", "cifar10").nll == pytest.approx(0.1122)
    assert published_row("batch_ensemble", "cifar10") is None  # on DBSN's cell network: nothing published
    assert published_row("mimo@resnet18", "cifar10") is None
    assert (
        published_row("csghmc@resnet18", "cifar10").accuracy == 95.73
        and published_row("csgld@resnet18", "cifar100").accuracy == 79.45
    )
    assert published_row("map@resnet18", "cifar100").accuracy == 77.40
    ddu = published_row("ddu@wrn28_10", "cifar10")
    assert (ddu.accuracy, ddu.ece, ddu.svhn_auroc, ddu.svhn_score) == (95.97, 0.0085, 98.09, "gda")
    assert all(p.accuracy is not None for rows in PUBLISHED.values() for p in rows.values())


def test_methods_are_grouped_by_backbone_in_the_canonical_order():
    names = {
        "mimo@wrn28_10",
        "dbsn",
        "map_fixed@wrn28_10",
        "map_fixed",
        "map_fixed@resnet18",
        "map_fixed@wrn28_10+swag",
        "map_fixed+laplace",
        "mine",
    }
    assert order(names, METHOD_ORDER) == [
        "dbsn",
        "map_fixed",
        "map_fixed+laplace",
        "mine",
        "map_fixed@resnet18",
        "map_fixed@wrn28_10",
        "mimo@wrn28_10",
        "map_fixed@wrn28_10+swag",
    ]


def test_the_report_sets_runs_beside_the_published_figures(tmp_path):
    runs = tmp_path / "runs"
    for seed, error in ((1, 0.04), (2, 0.05)):  # two seeds of the deterministic WRN-28-10
        write_run(
            runs / f"det{seed}",
            {"_target_": "dbsn.methods.MAP", "learn_structure": False, "net": WRN},
            "dbsn.data.CIFAR10DataModule",
            seed,
            error,
        )
    shift = runs / "det1" / "evaluation" / "shift"
    shift.mkdir(parents=True)
    shift.joinpath("metrics.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"corruption": "fog", "severity": 1, "error": 0.2, "nll": 0.8, "ece": 0.1, "brier": 0.3},
                    {"corruption": "fog", "severity": 5, "error": 0.4, "nll": 1.6, "ece": 0.3, "brier": 0.5},
                ]
            }
        )
    )
    write_run(
        runs / "cells",
        {"_target_": "dbsn.methods.MAP", "learn_structure": False, "net": {"_target_": "dbsn.nets.StructureNet"}},
        "dbsn.data.CIFAR10DataModule",
        1,
        0.05,
    )
    report = build_report([runs], tmp_path / "report")
    with (report.out / "published.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["map_fixed@wrn28_10"]  # the cell-network run has no published figure
    row = rows[0]
    assert float(row["accuracy (%)"]) == pytest.approx(95.5) and float(row["published_accuracy (%)"]) == 96.0
    assert float(row["NLL"]) == pytest.approx(0.45) and float(row["published_NLL"]) == pytest.approx(0.159)
    assert float(row["cA (%)"]) == pytest.approx(70.0) and float(row["cNLL"]) == pytest.approx(1.2)
    assert float(row["published_cA (%)"]) == 76.1
    text = (report.out / "report.md").read_text()
    assert (
        "## Beside the published figures" in text
        and "| map_fixed@wrn28_10 | cifar10 | deterministic | 95.50 ± 0.71" in text
    )


def test_the_samplers_and_ddu_are_set_beside_their_papers_figures(tmp_path):
    """cSGHMC and cSGLD on ResNet-18 (CIFAR-10 and -100) beside Zhang et al.'s, DDU on WRN-28-10 beside Mukhoti
    et al.'s with its feature density's AUROC against SVHN read from the run's OOD evaluation; every published row is
    a config of conf/model/ (with a post-hoc posterior of conf/posthoc/), so that a run can match it."""
    from dbsn import CONF_DIR

    resnet = {"_target_": "dbsn.nets.ResNet18"}
    sampler = {"_target_": "dbsn.methods.csgmcmc.CSGMCMC", "net": resnet}
    runs = tmp_path / "runs"
    write_run(runs / "csghmc", {**sampler, "sampler": {"friction": 0.9}}, "dbsn.data.CIFAR100DataModule", 1, 0.2)
    write_run(runs / "csgld", {**sampler, "sampler": {"friction": 1.0}}, "dbsn.data.CIFAR10DataModule", 1, 0.05)
    for seed, auroc in ((1, 0.96), (2, 0.98)):
        write_run(
            runs / f"ddu{seed}", {"_target_": "dbsn.methods.DDU", "net": WRN}, "dbsn.data.CIFAR10DataModule", seed, 0.04
        )
        ood = runs / f"ddu{seed}" / "evaluation" / "ood" / "svhn"
        ood.mkdir(parents=True)
        ood.joinpath("metrics.json").write_text(
            json.dumps(
                {
                    "ood": "SVHN",
                    "scores": {"entropy": {"auroc": 0.5}, "gda": {"auroc": auroc}},
                    "intervals": {"gda": {"auroc": [auroc - 0.01, auroc + 0.01]}},
                }
            )
        )
    report = build_report([runs], tmp_path / "report")
    with (report.out / "published.csv").open() as f:
        rows = {r["method"] + " " + r["dataset"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["csghmc@resnet18 cifar100", "csgld@resnet18 cifar10", "ddu@wrn28_10 cifar10"]
    assert float(rows["csghmc@resnet18 cifar100"]["published_accuracy (%)"]) == 79.50
    assert float(rows["csgld@resnet18 cifar10"]["accuracy (%)"]) == pytest.approx(95.0)
    assert "ruqizhang/csgmcmc" in rows["csgld@resnet18 cifar10"]["source"]
    ddu = rows["ddu@wrn28_10 cifar10"]
    assert float(ddu["SVHN AUROC (%)"]) == pytest.approx(97.0) and float(ddu["published_SVHN AUROC (%)"]) == 98.09
    assert float(ddu["published_ECE"]) == 0.0085 and "omegafragger/DDU" in ddu["source"]
    assert rows["csgld@resnet18 cifar10"]["SVHN AUROC (%)"] == ""  # no score published: no column read
    text = (report.out / "report.md").read_text()
    row = next(
        line for line in text.splitlines() if line.startswith("| ddu@wrn28_10 | cifar10 | DDU (GMM density) | 96.00")
    )
    assert "| 97.00 ± 1.41 [" in row and "(2) (gda) | 98.09 |" in row
    methods = {p.stem for p in (CONF_DIR / "model").glob("*.yaml")}
    posteriors = {p.stem for p in (CONF_DIR / "posthoc").glob("*.yaml")}
    for name in (name for rows in PUBLISHED.values() for name in rows):
        base, _, posthoc = name.partition("+")
        assert base in methods and (not posthoc or posthoc in posteriors), name


def test_a_run_without_nll_or_ece_leaves_those_cells_empty(tmp_path):
    """A run on a published backbone that recorded its error alone: '–' for NLL and ECE, no crash."""
    folder = write_run(
        tmp_path / "runs" / "det",
        {"_target_": "dbsn.methods.MAP", "learn_structure": False, "net": WRN},
        "dbsn.data.CIFAR10DataModule",
        1,
        0.04,
    )
    record = json.loads((folder / "metrics.json").read_text())
    record["metrics"] = {"test/error": 0.04}
    (folder / "metrics.json").write_text(json.dumps(record))
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    with (report.out / "published.csv").open() as f:
        row = next(csv.DictReader(f))
    assert float(row["accuracy (%)"]) == pytest.approx(96.0) and row["NLL"] == "" and row["ECE"] == ""
