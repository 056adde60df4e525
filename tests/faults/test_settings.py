"""Every setting is applied or refused before anything runs.

Faults injected here: a setting changed on resume (applied only when listed in resume_changes, and
then really applied), keys that nothing reads, runs that would train no step or test no example,
trainer settings the methods ignore, values that a preset or a method's file set for another
choice (the refusal names that file), malformed group files of a user's extension, and a sweep
with a bad later job. Most cases run in this process on composed configs; one subprocess per
entry-point behaviour checks the one-line refusal through train.py itself.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import dbsn.runtime.run as run
from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.runtime.config import (
    EVALUATE_TOP_LEVEL_KEYS,
    TOP_LEVEL_KEYS,
    ConfigError,
    check_evaluate_config,
    validate_config,
)
from dbsn.runtime.preflight import check_job, check_trained
from dbsn.runtime.resume import ApplyResumeChanges, check_resume, resume_callbacks
from tests.support.configs import CONF, ROOT, compose_config
from tests.support.scripts import run_python

# A 2-epoch, 3-batch DBSN on digits; its lr 0.1 would drop at epoch round(0.75 * max_epochs).
QUICK = [
    "experiment=quick",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.log_every_n_steps=1",
    "trainer.limit_train_batches=3",
    "model.optim.milestones=[0.75]",
    "test=false",
]


def _composed(overrides: list[str], out: Path):
    """A train config with Hydra's node (its command line and defaults list), as train.py has it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, f"paths.output_dir={out}"], return_hydra_config=True)


def _refused(overrides: list[str], tmp_path: Path, hydra: bool = True) -> str:
    cfg = _composed(overrides, tmp_path) if hydra else compose_config("train", overrides, tmp_path)
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    return str(error.value)


def _no_build(monkeypatch) -> None:
    """Building the network fails the test: a refusal must come first."""

    def build(*args, **kwargs):
        raise AssertionError("the network was built before the refusal")

    monkeypatch.setattr(run, "build_model", build)


# ---------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("first")
    run.train(compose_config("train", [*QUICK, "trainer.max_epochs=2"], out), out)
    return out


