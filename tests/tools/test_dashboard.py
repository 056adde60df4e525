"""W&B end to end, offline: a digits sweep through train.py -m with logger=wandb, its evaluation
through evaluate.py (two OOD sets as near and far, a generated shift set, attacks) and a CamVid
training, read back from the runs' own record files (`tests.support.wandb_records`); then the
dashboard's specification (dbsn.tools.dashboard) is checked against what those runs logged: a
panel that names a metric no run logs fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb_workspaces import expr

from dbsn import CONF_DIR
from dbsn.evaluation.tracking import EPOCH, summary_key, summary_of
from dbsn.tools.dashboard import Panel, Section, build_report, panel_specs, runsets, sections
from tests.support.configs import ROOT, TINY, tiny_for
from tests.support.fakedata import write_camvid
from tests.support.scripts import run_python
from tests.support.wandb_records import config, history, logged_values, metric_definitions, run_record, summary, table

pytestmark = pytest.mark.slow


OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
DIGITS = [
    "experiment=quick",
    *TINY,
    "trainer.max_epochs=2",
    "data.train_subset=256",
    "data.val_size=64",
    "logger=wandb",
    "callbacks.structure_posterior.n_samples=10",
]
OOD_SETS = ("photos", "noise")


def _run_file(folder: Path) -> Path:
    files = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """{'sweep': folder, 'train': [run files], 'evaluate': [run files], 'camvid': run file}"""
    tmp = tmp_path_factory.mktemp("wandb")
    sweep = tmp / "sweep"
    run_python(ROOT / "train.py", "-m", *DIGITS, "seed=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp, env=OFFLINE)
    run_python(
        ROOT / "evaluate.py",
        f"ckpt_path={sweep}",
        "logger=wandb",
        "evaluations=[ood,adversarial,shift,conformal]",
        f"ood=[{','.join(OOD_SETS)}]",
        "ood.photos.size=64",
        "ood.noise.size=32",
        "n_samples=3",
        "evaluations.ood.fit_images=128",
        "evaluations.ood.members=2",
        "evaluations.ood.groups={near:[photos],far:[noise]}",
        f"evaluations.shift.root={tmp / 'digits-C'}",
        "evaluations.shift.generate=true",
        "evaluations.shift.corruptions=[contrast]",
        "evaluations.adversarial.epsilons=[0.0,0.05]",
        "evaluations.adversarial.attack_samples=2",
        "evaluations.adversarial.eval_samples=2",
        "evaluations.adversarial.max_examples=20",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp / 'eval'}",
        cwd=tmp,
        env=OFFLINE,
    )
    # a deep ensemble of finished runs (point-structure members: map_fixed; one run twice keeps it short)
    run_python(
        ROOT / "train.py",
        "model=map_fixed",
        "data=digits",
        "data.train_subset=256",
        *tiny_for("map_fixed"),
        "trainer.max_epochs=1",
        "model.prediction.n_samples=1",
        "logger=wandb",
        "callbacks=swag",
        "callbacks.swag.start=0",
        "callbacks.swag.collect=step",
        f"hydra.run.dir={tmp / 'map'}",
        cwd=tmp,
        env=OFFLINE,
    )
    member = str(tmp / "map" / "checkpoints" / "last.ckpt")
    # its post-hoc SWAG posterior, a method of its own
    run_python(
        ROOT / "evaluate.py",
        f"ckpt_path={member}",
        "posthoc=swag",
        "n_samples=2",
        "logger=wandb",
        "ablation.sizes=[]",
        "trainer.enable_progress_bar=false",
        cwd=tmp,
        env=OFFLINE,
    )
    run_python(
        ROOT / "evaluate.py",
        f"ckpt_path=[{member},{member}]",
        "logger=wandb",
        "ablation.sizes=[]",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp / 'ensemble'}",
        cwd=tmp,
        env=OFFLINE,
    )
    camvid = tmp / "camvid"
    write_camvid(camvid, n_train=4, n_val=2, n_test=2, size=(36, 50), seed=0)
    run_python(
        ROOT / "train.py",
        "model=dbsn_seg",
        "data=camvid",
        f"data.root={camvid}",
        "data.crop_size=32",
        "data.batch_size=2",
        "data.num_workers=0",
        "data.eval_batch_size=2",
        "model.net.first_channels=8",
        "model.net.growth=4",
        "model.net.num_nodes=3",
        "model.net.num_down=2",
        "model.prediction.n_samples=2",
        "model.prediction.val_samples=2",
        "model.prediction.samples_per_forward=2",
        "trainer.max_epochs=2",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "logger=wandb",
        f"hydra.run.dir={tmp / 'seg'}",
        cwd=tmp,
        env=OFFLINE,
    )
    # the training signals of a posterior over weights (the rank-1 BNN's KL terms, an SGD of two groups) and of a
    # sampler (cSGLD's step size, noise and samples; 20 steps: its 4 cycles of 5, 3 samples and 1 noisy step each)
    signals = tmp / "signals"
    run_python(
        ROOT / "train.py",
        "-m",
        "model=rank1_bnn,csgld",
        "model/net=resnet18",
        "model.net.width=8",
        "data=digits",
        "data.train_subset=160",
        "data.batch_size=8",
        "trainer.max_epochs=1",
        "trainer.accelerator=cpu",
        "trainer.log_every_n_steps=1",
        "trainer.limit_test_batches=1",
        "trainer.enable_progress_bar=false",
        "statistics.resamples=20",
        "logger=wandb",
        f"hydra.sweep.dir={signals}",
        cwd=tmp,
        env=OFFLINE,
    )
    runs = [sweep / "0", sweep / "1"]
    return {
        "sweep": sweep,
        "runs": runs,
        "train": [_run_file(r) for r in runs],
        "signals": [_run_file(signals / "0"), _run_file(signals / "1")],
        "signals_dir": signals,
        "evaluate": [_run_file(r / "evaluation") for r in runs],
        "camvid": _run_file(tmp / "seg"),
        "ensemble": tmp / "ensemble",
        "map": _run_file(tmp / "map"),
        "posthoc": _run_file(tmp / "map" / "posthoc" / "swag" / "evaluation"),
    }


def test_a_sweeps_runs_share_its_group_and_say_method_seed_and_job_type(logged):
    sweep = logged["sweep"]
    for seed, run_dir, path in zip((1, 2), logged["runs"], logged["train"]):
        run = run_record(path)
        assert run.run_group == f"quick {sweep.name}"  # <task_name> <sweep folder>
        assert run.job_type == "train" and run.display_name == f"dbsn digits seed={seed}"
        assert run.run_id == (run_dir / "wandb_id").read_text().strip()
        facts = config(path)
        assert {k: facts[k] for k in ("method", "dataset", "seed", "T", "S", "job_type", "sweep")} == {
            "method": "dbsn",
            "dataset": "digits",
            "seed": seed,
            "T": 2,
            "S": 4,
            "job_type": "train",
            "sweep": f"quick {sweep.name}",
        }
        assert facts["model"]["prediction"]["n_samples"] == 4  # the whole resolved config too


def test_summaries_are_best_values_and_per_epoch_metrics_use_the_epoch(logged):
    path = logged["train"][0]
    defined = metric_definitions(path)
    assert defined["val/error"].step_metric == "epoch" and defined["val/error"].summary.min
    assert defined["val/ece"].summary.min and defined["test/nll"].summary.min
    assert defined["structure/edge_entropy_mean"].step_metric == "epoch"
    assert not defined["structure/edge_entropy_mean"].summary.min  # no best value: W&B keeps the last
    rows = history(path)
    val_errors = [row["val/error"] for row in rows if "val/error" in row]
    assert len(val_errors) == 2 and all(row["epoch"] in (0, 1) for row in rows if "val/error" in row)
    assert summary(path)["val/error"] == {"min": min(val_errors)}  # the summary is the best epoch, not the last
    metrics = json.loads((logged["runs"][0] / "metrics.json").read_text())["metrics"]
    assert summary(path)["test/ece"]["min"] == pytest.approx(metrics["test/ece"], rel=1e-6)


def test_figures_go_in_as_tables_too(logged):
    path = logged["train"][0]
    bins = table(path, "test/reliability_bins")
    assert bins["columns"] == ["lower", "upper", "confidence", "accuracy", "count"]
    assert sum(row[4] for row in bins["data"]) == 450  # every digits test image in one bin
    assert all(row[0] <= row[2] <= row[1] for row in bins["data"])  # mean confidence inside its bin
    ablation = table(path, "test/sample_ablation_table")
    assert ablation["columns"][:2] == ["n_samples", "error"] and [r[0] for r in ablation["data"]] == [1, 2, 3, 4]
    # the ablation as a curve against its own x axis
    defined = metric_definitions(path)
    assert defined["ablation/error"].step_metric == "ablation/n_samples"
    assert [row["ablation/n_samples"] for row in history(path) if "ablation/error" in row] == [1, 2, 3, 4]
    per_class = table(logged["camvid"], "test/per_class_iou")
    assert per_class["columns"] == ["class", "iou"] and len(per_class["data"]) == 11


def test_the_field_benchmarks_numbers_reach_wandb_as_their_best_values(logged):
    """Equal-mass / classwise ECE and selective prediction from the training run's test pass,
    near / far OOD means and dataset shift from the evaluation: W&B's summaries equal the run's
    own metrics files, and the risk-coverage and shift tables are there with their columns."""
    for run_dir, train_path, path in zip(logged["runs"], logged["train"], logged["evaluate"]):
        metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
        stored = summary(train_path)
        for key in (
            "test/adaptive_ece",
            "test/classwise_ece",
            "selective/max_probability/aurc",
            "selective/mutual_information/eaurc",
            "selective/predictive_entropy/risk@80",
        ):
            assert stored[key] == {"min": pytest.approx(metrics[key], rel=1e-6)}, key
        curve = table(train_path, "selective/risk_coverage_curve")
        assert curve["columns"] == ["score", "coverage", "risk"]
        assert {row[0] for row in curve["data"]} >= {"max_probability", "mutual_information"}
        assert all(0.0 < row[1] <= 1.0 and 0.0 <= row[2] <= 1.0 for row in curve["data"])
        stored = summary(path)
        groups = json.loads((run_dir / "evaluation" / "ood" / "groups.json").read_text())
        assert groups["groups"] == {"near": ["photos"], "far": ["noise"]}
        for key in (
            "ood/near/entropy/auroc",
            "ood/far/mutual_information/auroc",
            "ood/near/knn/auroc",
            "ood/far/energy_members/fpr95",
        ):
            best = "min" if key.endswith("fpr95") else "max"
            assert stored[key] == {best: pytest.approx(groups["metrics"][key], rel=1e-6)}, key
        conformal = json.loads((run_dir / "evaluation" / "conformal" / "metrics.json").read_text())["metrics"]
        for key in (
            "conformal/90/aps/coverage",
            "conformal/95/raps_randomized/size",
            "conformal/90/thr/shift/3/coverage",
        ):
            assert stored[key] == pytest.approx(conformal[key], rel=1e-6), key  # no best value: the last
        shift = json.loads((run_dir / "evaluation" / "shift" / "metrics.json").read_text())
        assert shift["generated"] and stored["shift/generated"] == 1.0
        for key in ("shift/mean/error", "shift/mean/3/ece", "shift/contrast/5/nll"):
            assert stored[key] == {"min": pytest.approx(shift["metrics"][key], rel=1e-6)}, key
        rows = table(path, "shift/table")
        assert rows["columns"] == ["corruption", "severity", "error", "nll", "brier", "ece"]
        assert [(r[0], r[1]) for r in rows["data"]] == [("contrast", s) for s in (1, 2, 3, 4, 5)]


def test_a_post_hoc_evaluation_is_a_method_of_its_own_on_wandb(logged):
    """`evaluate.py posthoc=swag` on a map_fixed run: its W&B run is method map_fixed+swag (so the dashboard,
    grouping by method, does not average it into map_fixed), linked to the training run, in its group."""
    train, run = run_record(logged["map"]), run_record(logged["posthoc"])
    facts = config(logged["posthoc"])
    assert {k: facts[k] for k in ("method", "posthoc", "base_method", "job_type")} == {
        "method": "map_fixed+swag",
        "posthoc": "swag",
        "base_method": "map_fixed",
        "job_type": "evaluate",
    }
    assert facts["train_run_id"] == train.run_id and run.run_group == train.run_group
    assert run.display_name.startswith("map_fixed+swag digits") and run.job_type == "evaluate"
    assert "test/ece" in summary(logged["posthoc"]) and "selective/max_probability/aurc" in summary(logged["posthoc"])


def test_evaluate_logs_a_linked_run_with_every_ood_set_and_attacks_against_epsilon(logged):
    for run_dir, train_path, path in zip(logged["runs"], logged["train"], logged["evaluate"]):
        train, run = run_record(train_path), run_record(path)
        assert run.run_group == train.run_group and run.job_type == "evaluate"
        assert run.display_name == train.display_name and run.run_id != train.run_id
        facts = config(path)
        assert facts["train_run_id"] == train.run_id and facts["method"] == "dbsn" and facts["S"] == 3  # as evaluated
        values = logged_values(path)
        for name in OOD_SETS:
            record = json.loads((run_dir / "evaluation" / "ood" / name / "metrics.json").read_text())
            for score, metrics in record["scores"].items():
                assert values[f"ood/{name}/{score}/auroc"] == pytest.approx(metrics["auroc"], rel=1e-6)
            cdf = table(path, f"ood/{name}/entropy_cdf_ood")
            assert cdf["columns"] == ["entropy", "cdf"] and cdf["data"][-1][1] == 1.0
            assert metric_definitions(path)[f"ood/{name}/entropy/auroc"].summary.max
        defined = metric_definitions(path)
        assert defined["adversarial/fgsm/accuracy"].step_metric == "adversarial/epsilon"
        curve = [
            (row["adversarial/epsilon"], row["adversarial/bim/accuracy"])
            for row in history(path)
            if "adversarial/bim/accuracy" in row
        ]
        results = {
            (float(r["epsilon"]), r["attack"]): r
            for r in json.loads((run_dir / "evaluation" / "adversarial" / "results.json").read_text())
        }
        assert curve == [(eps, pytest.approx(results[eps, "bim"]["accuracy"])) for eps in (0.0, 0.05)]


def test_a_deep_ensemble_of_runs_is_its_own_method_in_its_members_group(logged):
    path, member = _run_file(logged["ensemble"]), run_record(logged["map"])
    run, facts = run_record(path), config(path)
    assert member.run_group == "train map" and config(logged["map"])["method"] == "map_fixed"
    assert run.run_group == member.run_group and run.job_type == "evaluate"
    assert facts["method"] == "deep_ensemble" and facts["members"] == "2 x map_fixed"
    assert run.display_name == "deep_ensemble digits 2 x map_fixed"
    assert facts["train_run_ids"] == [member.run_id] * 2
    assert facts["S"] == json.loads((logged["ensemble"] / "metrics.json").read_text())["n_samples"] == 2


def test_the_training_section_reads_what_the_rank1_bnn_and_csgld_log_at_every_step(logged):
    """The Training section's KL panels are the rank-1 BNN run's, its sampler panels cSGLD's: at each of the 20
    steps the step size (largest at each of the 4 cycles' starts), the noise (only in each cycle's last step, its
    sampling stage) and the samples kept, counted up to the run's 12."""
    training = next(s for s in sections(OOD_SETS) if s.name == "Training")
    named = {m for panel in training.panels for m in panel.metrics}
    rank1, csgld = logged["signals"]
    assert config(rank1)["method"] == "rank1_bnn@resnet18" and config(csgld)["method"] == "csgld@resnet18"
    assert {"train/weight_kl_epoch", "train/kl_scale_epoch"} <= named & set(logged_values(rank1))
    steps = [row for row in history(csgld) if "sampler/lr" in row]
    assert {"sampler/lr", "sampler/noise_std", "sampler/samples"} <= named & set(steps[0]) and len(steps) == 20
    assert all(a["trainer/global_step"] < b["trainer/global_step"] for a, b in zip(steps, steps[1:]))
    lrs = [row["sampler/lr"] for row in steps]
    assert max(lrs) == lrs[0] == lrs[5] == lrs[10] == lrs[15] > lrs[1]
    assert [i for i, row in enumerate(steps) if row["sampler/noise_std"] > 0] == [4, 9, 14, 19]
    kept = json.loads((logged["signals_dir"] / "1" / "metrics.json").read_text())["samples_kept"]
    assert steps[-1]["sampler/samples"] == kept == 12


