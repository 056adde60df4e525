"""Every row of the report carries its budget (dbsn.evaluation.report.sections.budget): the hand-made
sweep of `tests.support.fakeruns` with budgets written into its metrics.json, and field rows made by
hand (the shared and the authors' recipe, DDU's held-out split, cSGHMC's temperature, a post-hoc
posterior's run)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import yaml

from dbsn.evaluation.report import build_report
from tests.support.fakeruns import job_dir, write_yaml

C10 = "dbsn.data.CIFAR10DataModule"
RESNET18 = {"_target_": "dbsn.nets.ResNet18"}
SHARED = {
    "recipe": "shared",
    "backbone": "resnet18",
    "epochs": {"structure_net": 100, "resnet18": 200, "wrn28_10": 200},
}


def _rows(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    """A markdown table's rows by (first cell, second cell), each a {column: cell}."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    return {(row[header[0]], row[header[1]]): row for row in rows}


def _add_budget(folder: Path, steps: int, batch: int = 64, train_images: int = 50_000) -> None:
    record = json.loads((folder / "metrics.json").read_text())
    record["budget"] = {"steps": steps, "images": steps * batch, "train_images": train_images, "batch_size": batch}
    (folder / "metrics.json").write_text(json.dumps(record))


def test_every_row_of_every_table_has_a_budget_row_with_its_steps(outputs, tmp_path):
    for model in ("dbsn", "map"):
        for data in ("cifar10", "cifar100"):
            for seed in (1, 2, 3):
                folder = job_dir(outputs, model, data, seed)
                if (folder / "metrics.json").is_file():  # 100 epochs of 781 batches of 64
                    _add_budget(folder, 78_000 if (model, data, seed) == ("map", "cifar100", 2) else 78_100)
    build_report([outputs], tmp_path / "report")
    budgets = _rows(tmp_path / "report" / "budget.md")
    # every (row, dataset) of the main table has its budget row (the fbn run, of an older version, records none)
    with (tmp_path / "report" / "table1_error.csv").open() as f:
        cells = {(r["method"], r["dataset"]) for r in csv.DictReader(f)}
    assert (
        cells
        == set(budgets)
        == {("dbsn", "cifar10"), ("dbsn", "cifar100"), ("map", "cifar10"), ("map", "cifar100"), ("fbn", "cifar10")}
    )
    dbsn = budgets["dbsn", "cifar10"]
    assert (dbsn["epochs"], dbsn["steps"], dbsn["images seen"], dbsn["training images"]) == (
        "100",
        "78,100",
        "5.00 M",
        "50,000",
    )
    assert dbsn["time"] == "10.0–30.0 min" and dbsn["recipe"] == dbsn["notes"] == "–"  # 600 s × seed 1..3
    assert budgets["map", "cifar100"]["steps"] == "78,000–78,100"  # a pooled row shows its runs' range
    assert budgets["map", "cifar10"]["time"] == "0.3–1.0 h"  # 1,200 and 3,600 s (seeds 1 and 3): in hours
    fbn = budgets["fbn", "cifar10"]
    assert (fbn["epochs"], fbn["steps"], fbn["images seen"], fbn["time"]) == ("100", "–", "–", "–")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Training budgets" in report and "row of \"Training budgets\" (`budget.md`)" in report
    with (tmp_path / "report" / "budget.csv").open() as f:
        by_row = {(r["row"], r["dataset"]): r for r in csv.DictReader(f)}
    assert (by_row["map", "cifar100"]["steps_min"], by_row["map", "cifar100"]["steps_max"]) == ("78000", "78100")
    assert by_row["dbsn", "cifar10"]["images_max"] == str(78_100 * 64) and by_row["fbn", "cifar10"]["steps_min"] == ""


def _run(root: Path, name: str, seed: int, model: dict, data: dict, budget: dict | None, record: dict) -> Path:
    folder = root / f"{name}_{seed}"
    write_yaml(
        folder / "resolved_config.yaml",
        {"model": model, "data": {"_target_": C10, **data}, "seed": seed, **({"budget": budget} if budget else {})},
    )
    metrics = {"test/error": 0.05 + 0.01 * seed, "test/nll": 0.2, "test/ece": 0.01}
    (folder / "metrics.json").write_text(json.dumps({"metrics": metrics, "seed": seed, "n_samples": 1, **record}))
    return folder