def _lrs(run_dir: Path) -> list[float]:
    """The weights' lr the CSV logger recorded, epoch by epoch."""
    with open(next(run_dir.glob("csv/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    key = next(k for k in rows[0] if k.startswith("lr-SGD"))
    return [float(row[key]) for row in rows if row.get(key)]


def test_a_changed_lr_on_resume_is_refused_with_the_key_and_both_values(first_run, tmp_path, monkeypatch):
    """Today's trap: `model.optim.lr=0.5 ckpt_path=...` would train at the checkpoint's 0.1 while
    the run's config says 0.5. It is refused before the data or the network are built."""
    ckpt = first_run / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(run, "instantiate", lambda *a, **k: pytest.fail("built before the refusal"))
    with pytest.raises(ConfigError) as error:
        run.train(
            compose_config(
                "train", [*QUICK, "trainer.max_epochs=2", "model.optim.lr=0.5", f"ckpt_path={ckpt}"], tmp_path
            ),
            tmp_path,
        )
    message = str(error.value)
    assert "model.optim.lr (the checkpoint's 0.1, this run's 0.5)" in message
    assert "resume_changes=[model.optim.lr]" in message and f"init_from={ckpt}" in message
    with pytest.raises(ConfigError, match=r"trainer\.max_epochs \(the checkpoint's 2, this run's 4\)"):
        check_resume(compose_config("train", [*QUICK, "trainer.max_epochs=4"], tmp_path), ckpt)


def test_a_listed_change_is_applied_and_the_schedule_continues_from_the_new_settings(first_run, tmp_path):
    """With resume_changes the restored optimiser takes the new lr and the schedule is laid out
    again over the new max_epochs (milestone round(0.75 * 4) = 3): epochs 2 and 3 log 0.5 and 0.05.
    Without the re-application they would log the checkpoint's 0.01 and 0.01 (its milestone 2)."""
    ckpt = first_run / "checkpoints" / "last.ckpt"
    overrides = [
        *QUICK,
        "trainer.max_epochs=4",
        "model.optim.lr=0.5",
        f"ckpt_path={ckpt}",
        "resume_changes=[model.optim.lr,trainer.max_epochs]",
    ]
    cfg = compose_config("train", overrides, tmp_path)
    assert check_resume(cfg, ckpt) == [
        {"key": "model.optim.lr", "old": 0.1, "new": 0.5},
        {"key": "trainer.max_epochs", "old": 2, "new": 4},
    ]
    run.train(cfg, tmp_path)
    assert _lrs(first_run) == [0.1, 0.1]
    assert _lrs(tmp_path) == pytest.approx([0.5, 0.05], rel=1e-12)
    last = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    group = last["optimizer_states"][0]["param_groups"][0]
    assert group["initial_lr"] == 0.5 and last["dbsn_config"]["model"]["optim"]["lr"] == 0.5
    assert dict(last["lr_schedulers"][0]["milestones"]) == {3: 1} and last["lr_schedulers"][0]["last_epoch"] == 4
    assert OmegaConf.load(tmp_path / "resolved_config.yaml").model.optim.lr == 0.5


def test_a_requeue_and_free_keys_change_nothing_and_install_nothing(first_run, tmp_path):
    """A requeued job (resume=true, the same config, its own last.ckpt) passes untouched: no change,
    no callback, so the resume stays exact (tests/runtime/test_checkpoint.py checks it bit for bit);
    neither do settings that do not change the run."""
    folder = tmp_path / "run"
    shutil.copytree(first_run, folder)
    same = compose_config("train", [*QUICK, "trainer.max_epochs=2", "resume=true"], folder)
    assert check_job(same, folder) == [] and resume_callbacks([]) == []
    free = compose_config(
        "train",
        [
            *QUICK,
            "trainer.max_epochs=2",
            "logger=none",
            "test=true",
            "data.num_workers=1",
            "model.prediction.n_samples=7",
            "statistics.resamples=10",
            "trainer.log_every_n_steps=5",
            "~callbacks.progress_bar",
            "resume_changes=[model.optim.lr]",
        ],
        folder,
    )
    assert check_resume(free, first_run / "checkpoints" / "last.ckpt") == []


@pytest.mark.parametrize(
    "change, message",
    [
        (
            ["model.net.growth=8", "resume_changes=[model.net]"],
            r"model\.net\.growth=8 differs from 16 .*shape of its own network",
        ),
        (["seed=3", "resume_changes=[seed]"], r"seed=3 differs from 0 .*random streams"),
        (["model.theta_init_std=0.5", "resume_changes=[model.theta_init_std]"], r"only how training starts"),
        (
            ["model.train_samples=2", "resume_changes=[model.optim.lrr]"],
            r"lists 'model\.optim\.lrr', which is no key.*'model\.optim\.lr'",
        ),
    ],
)
def test_what_a_restored_state_cannot_take_is_refused_even_when_listed(first_run, tmp_path, change, message):
    ckpt = first_run / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=message) as error:
        check_resume(compose_config("train", [*QUICK, "trainer.max_epochs=2", *change], tmp_path), ckpt)
    assert "lrr" in change[-1] or f"init_from={ckpt}" in str(error.value)


def test_resume_changes_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"resume_changes=\['model\.optim\.lr'\] .*starts from scratch"):
        check_resume(compose_config("train", [*QUICK, "resume_changes=[model.optim.lr]"], tmp_path), None)


def test_captured_learning_rates_are_rewritten_in_place():
    """A CUDA-graphed step reads each group's lr tensor: the re-applied lr goes into that tensor,
    the schedule's base rates and milestones are this run's, its epoch the checkpoint's."""
    from types import SimpleNamespace

    from dbsn.methods.settings import WeightOptimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    fresh, fresh_schedule = WeightOptimizer(lr=0.5, milestones=(0.75,)).build(params, 4, capturable=True)
    old, old_schedule = WeightOptimizer(lr=0.1, milestones=(0.75,)).build(
        [torch.nn.Parameter(torch.zeros(3))], 2, capturable=True
    )
    for _ in range(2):
        old_schedule.step()
    trainer = SimpleNamespace(optimizers=[fresh], lr_scheduler_configs=[SimpleNamespace(scheduler=fresh_schedule)])
    callback = ApplyResumeChanges([{"key": "model.optim.lr", "old": 0.1, "new": 0.5}])
    callback.on_fit_start(trainer, None)
    fresh.load_state_dict(old.state_dict())  # what Lightning's restore does
    fresh_schedule.load_state_dict(old_schedule.state_dict())
    captured = fresh.param_groups[0]["lr"]
    assert float(captured) == pytest.approx(0.01)
    callback.on_train_start(trainer, None)
    assert fresh.param_groups[0]["lr"] is captured and float(captured) == pytest.approx(0.5)
    assert fresh_schedule.base_lrs[0] == pytest.approx(0.5) and dict(fresh_schedule.milestones) == {3: 1}
    fresh_schedule.step()  # epoch 3: the new milestone
    assert float(fresh.param_groups[0]["lr"]) == pytest.approx(0.05)


# ---------------------------------------------------------------------- keys nothing reads


def _source_text() -> str:
    texts = [p.read_text() for p in (ROOT / "src" / "dbsn").rglob("*.py") if p.name != "config.py"]
    return "\n".join(texts + [p.read_text() for p in CONF.rglob("*.yaml")])


def _is_read(key: str, text: str) -> bool:
    patterns = [
        rf'\.get\(\s*"{key}"',
        rf"\bcfg\.{key}\b",
        rf'\[\s*"{key}"\s*\]',
        rf"\$\{{{key}[.}}]",
        rf'= "{key}"\s*$',
        rf'for \w+ in \([^)]*"{key}"[^)]*\):',
    ]
    return key == "hydra" or any(re.search(p, text, re.MULTILINE) for p in patterns)


def test_every_accepted_top_level_key_is_read_and_the_unread_ones_are_refused(tmp_path):
    """Each top-level key train.py and evaluate.py accept is read somewhere (a `.get("key")`, an
    attribute, an interpolation `${key}`, a constant); `n_samples` and `print_config`, which
    train.py accepted and nothing read, are refused, and no hint leads to them."""
    text = _source_text()
    assert [k for k in sorted(TOP_LEVEL_KEYS | EVALUATE_TOP_LEVEL_KEYS) if not _is_read(k, text)] == []
    for key in ("n_samples=3", "print_config=true"):
        assert "Unknown top-level config key" in _refused([f"+{key}"], tmp_path, hydra=False)
    assert "n_samples" not in _refused(["+n_sample=3"], tmp_path, hydra=False).split("Valid keys")[0]
    for extra, message in (
        (["+statistics.seeds=1"], "statistics.seeds is not a setting"),
        (["+report.reference_method=map"], "report.reference_method is not a setting"),
        (["+callbacks.timer2=1"], "callbacks.timer2=1"),
        (["+model.net.num_classes=5"], "model.net.num_classes: the network's class count is the data's"),
        (["+model.optim.decay_start=0.3"], "schedule=multistep does not read it"),
    ):
        assert message in _refused(extra, tmp_path)
    evaluate_cfg = compose_config("evaluate", ["ckpt_path=x.ckpt", "+print_config=true"], tmp_path)
    with pytest.raises(ConfigError, match="Unknown top-level config key 'print_config'.* for evaluate.py"):
        check_evaluate_config(evaluate_cfg)
    with pytest.raises(ConfigError, match="bn_recalibration.image is not a setting"):
        check_evaluate_config(compose_config("evaluate", ["ckpt_path=x.ckpt", "+bn_recalibration.image=1"], tmp_path))


# ---------------------------------------------------------------------- runs of no step


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.batch_size=5000"], r"data\.batch_size=5000 is larger than the training split \(1347 images.*drop_last"),
        (["data.batch_size=0"], r"data\.batch_size=0: expected a number of images >= 1"),
        (["data.num_workers=-1"], r"data\.num_workers=-1: expected a number of worker processes >= 0"),
        (["data.download=true"], r"data\.download=true: DigitsDataModule has nothing to download"),
        (["trainer.limit_train_batches=0.01"], r"limit_train_batches=0\.01 of an epoch's 21 batches is less than one"),
        (
            ["trainer.limit_test_batches=0.01", "test=true"],
            r"limit_test_batches=0\.01 of the 8 batches of the test split",
        ),
        (["data.val_size=1347"], r"data\.val_size=1347 leaves no training images out of 1347"),
        (
            ["data.val_size=0.5", "data.eval_batch_size=1000", "trainer.limit_val_batches=0.5"],
            r"limit_val_batches=0\.5 of the 1",
        ),
        (
            ["model=csghmc", "model/net=structure_net", "trainer.max_epochs=2", "trainer.limit_train_batches=2"],
            r"model\.sampler\.schedule: a run of 4 steps in 4 cycles.*2 epochs × 2 batches = 4 steps",
        ),
        (
            ["model=map", "callbacks=snapshot_ensemble", "trainer.max_epochs=3"],
            r"callbacks\.snapshot_ensemble\.cycles=5",
        ),
    ],
)
def test_a_run_that_would_train_or_test_nothing_is_refused_before_the_network_is_built(
    overrides, message, tmp_path, monkeypatch
):
    _no_build(monkeypatch)
    base = ["data=digits", "trainer=cpu", "test=false"] if overrides[0].startswith("model=") else QUICK
    with pytest.raises(ConfigError, match=message):
        run.train(compose_config("train", [*base, "trainer.max_epochs=2", *overrides], tmp_path), tmp_path)