def _logged_reads(paths: list[Path]) -> dict[str, set]:
    """What the runs logged, in the terms of `Panel.reads`."""
    scalars, tables, images, columns, summaries = set(), set(), set(), set(), set()
    for path in paths:
        for row in history(path):
            for key, value in row.items():
                if key.endswith("/_type"):
                    (tables if value == "table-file" else images if value.startswith("images") else set()).add(
                        key.removesuffix("/_type")
                    )
                elif not key.startswith("_"):
                    scalars.add(key)
        for key in tables:
            if f"{key}/path" in logged_values(path):
                columns |= {f"{key}:{c}" for c in table(path, key)["columns"]}
        summaries |= {f"{k}.{agg}" for k, v in summary(path).items() if isinstance(v, dict) for agg in v}
    return {"scalar": scalars, "table": tables, "image": images, "column": columns, "summary": summaries}


def missing_reads(dashboard: list[Section], logged_by_job: dict[str, dict[str, set]]) -> list[str]:
    """Every (section, panel, name) the dashboard reads that no run of the section's job type logs."""
    missing = []
    for section in dashboard:
        found = logged_by_job[section.job_type]
        for panel in section.panels:
            reads = panel.reads()
            if panel.kind == "bar":  # a bar reads the summary: the best value where it is defined so
                reads += [(summary_key(m), "summary") for m in panel.metrics if summary_of(m)]
            missing += [
                f"{section.name} / {panel.title}: {key} ({what})" for key, what in reads if key not in found[what]
            ]
    return missing