def _trained(epochs: int, batches: int, batch: int, train_images: int = 50_000, seconds: float = 3000.0) -> dict:
    return {
        "epochs": epochs,
        "train_seconds": seconds,
        "budget": {
            "steps": epochs * batches,
            "images": epochs * batches * batch,
            "train_images": train_images,
            "batch_size": batch,
        },
    }


def test_field_rows_say_their_recipe_held_out_split_and_temperature(tmp_path):
    runs = tmp_path / "runs"
    deterministic = {"_target_": "dbsn.methods.MAP", "net": RESNET18, "learn_structure": False}
    for seed in (1, 2):
        authors = _run(
            runs,
            "map_authors",
            seed,
            deterministic,
            {},
            {"recipe": "authors", "backbone": "resnet18"},
            _trained(75, 390, 128),
        )
        _run(runs, "map_shared", seed, deterministic, {}, SHARED, _trained(200, 390, 128, seconds=8000.0))
        _run(
            runs,
            "ddu",
            seed,
            {"_target_": "dbsn.methods.DDU", "net": RESNET18},
            {"val_size": 5000},
            SHARED,
            _trained(200, 351, 128, train_images=45_000, seconds=7200.0),
        )
        _run(
            runs,
            "csghmc",
            seed,
            {"_target_": "dbsn.methods.CSGMCMC", "net": RESNET18},
            {},
            SHARED,
            {
                **_trained(200, 781, 64, seconds=9000.0),
                "sampler_temperature": 1 / 50_000,
                "sampler_noise_std_max": 2.97e-6,
            },
        )
        # a post-hoc posterior of the authors' run: its metrics.json is an evaluation's, without a budget
        write_yaml(
            authors / "posthoc" / "laplace" / "resolved_config.yaml",
            {**yaml.safe_load((authors / "resolved_config.yaml").read_text()), "posthoc": "laplace"},
        )
        (authors / "posthoc" / "laplace" / "metrics.json").write_text(
            json.dumps(
                {"metrics": {"test/error": 0.06, "test/nll": 0.19, "test/ece": 0.01}, "seed": seed, "n_samples": 1}
            )
        )
    build_report([runs], tmp_path / "report")
    budgets = _rows(tmp_path / "report" / "budget.md")
    authors = budgets["map_fixed@resnet18 (budget.recipe=authors, epochs=75)", "cifar10"]
    shared = budgets["map_fixed@resnet18 (budget.recipe=shared, epochs=200)", "cifar10"]  # the row's name says it too
    assert (authors["recipe"], authors["epochs"], authors["steps"], authors["images seen"]) == (
        "authors",
        "75",
        "29,250",
        "3.74 M",
    )
    assert (shared["recipe"], shared["epochs"], shared["steps"], shared["time"]) == ("shared", "200", "78,000", "2.2 h")
    ddu = budgets["ddu@resnet18", "cifar10"]
    assert ddu["training images"] == "45,000" and ddu["steps"] == "70,200"
    assert ddu["notes"] == "validation split of 5,000 held out (trains on 45,000)"
    csghmc = budgets["csghmc@resnet18", "cifar10"]
    assert csghmc["steps"] == "156,200" and csghmc["epochs"] == "200"  # batch 64: twice the steps at the same epochs
    assert csghmc["notes"] == "temperature T = 2e-05 = 1/N (N = 50,000), noise sd at most 3.0e-06 a step"
    posthoc = next(row for (name, _), row in budgets.items() if name.startswith("map_fixed@resnet18+laplace"))
    assert (posthoc["epochs"], posthoc["steps"]) == ("75", "29,250") and "post-hoc posterior" in posthoc["notes"]
    text = (tmp_path / "report" / "budget.md").read_text()
    assert "ran the authors' recipes of the field's sweeps (`budget=authors`" in text
    assert (
        "3 row(s) the shared budget (`budget=shared`: every method on a backbone the same epochs: resnet18 200"
    ) in text