def test_a_fit_of_no_step_is_not_tested_or_reported(tmp_path, monkeypatch):
    """What the first check cannot see: the fit itself trained no step (here the check is taken
    away). The run is refused after its fit, before its test: no metrics.json."""
    monkeypatch.setattr(run, "check_run_length", lambda cfg, datamodule: None)
    with pytest.raises(ConfigError, match="ended without a training step"):
        run.train(
            compose_config("train", [*QUICK, "data.batch_size=5000", "test=true", "trainer.max_epochs=1"], tmp_path),
            tmp_path,
        )
    assert not (tmp_path / "metrics.json").exists()
    from types import SimpleNamespace

    check_trained(SimpleNamespace(global_step=1))


# ---------------------------------------------------------------------- trainer settings


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_epochs=-5", r"trainer\.max_epochs=-5: the methods' schedules"),
        ("trainer.max_epochs=0", r"trainer\.max_epochs=0"),
        ("trainer.accumulate_grad_batches=4", r"accumulate_grad_batches=4: the methods step .*data\.batch_size"),
        ("trainer.gradient_clip_val=1.0", r"gradient_clip_val=1\.0: .*model\.optim\.grad_clip_norm"),
        ("trainer.gradient_clip_algorithm=value", r"gradient_clip_algorithm=value: .*model\.optim\.grad_clip_norm"),
        ("trainer.min_epochs=20", r"trainer\.min_epochs=20 with trainer\.max_epochs=15"),
        ("trainer.max_steps=0", r"trainer\.max_steps=0: .*0 trains nothing"),
        ("trainer.min_steps=50 trainer.max_steps=10", r"trainer\.min_steps=50 with trainer\.max_steps=10"),
        ("trainer.limit_train_batches=-1", r"limit_train_batches=-1: expected a number of batches"),
        ("trainer.limit_val_batches=1.5", r"limit_val_batches=1\.5: expected"),
        ("trainer.limit_train_batches=0", r"limit_train_batches=0 trains no batch"),
        ("trainer.limit_test_batches=0", r"limit_test_batches=0 with test=true tests no example"),
        ("trainer.fast_dev_run=true", r"fast_dev_run=true writes no checkpoint"),
        ("trainer.barebones=true", r"barebones=true"),
        ("trainer.enable_checkpointing=false", r"~callbacks\.model_checkpoint"),
        ("trainer.devices=0", r"trainer\.devices=0"),
    ],
)
def test_trainer_settings_the_methods_would_not_apply_are_refused_at_config_time(override, message, tmp_path):
    text = _refused(["experiment=quick", *override.split()], tmp_path, hydra=False)
    assert re.search(message, text), text
    assert "switch to automatic optimization" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_trainer_without_a_gpu_is_refused_here_and_left_to_the_cluster_when_submitted(tmp_path):
    assert "this machine has none" in _refused(["experiment=quick", "trainer=gpu"], tmp_path)
    job = _composed(["experiment=quick", "trainer=gpu"], tmp_path)
    assert check_job(job, on_this_machine=False) == []  # SLURM's login node has no GPU; the jobs' nodes do