def test_every_metric_the_dashboard_names_is_logged_by_a_real_run(logged):
    dry = run_python(
        "-m",
        "dbsn.tools.dashboard",
        "--entity",
        "lab",
        "--project",
        "dbsn",
        "--group",
        f"quick {logged['sweep'].name}",
        "--ood-sets",
        ",".join(OOD_SETS),
        "--dry-run",
        timeout=120,
        env=OFFLINE,
        check=False,
    )
    assert dry.returncode == 0, dry.stderr
    spec = json.loads(dry.stdout)
    assert [s["name"] for s in spec["sections"]] == [
        "Calibration",
        "Intervals",
        "Accuracy",
        "Selective prediction",
        "OOD",
        "Conformal",
        "Dataset shift",
        "Adversarial",
        "Segmentation",
        "Structure posterior",
        "Training",
    ]
    dashboard = sections(OOD_SETS)
    assert [[p["title"] for p in s["panels"]] for s in spec["sections"]] == [
        [p.title for p in s.panels] for s in dashboard
    ]
    logged_by_job = {
        "train": _logged_reads([*logged["train"], logged["camvid"], logged["map"], *logged["signals"]]),
        "evaluate": _logged_reads(logged["evaluate"]),
    }
    assert missing_reads(dashboard, logged_by_job) == []
    # a panel for a metric that no run logs is caught
    broken = [
        Section("Calibration", "train", "", (Panel("bar", "typo", ("test/eec",)),)),
        Section("OOD", "evaluate", "", (Panel("line", "wrong job", ("val/error",), x="epoch"),)),
    ]
    assert missing_reads(broken, logged_by_job) == [
        "Calibration / typo: test/eec (scalar)",
        "OOD / wrong job: epoch (scalar)",  # evaluations have no epochs
        "OOD / wrong job: val/error (scalar)",
    ]
    # the W&B report that is saved names the same metrics, in the same panels, and each section
    # reads the runs of its job type in the group, grouped by method
    report = build_report("lab", "dbsn", f"quick {logged['sweep'].name}", OOD_SETS)
    group = ("group", "=", f"quick {logged['sweep'].name}")
    for section, sets in zip(dashboard, runsets(report), strict=True):
        assert len(sets) == (2 if section.posthoc else 1)
        leaves = [{(f.key.name, f.op, str(f.value)) for f in expr.expr_to_filters(s.filters).filters} for s in sets]
        assert leaves[0] == {("jobType", "=", section.job_type), group}
        if section.posthoc:  # and the post-hoc methods' evaluate runs
            posteriors = sorted(path.stem for path in (CONF_DIR / "posthoc").glob("*.yaml"))  # every one conf/ has
            assert leaves[1] == {("jobType", "=", "evaluate"), ("posthoc", "IN", str(posteriors)), group}
        assert all(s.groupby == ["config.method"] and (s.entity, s.project) == ("lab", "dbsn") for s in sets)
    assert [s.name for s in dashboard if s.posthoc] == ["Calibration", "Intervals", "Selective prediction"]
    # what those sections read of a training run, a post-hoc evaluation logs too (not per-epoch curves)
    posthoc_reads = _logged_reads([logged["posthoc"]])
    for section in (s for s in dashboard if s.posthoc):
        per_run = [p for p in section.panels if not (p.kind == "line" and p.x in (EPOCH, "ablation/n_samples"))]
        assert missing_reads([Section(section.name, "train", "", tuple(per_run))], {"train": posthoc_reads}) == []
    specs = panel_specs(report)
    panels = [p for s in dashboard for p in s.panels]
    assert len(specs) == len(panels)
    for panel, stored in zip(panels, specs):
        text = json.dumps(stored)
        names = [summary_key(m) for m in panel.metrics] if panel.kind == "bar" else list(panel.metrics)
        assert all(json.dumps(name) in text for name in names), (panel.title, text[:400])
    assert_stored_axes(
        panels,
        specs,
        logged_by_job,
        _step_metrics([*logged["train"], logged["camvid"], logged["map"], *logged["signals"], *logged["evaluate"]]),
    )


