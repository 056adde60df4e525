"""The report's tables (dbsn.evaluation.report): hand-made run folders (`tests.support.fakeruns`,
the `outputs` fixture) gathered into tables whose numbers are checked by hand.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from dbsn.evaluation.report import build_report
from tests.support.fakeruns import job_dir, write_csv


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def without_intervals(text: str) -> str:
    """The table text without its cells' [low, high] intervals and their marks (checked by hand in table 1)."""
    return re.sub(r" \[[-0-9., ]+\][§¶]?", "", text)


def test_table1_means_by_hand_and_fbn_inferred(outputs, tmp_path):
    report = build_report([outputs], tmp_path / "report")
    table = (tmp_path / "report" / "table1_error.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[4:]}
    assert table.splitlines()[2].startswith("| method | cifar10 | cifar100 |")
    assert list(rows) == ["dbsn", "fbn", "map"]  # canonical order
    # mean ± std [mean ± t(0.975, n - 1) std / sqrt(n)] (n): t(0.975, 2) = 4.303, t(0.975, 1) = 12.71; these runs
    # keep neither predictions nor intervals, so the interval is over the seeds alone, marked ¶
    assert rows["dbsn"] == ["6.00 ± 1.00 [3.52, 8.48]¶ (3)", "22.00 ± 2.00 [17.03, 26.97]¶ (3)"]
    assert rows["map"] == [
        "9.00 ± 1.41 [0.00, 21.71]¶ (2)",
        "30.50 ± 0.71 [24.15, 36.85]¶ (2)",
    ]  # failed seed 2 out; an error stops at 0
    assert rows["fbn"] == ["4.00 (1)", "–"]  # no std from one run, and this run has no bootstrap interval
    by_cell = {(r["method"], r["dataset"]): r for r in read_csv(tmp_path / "report" / "table1_error.csv")}
    assert float(by_cell["dbsn", "cifar10"]["mean"]) == pytest.approx(6.0)
    assert float(by_cell["dbsn", "cifar10"]["std"]) == pytest.approx(1.0)
    assert by_cell["dbsn", "cifar10"]["n"] == "3" and by_cell["fbn", "cifar10"]["std"] == ""
    assert by_cell["dbsn", "cifar10"]["interval"] == "seeds only" and by_cell["fbn", "cifar10"]["interval"] == ""
    ece = without_intervals((tmp_path / "report" / "table2_ece.md").read_text())
    assert "| dbsn | 0.0120 ± 0.0020 (3) | 0.0120 ± 0.0020 (3) |" in ece
    assert "| map | 0.0120 ± 0.0028 (2) |" in ece  # seeds 1 and 3
    assert "| dbsn | 0.6000 ± 0.1000 (3) |" in without_intervals((tmp_path / "report" / "table_nll.md").read_text())
    assert len(report.with_status("ok")) == 11


def test_failed_and_missing_runs_are_listed(outputs, tmp_path):
    report = build_report([outputs], tmp_path / "report")
    failed, missing = report.with_status("failed"), report.with_status("missing")
    assert [(r.method, r.dataset, r.seed) for r in failed] == [("map", "cifar10", 2)]
    assert failed[0].path == job_dir(outputs, "map", "cifar10", 2).resolve()
    assert [(r.method, r.dataset, r.seed) for r in missing] == [("map", "cifar100", "3")]
    assert missing[0].overrides == ["model=map", "seed=3", "data=cifar100", "trainer=cpu"]

    text = (tmp_path / "report" / "report.md").read_text()
    excluded = section(text, "## Runs not included")
    assert str(failed[0].path) in excluded and "**failed**" in excluded
    assert "**missing**" in excluded and "model=map seed=3 data=cifar100 trainer=cpu" in excluded
    statuses = {(r["method"], r["dataset"], r["seed"]): r["status"] for r in read_csv(tmp_path / "report" / "runs.csv")}
    assert len(statuses) == 13 and statuses["map", "cifar10", "2"] == "failed"
    assert statuses["map", "cifar100", "3"] == "missing" and statuses["fbn", "cifar10", "7"] == "ok"


def test_training_time_table_and_ratio_to_dbsn_by_hand(outputs, tmp_path):
    build_report([outputs], tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    table = without_intervals(section(text, "## Training time"))
    # dbsn cifar10: seeds 1-3 -> 10, 20, 30 min; map cifar10: seeds 1, 3 (2 failed) -> 20, 60 min
    assert "| dbsn | cifar10 | 20.0 ± 10.0 (3) | 100 | 1.00 |" in table
    assert "| map | cifar10 | 40.0 ± 28.3 (2) | 100 | 2.00 |" in table
    assert "| map | cifar100 | 30.0 ± 14.1 (2) | 100 | 1.50 |" in table  # seeds 1, 2 over dbsn's 20
    assert "fbn" not in table  # its metrics.json has no train_seconds
    rows = {(r["method"], r["dataset"]): r for r in read_csv(tmp_path / "report" / "time.csv")}
    assert float(rows["map", "cifar10"]["ratio_to_dbsn"]) == pytest.approx(2.0)
    assert float(rows["map", "cifar10"]["std_minutes"]) == pytest.approx(np.std([20, 60], ddof=1))
    runs = {(r["method"], r["dataset"], r["seed"]): r for r in read_csv(tmp_path / "report" / "runs.csv")}
    assert float(runs["dbsn", "cifar100", "2"]["train_seconds"]) == 1200.0


def test_evaluation_summaries_and_figures(outputs, tmp_path):
    def write_ood(folder, ood_set, auroc, seed):
        folder.mkdir(parents=True)
        scores = {
            name: {"auroc": auroc, "aupr": auroc - 0.1, "aupr_in": 0.5, "fpr95": 1 - auroc}
            for name in ("entropy", "mutual_information", "max_probability")
        }
        (folder / "metrics.json").write_text(
            json.dumps({"in_distribution": "cifar10", "ood": ood_set, "n_samples": 100, "scores": scores})
        )
        rng = np.random.default_rng(seed)
        np.savez(
            folder / "scores.npz",
            **{
                f"{side}_{name}": rng.uniform(0, 2.3, 50)
                for side in ("in", "out")
                for name in ("entropy", "mutual_information", "max_probability")
            },
        )

    # dbsn: evaluated with ood=[svhn,cifar100] (a folder per set); map: one set, in the layout of
    # an older version (evaluation/ood/metrics.json)
    for seed, auroc in ((1, 0.90), (2, 0.92)):
        evaluation = job_dir(outputs, "dbsn", "cifar10", seed) / "evaluation" / "ood"
        write_ood(evaluation / "svhn", "svhn", auroc, seed)
        write_ood(evaluation / "cifar100", "cifar100", auroc - 0.2, seed)
    write_ood(job_dir(outputs, "map", "cifar10", 1) / "evaluation" / "ood", "svhn", 0.80, 1)
    # a stale single-set file beside the per-set folders (re-evaluated run) is not counted again
    (job_dir(outputs, "dbsn", "cifar10", 1) / "evaluation" / "ood" / "metrics.json").write_text(
        (job_dir(outputs, "dbsn", "cifar10", 1) / "evaluation" / "ood" / "svhn" / "metrics.json")
        .read_text()
        .replace("0.9,", "0.1,")
    )
    for seed, (clean, attacked, entropy) in {1: (0.9, 0.3, 1.0), 2: (0.92, 0.5, 1.2)}.items():
        write_csv(
            job_dir(outputs, "dbsn", "cifar10", seed) / "evaluation" / "adversarial" / "results.csv",
            ["attack", "epsilon", "accuracy", "mean_entropy", "n_examples"],
            [
                ["fgsm", 0.0, clean, 0.2, 1000],
                ["fgsm", 0.1, attacked, entropy, 1000],
                ["bim", 0.0, clean, 0.2, 1000],
                ["bim", 0.1, attacked / 2, entropy, 1000],
            ],
        )
        write_csv(
            job_dir(outputs, "dbsn", "cifar10", seed) / "evaluation" / "ablation" / "results.csv",
            ["n_samples", "error", "nll", "brier", "ece"],
            [
                [1, 0.08 + 0.02 * (seed - 1), 0.3, 0.1, 0.03],
                [3, 0.07, 0.25, 0.1, 0.02],
                [10, 0.06 + 0.01 * (seed - 1), 0.2, 0.1, 0.02],
                [100, 0.05 + 0.01 * (seed - 1), 0.18, 0.1, 0.01],
            ],
        )

    out = tmp_path / "report"
    build_report([outputs], out)
    text = (out / "report.md").read_text()

    ood_md = without_intervals(section(text, "## Out-of-distribution detection"))
    assert "| dbsn | entropy | 0.9100 ± 0.0141 (2) | 0.8100 ± 0.0141 (2) | 0.0900 ± 0.0141 (2) |" in ood_md
    assert "| map | entropy | 0.8000 (1) |" in ood_md
    assert ood_md.index("| dbsn | entropy") < ood_md.index("| dbsn | mutual_information")
    assert (out / "ood_entropy_cdf_cifar10_svhn.png").stat().st_size > 0
    assert "(ood_entropy_cdf_cifar10_svhn.png)" in ood_md
    # one table and one figure per OOD set
    near = ood_md.split("### cifar10 (in-distribution) vs cifar100 (OOD)", 1)[1].split("###", 1)[0]
    assert "| dbsn | entropy | 0.7100 ± 0.0141 (2) |" in near and "| map |" not in near
    assert (out / "ood_entropy_cdf_cifar10_cifar100.png").stat().st_size > 0
    rows = read_csv(out / "ood.csv")
    auroc = next(
        r for r in rows if (r["method"], r["ood"], r["score"], r["metric"]) == ("dbsn", "svhn", "entropy", "auroc")
    )
    assert float(auroc["mean"]) == pytest.approx(0.91) and auroc["n"] == "2"

    adversarial = without_intervals(section(text, "## Adversarial robustness"))
    assert "| method | attack | ε=0 | ε=0.1 |" in adversarial
    assert "| dbsn | fgsm | 0.9100 ± 0.0141 (2) | 0.4000 ± 0.1414 (2) |" in adversarial
    assert "| dbsn | bim | 0.9100 ± 0.0141 (2) | 0.2000 ± 0.0707 (2) |" in adversarial
    assert "| dbsn | fgsm | 0.2000 ± 0.0000 (2) | 1.1000 ± 0.1414 (2) |" in adversarial  # entropy table
    assert (out / "adversarial_cifar10.png").stat().st_size > 0 and "(adversarial_cifar10.png)" in adversarial
    fgsm = {float(r["epsilon"]): r for r in read_csv(out / "adversarial.csv") if r["attack"] == "fgsm"}
    assert float(fgsm[0.1]["accuracy"]) == pytest.approx(0.4) and float(fgsm[0.1]["mean_entropy"]) == pytest.approx(1.1)

    ablation = section(text, "## Number of Monte Carlo samples S")
    assert "| method | dataset | error % S=1 | error % S=10 | error % S=100 | NLL S=1 |" in ablation
    assert (
        "| dbsn | cifar10 | 9.00 | 6.50 | 5.50 | 0.3000 | 0.2000 | 0.1800 | 0.0300 | 0.0200 | 0.0100 | 2 |" in ablation
    )
    assert {r["n_samples"] for r in read_csv(out / "ablation.csv")} == {"1", "3", "10", "100"}
    for name in ("ood.md", "adversarial.md", "ablation.md", "ood.csv", "adversarial.csv", "ablation.csv"):
        assert (out / name).is_file()


def test_no_evaluation_sections_without_evaluation_files(outputs, tmp_path):
    build_report([outputs], tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Table 1" in text and "Out-of-distribution" not in text and "Adversarial" not in text
    assert not (tmp_path / "report" / "ood.md").exists()