# ---------------------------------------------------------------------- where a value came from


def test_a_refused_key_names_the_preset_or_the_file_that_set_it(tmp_path):
    quick = _refused(["experiment=quick", "model=map_fixed"], tmp_path)
    assert quick.startswith("model.tau, model.beta were set by the preset experiment=quick (")
    assert "conf/experiment/quick.yaml) for model=dbsn, and MAP (model=map_fixed) has no such settings" in quick
    assert "~model.tau ~model.beta" in quick and "Did you mean" not in quick
    vogn = _refused(["model=vogn", "model/net=wrn28_10"], tmp_path)
    assert (
        "conf/model/vogn.yaml (model=vogn) sets num_nodes=4, cells_per_stage=1 for its own network "
        "model/net=structure_net, and WideResNet (model/net=wrn28_10) has no such settings" in vogn
    )
    assert "runs on any network (structure_net, resnet18, wrn28_10)" in vogn and "num_classes" not in vogn
    mine = _refused(["+model.optim.learning_rate=0.1"], tmp_path)
    assert "(set on the command line (+model.optim.learning_rate=0.1))" in mine and "Valid keys: " in mine
    plain = _refused(["+model.optim.learning_rate=0.1"], tmp_path, hydra=False)  # composed without Hydra's node
    assert plain.startswith("model.optim: unknown key 'learning_rate'")


