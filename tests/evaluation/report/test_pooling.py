"""Which runs a row of the report pools (dbsn.evaluation.report.pooling), on hand-made runs: only
runs that differ in their seed alone; runs of another setting get rows of their own, named by what
differs, in every table; repeats are not seeds; the report says which runs each row pools.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import torch

from dbsn.evaluation.report import build_report
from dbsn.evaluation.statistics import PREDICTIONS_FILE
from tests.support.fakeruns import DATA, MODELS, write_yaml


def config(seed: int, **changes) -> dict:
    """A resolved config with the keys that matter here; `changes`: dotted key -> value."""
    node = {
        "model": dict(MODELS["dbsn"], prediction={"n_samples": 100, "samples_per_forward": 4}),
        "data": {"_target_": DATA["cifar10"], "root": "data", "num_workers": 2, "train_subset": None},
        "trainer": {"max_epochs": 100, "limit_test_batches": None, "enable_progress_bar": True},
        "paths": {"output_dir": f"/somewhere/{seed}"},
        "logger": {"csv": {"save_dir": f"/somewhere/{seed}"}},
        "seed": seed,
    }
    for key, value in changes.items():
        *path, last = key.split(".")
        here = node
        for part in path:
            here = here.setdefault(part, {})
        here[last] = value
    return node


def write(
    folder: Path, seed: int, error: float, n_samples: int = 100, epochs: int = 100, predictions: bool = False, **changes
) -> Path:
    write_yaml(folder / "resolved_config.yaml", config(seed, **changes))
    (folder / "metrics.json").write_text(
        json.dumps(
            {
                "metrics": {"test/error": error, "test/nll": 2 * error, "test/ece": 0.01},
                "seed": seed,
                "n_samples": n_samples,
                "epochs": epochs,
            }
        )
    )
    if predictions:  # one fixed test set of 200 examples, right on a share 1 - error of them
        targets = torch.arange(200) % 10
        right = torch.rand(200, generator=torch.Generator().manual_seed(seed)) >= error
        probs = torch.full((200, 10), 0.02, dtype=torch.float64)
        probs[torch.arange(200), torch.where(right, targets, (targets + 1) % 10)] = 0.82
        np.savez(folder / PREDICTIONS_FILE, log_probs=probs.log().numpy(), targets=targets.numpy())
    return folder


def rows_of(path: Path) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell (intervals dropped)."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [re.sub(r" \[[-0-9., ]+\][§¶]?", "", c.strip()) for c in line.split("|")[1:-1]]
        if cells and cells[0] not in ("method", "row") and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    return rows


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_only_runs_that_differ_in_their_seed_are_pooled(tmp_path):
    runs = tmp_path / "runs"
    for seed, error in ((1, 0.05), (2, 0.06), (3, 0.07)):  # three seeds; where each wrote its files does not matter
        write(
            runs / f"seed{seed}",
            seed,
            error,
            predictions=True,
            **{"data.num_workers": seed, "data.root": f"/d{seed}", "trainer.enable_progress_bar": seed == 1},
        )
    write(runs / "short", 1, 0.30, epochs=3, predictions=True, **{"trainer.max_epochs": 3})
    write(runs / "small_test", 2, 0.50, n_samples=10, **{"trainer.limit_test_batches": 1})
    report = build_report([runs], tmp_path / "report")

    table = rows_of(tmp_path / "report" / "table1_error.md")
    assert table["dbsn"] == ["6.00 ± 1.00 (3)"]  # the three seeds alone
    assert table["dbsn (trainer.max_epochs=3)"] == ["30.00 (1)"]  # epochs trained follow from max_epochs: not named
    assert table["dbsn (trainer.limit_test_batches=1, S=10)"] == ["50.00 (1)"]
    assert list(table) == ["dbsn", "dbsn (trainer.limit_test_batches=1, S=10)", "dbsn (trainer.max_epochs=3)"]
    assert "dbsn (trainer.max_epochs=3)" in rows_of(tmp_path / "report" / "table_nll.md")
    # the paired differences take the other setting as a method of its own, against the main row
    paired = read_csv(tmp_path / "report" / "paired.csv")
    assert {r["method"] for r in paired} == {"dbsn (trainer.max_epochs=3)"}
    # the report says which runs each row pools
    pooled = {(r["row"], r["seed"]): r for r in read_csv(tmp_path / "report" / "rows.csv")}
    assert {seed for row, seed in pooled if row == "dbsn"} == {"1", "2", "3"}
    assert pooled["dbsn (trainer.max_epochs=3)", "1"]["path"].endswith("short")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Rows and the runs they pool" in text and "| dbsn | cifar10 | 3 | 1, 2, 3 | – |" in text
    listed = {r["path"].rsplit("/", 1)[-1]: r for r in read_csv(tmp_path / "report" / "runs.csv")}
    assert listed["short"]["method"] == "dbsn" and listed["short"]["row"] == "dbsn (trainer.max_epochs=3)"
    assert len(report.with_status("ok")) == 5


def test_seven_runs_of_one_seed_and_seven_settings_are_seven_rows(tmp_path):
    """The case found: seven DBSN runs, all seed 0, with different epochs, subsets and S, were one
    cell "82.37 ± 6.40 (7)" labelled over seeds."""
    settings = [
        {},
        {"trainer.max_epochs": 3},
        {"trainer.max_epochs": 10},
        {"data.train_subset": 500},
        {"trainer.limit_test_batches": 1},
        {"trainer.limit_test_batches": 1, "trainer.max_epochs": 3},
        {"model.prediction.n_samples": 10},
    ]
    for i, changes in enumerate(settings):
        write(
            tmp_path / "runs" / str(i),
            0,
            0.1 + 0.1 * i,
            n_samples=changes.get("model.prediction.n_samples", 100),
            **changes,
        )
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    table = rows_of(tmp_path / "report" / "table1_error.md")
    assert all(cell[0].endswith("(1)") for cell in table.values()), table
    # no setting has more runs than another: rows are named by what differs from each key's most common value
    assert list(table) == [
        "dbsn",
        "dbsn (S=10)",
        "dbsn (data.train_subset=500)",
        "dbsn (trainer.limit_test_batches=1)",
        "dbsn (trainer.limit_test_batches=1, trainer.max_epochs=3)",
        "dbsn (trainer.max_epochs=10)",
        "dbsn (trainer.max_epochs=3)",
    ]
    assert table["dbsn"] == ["10.00 (1)"] and table["dbsn (S=10)"] == ["70.00 (1)"]
    assert any("no setting has more of its runs than every other" in w for w in report.warnings)


def test_without_a_row_of_the_reference_the_report_says_how_to_choose_one(tmp_path):
    write(tmp_path / "runs" / "a", 0, 0.1, **{"trainer.max_epochs": 3})
    write(tmp_path / "runs" / "b", 0, 0.2, **{"trainer.max_epochs": 10})
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    assert set(rows_of(tmp_path / "report" / "table1_error.md")) == {
        "dbsn (trainer.max_epochs=3)",
        "dbsn (trainer.max_epochs=10)",
    }
    assert any("no row is dbsn" in w and "--reference" in w for w in report.warnings)


def test_two_runs_of_one_setting_and_seed_are_a_repeat_not_two_seeds(tmp_path):
    import os

    first = write(tmp_path / "runs" / "a", 1, 0.05)
    write(tmp_path / "runs" / "b", 1, 0.07)
    write(tmp_path / "runs" / "c", 2, 0.09)
    os.utime(first / "metrics.json", (1, 1))  # a is the older of the two seed-1 runs
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    assert rows_of(tmp_path / "report" / "table1_error.md")["dbsn"] == ["8.00 ± 1.41 (2)"]  # b and c: two seeds
    repeats = report.with_status("repeat")
    assert [r.path.name for r in repeats] == ["a"] and "a repeat of" in repeats[0].note
    text = (tmp_path / "report" / "report.md").read_text()
    assert "repeats, not seeds" in text and "**repeat**" in text


def test_a_posthoc_run_is_in_the_row_of_its_training_run(tmp_path):
    """A calibrator evaluated on the short run is that run's column, not the main row's."""
    for seed in (1, 2):
        write(tmp_path / "runs" / str(seed), seed, 0.05)
    short = write(tmp_path / "runs" / "short", 1, 0.30, epochs=3, **{"trainer.max_epochs": 3})
    posthoc = short / "posthoc" / "temperature"
    write_yaml(posthoc / "resolved_config.yaml", {**config(1, **{"trainer.max_epochs": 3}), "posthoc": "temperature"})
    (posthoc / "metrics.json").write_text(
        json.dumps(
            {
                "metrics": {"test/error": 0.3, "test/nll": 0.4, "test/ece": 0.02},
                "seed": 1,
                "n_samples": 100,
                "posthoc": "temperature",
                "calibrator": "temperature",
                "settings": {},
            }
        )
    )
    build_report([tmp_path / "runs"], tmp_path / "report")
    calibrators = (tmp_path / "report" / "calibrators.md").read_text()
    assert "| dbsn (trainer.max_epochs=3) | 0.6000 (1) | 0.4000 (1) |" in calibrators  # NLL: before, after
    assert "| dbsn |" not in calibrators