def _step_metrics(paths: list[Path]) -> dict[str, str]:
    """metric -> the step metric its runs defined for it (W&B's x axis for it)."""
    steps = {}
    for path in paths:
        steps.update({name: d.step_metric for name, d in metric_definitions(path).items() if d.step_metric})
    return steps


def assert_stored_axes(panels, specs, logged_by_job, step_metrics) -> None:
    """What the saved W&B panels plot against: a line panel's stored x axis is the panel's x, which
    is the step metric its runs defined for every metric it draws; a table chart's stored Vega
    preset and field mapping are the panel's, and name columns the logged table has."""
    columns = set().union(*(found["column"] for found in logged_by_job.values()))
    for panel, stored in zip(panels, specs):
        config = stored["config"]
        if panel.kind == "line":
            assert config["xAxis"] == panel.x and config["metrics"] == list(panel.metrics), (panel.title, config)
            for metric in panel.metrics:
                assert step_metrics.get(metric, panel.x) == panel.x, (panel.title, metric, step_metrics.get(metric))
        elif panel.kind == "table":
            fields = panel.fields()
            assert config["panelDefId"] == panel.chart and config["fieldSettings"] == fields, (panel.title, config)
            table_keys = [
                arg["value"]
                for field_ in config["userQuery"]["queryFields"][0]["fields"]
                for arg in field_.get("args", [])
                if arg.get("name") == "tableKey"
            ]
            assert table_keys == [panel.metrics[0]], (panel.title, table_keys)
            assert {f"{panel.metrics[0]}:{c}" for c in fields.values()} <= columns, (panel.title, fields)