def test_a_malformed_group_file_of_an_extension_is_named(tmp_path):
    ext = tmp_path / "ext"
    for path, text in (
        ("model/listed.yaml", "- a\n- b\n"),
        ("data/word.yaml", "digits\n"),
        (
            "model/mine.yaml",
            "defaults:\n  - net: structure_net\n  - optim: sgd\n  - _self_\n"
            "_target_: dbsn.methods.MAP\nexecution: default\n",
        ),
    ):
        (ext / path).parent.mkdir(parents=True, exist_ok=True)
        (ext / path).write_text(text)
    search = f"hydra.searchpath=[file://{ext}]"
    listed = _refused([search, "model=listed"], tmp_path)
    assert listed.startswith("model: ") and f"{ext.name}/model/listed.yaml (model=listed) holds a list" in listed
    assert "data/word.yaml (data=word) holds a mapping without _target_" in _refused([search, "data=word"], tmp_path)
    assert "model/mine.yaml (model=mine) sets it to a str ('default'), and model.execution takes a mapping" in _refused(
        [search, "model=mine"], tmp_path
    )


# ---------------------------------------------------------------------- sweeps


def test_every_job_of_a_sweep_is_checked_before_the_first_starts(tmp_path):
    """check_job refuses the bad later job (`model.optim.lr=0.1,-1`) from the config alone, and the
    SLURM launcher's check_sweep runs the same checks, the run's length included."""
    from dbsn.runtime.cluster import check_sweep

    jobs = [_composed(["experiment=quick", f"model.optim.lr={lr}"], tmp_path) for lr in (0.1, -1)]
    before = OmegaConf.to_yaml(jobs[0])
    assert check_job(jobs[0]) == [] and OmegaConf.to_yaml(jobs[0]) == before  # the job's config is not modified
    with pytest.raises(ConfigError, match="model.optim: lr must be > 0, got -1"):
        check_job(jobs[1])
    long_batch = _composed(["experiment=quick", "data.batch_size=5000"], tmp_path)
    with pytest.raises(ConfigError, match=r"sweep job #1 .*data\.batch_size=5000 is larger.*Nothing was submitted"):
        check_sweep([jobs[0], long_batch], {"nodes": None, "tasks_per_node": None, "gpus_per_node": None})


# ---------------------------------------------------------------------- through train.py


def _train_py(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_python(
        ROOT / "train.py",
        *args,
        f"hydra.run.dir={cwd / 'out'}",
        cwd=cwd,
        timeout=300,
        env={"HYDRA_FULL_ERROR": "0"},
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, phrases",
    [
        (
            [
                "data=digits",
                "trainer=cpu",
                "model=csghmc",
                "model/net=structure_net",
                "trainer.max_epochs=2",
                "trainer.limit_train_batches=2",
            ],
            ["model.sampler.schedule: a run of 4 steps in 4 cycles"],
        ),
        (["model=vogn", "model/net=wrn28_10"], ["conf/model/vogn.yaml (model=vogn) sets num_nodes=4", "WideResNet"]),
    ],
)
def test_train_py_refuses_in_one_line_and_leaves_no_folder(args, phrases, tmp_path):
    done = _train_py(args, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1 and all(p in lines[0] for p in phrases), done.stderr[-3000:]
    assert "parameters" not in done.stdout  # refused before the network was built
    assert not (tmp_path / "out").exists()