def test_the_stored_axes_check_sees_a_wrong_x_axis_and_swapped_fields():
    """Guards the check above: a line panel stored against the global step instead of the epoch,
    and a table chart whose x and y fields are swapped, both fail it."""
    from dataclasses import replace

    line = Panel("line", "Validation ECE per epoch", ("val/ece",), x="epoch")
    chart = Panel(
        "table", "Reliability", ("test/reliability_bins",), x="confidence", y="accuracy", chart="wandb/line/v0"
    )
    logged = {"train": {"column": {"test/reliability_bins:confidence", "test/reliability_bins:accuracy"}}}
    steps = {"val/ece": "epoch"}
    good = [
        {"config": {"xAxis": "epoch", "metrics": ["val/ece"]}},
        {
            "config": {
                "panelDefId": "wandb/line/v0",
                "fieldSettings": {"x": "confidence", "y": "accuracy"},
                "userQuery": {
                    "queryFields": [{"fields": [{"args": [{"name": "tableKey", "value": "test/reliability_bins"}]}]}]
                },
            }
        },
    ]
    assert_stored_axes([line, chart], good, logged, steps)  # passes: its assertions hold
    with pytest.raises(AssertionError):
        assert_stored_axes(
            [replace(line, x="_step")], [{"config": {"xAxis": "_step", "metrics": ["val/ece"]}}], logged, steps
        )
    swapped = {"config": {**good[1]["config"], "fieldSettings": {"x": "accuracy", "y": "confidence"}}}
    with pytest.raises(AssertionError):
        assert_stored_axes([chart], [swapped], logged, steps)
    with pytest.raises(AssertionError):  # a field the table does not have
        assert_stored_axes(
            [replace(chart, y="acc")],
            [{"config": {**good[1]["config"], "fieldSettings": {"x": "confidence", "y": "acc"}}}],
            logged,
            steps,
        )
