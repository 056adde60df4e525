"""A user's mistake prints one line that says what was wrong and how to fix it, exits with status
2 and shows no traceback, through the real entry points (dbsn.runtime.errors); HYDRA_FULL_ERROR=1
shows the traceback."""

from __future__ import annotations

import subprocess

import pytest

from dbsn.runtime.cli import discard_refused_run
from dbsn.runtime.config import ConfigError
from dbsn.runtime.errors import one_line, one_line_errors
from tests.support.configs import ROOT
from tests.support.scripts import assert_one_line, run_python

pytestmark = pytest.mark.slow


def _run(script: str, args: list[str], cwd, env=None) -> subprocess.CompletedProcess:
    """`script` with Hydra's output in `cwd`/out and tracebacks off unless `env` turns them on;
    its exit status is for the test to judge."""
    return run_python(
        ROOT / script,
        *args,
        f"hydra.run.dir={cwd / 'out'}",
        cwd=cwd,
        timeout=300,
        env={"HYDRA_FULL_ERROR": "0", **(env or {})},
        check=False,
    )


CASES = {
    "a value of the wrong type": (
        ["experiment=quick", "model.train_samples=abc"],
        ["model.train_samples='abc'", "expected int"],
    ),
    "a checkpoint that is not there": (["experiment=quick", "ckpt_path=/nope.ckpt"], ["/nope.ckpt", "not found"]),
    "a dataset that is not there": (
        ["data=cifar10", "data.root=/nonexistent"],
        ["CIFAR-10", "missing under /nonexistent", "data_batch_1", "data.download=true"],
    ),
    "a setting under its old name": (
        ["experiment=quick", "model.n_samples=4"],
        ["model.n_samples was renamed model.prediction.n_samples", "use model.prediction.n_samples=4"],
    ),
}


def test_every_old_name_answers_with_a_key_that_exists(tmp_path):
    """Each renamed setting's new key is a key of its method's config (a rename that went stale
    would send the user to another refusal), and a key below an old one moves with it."""
    from omegaconf import OmegaConf

    from dbsn.runtime.cli import RENAMED, renamed_option
    from tests.support.configs import compose_config

    configs = {
        "model": compose_config("train", ["model=vogn"], tmp_path),
        "model.member": compose_config("train", ["model=deep_ensemble"], tmp_path),
        "evaluations": compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]"], tmp_path),
    }
    calibrators = [
        compose_config("evaluate", ["ckpt_path=x", f"posthoc={name}"], tmp_path)
        for name in ("dirichlet", "histogram_binning")
    ]
    for old, new in RENAMED.items():
        if old.startswith("posthoc."):  # a calibrator's: in the config of one calibrator or another
            assert any(OmegaConf.select(cfg, new, default="absent") != "absent" for cfg in calibrators), (old, new)
            assert all(OmegaConf.select(cfg, old, default="absent") == "absent" for cfg in calibrators), old
            continue
        cfg = configs["model.member" if old.startswith("model.member.") else old.split(".")[0]]
        assert OmegaConf.select(cfg, new, default="absent") != "absent", (old, new)
        assert OmegaConf.select(cfg, old, default="absent") == "absent", old
    assert renamed_option(["model.compile.enabled=true"]) == (
        "model.compile.enabled was renamed model.execution.compile.enabled: use model.execution.compile.enabled=true"
    )
    assert renamed_option(["++model.channels_last=true"]).endswith("use ++model.execution.channels_last=true")
    assert renamed_option(["model.prediction.n_samples=4", "n_samples=3"]) is None
    assert renamed_option(["posthoc=dirichlet", "posthoc.map=diagonal"]) == (
        "posthoc.map was renamed posthoc.calibrator.map: use posthoc.calibrator.map=diagonal"
    )


@pytest.mark.parametrize("case", list(CASES))
def test_train_py_says_what_is_wrong_in_one_line(case, tmp_path):
    args, phrases = CASES[case]
    assert_one_line(_run("train.py", args, tmp_path), *phrases)
    assert not (tmp_path / "out").exists()  # refused before training: no run folder left behind


def test_only_a_refused_starts_own_folder_is_removed(tmp_path):
    """A folder of Hydra's files made by this start goes; one with anything else, or made
    before (a run being resumed, someone's folder), stays."""
    import os
    import time

    def folder(name, extra=(), age=0.0):
        path = tmp_path / name
        (path / ".hydra").mkdir(parents=True)
        for file in (".hydra/config.yaml", "train.log", "resolved_config.yaml", *extra):
            (path / file).parent.mkdir(parents=True, exist_ok=True)
            (path / file).write_text("x")
            os.utime(path / file, (time.time() - age, time.time() - age))
        return path

    started = time.time() - 5
    assert discard_refused_run(folder("refused"), started) and not (tmp_path / "refused").exists()
    assert not discard_refused_run(folder("trained", ["checkpoints/last.ckpt"]), started)
    assert not discard_refused_run(folder("resumed", age=3600), started)
    assert (tmp_path / "trained").is_dir() and (tmp_path / "resumed" / "train.log").is_file()


def test_evaluate_py_on_a_corrupt_checkpoint_says_so_in_one_line(tmp_path):
    corrupt = tmp_path / "last.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 not really a checkpoint")
    assert_one_line(_run("evaluate.py", [f"ckpt_path={corrupt}"], tmp_path), str(corrupt), "corrupt")


def test_hydra_full_error_shows_the_traceback(tmp_path):
    result = _run("train.py", CASES["a value of the wrong type"][0], tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_only_user_errors_lose_their_traceback(capsys):
    @one_line_errors
    def mistaken():
        raise ConfigError("model.x=1: expected\n  a string.")

    @one_line_errors
    def buggy():
        raise KeyError("a bug")

    with pytest.raises(SystemExit) as exit_info:
        mistaken()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "Error: model.x=1: expected a string.\n"
    with pytest.raises(KeyError):
        buggy()
    assert one_line(ValueError("a\n\n  b ")) == "a b"


EVALUATE_CASES = {
    "no checkpoint": ([], ["ckpt_path is needed"]),
    "a folder without runs": (["ckpt_path={tmp}"], ["is a folder without training runs"]),
    "OOD sets without the OOD evaluation": (["ckpt_path=x.ckpt", "ood=textures"], ["add evaluations=[ood]"]),
    "an option of an OOD set not chosen": (
        ["ckpt_path=x.ckpt", "evaluations=[ood]", "ood=svhn", "ood.textures.download=true"],
        ["ood.textures.download", "OOD set textures, which is not chosen"],
    ),
    "an option of an evaluation not chosen": (
        ["ckpt_path=x.ckpt", "evaluations.shift.generate=true"],
        ["evaluation shift, which is not chosen", "evaluations=[shift]"],
    ),
    "an OOD score's option without the OOD evaluation": (
        ["ckpt_path=x.ckpt", "ood_score.knn.k=3"],
        ["ood_score.knn.k sets the OOD evaluation's scores", "add evaluations=[ood]"],
    ),
    "an OOD score's setting under its old name": (
        ["ckpt_path=x.ckpt", "evaluations=[ood]", "evaluations.ood.knn_k=20"],
        ["evaluations.ood.knn_k was renamed ood_score.knn.k", "use ood_score.knn.k=20"],
    ),
    "an option of a posterior not chosen": (
        ["ckpt_path=x.ckpt", "posthoc.hessian=full"],
        ["post-hoc posterior, and none is chosen", "laplace"],
    ),
    "a misspelled option of a posterior": (
        ["ckpt_path=x.ckpt", "posthoc=laplace", "+posthoc.hesian=full"],
        ["posthoc: unknown key 'hesian'", "Did you mean 'hessian'?"],
    ),
    # before any checkpoint is read (x.ckpt is not there)
    "an ensemble of no members": (["ckpt_path=x.ckpt", "n_samples=0"], ["n_samples must be >= 1"]),
    "a forward of no rows": (["ckpt_path=x.ckpt", "rows_per_forward=0"], ["rows_per_forward must be >= 1"]),
}


@pytest.mark.parametrize("case", list(EVALUATE_CASES))
def test_evaluate_py_says_what_is_wrong_in_one_line(case, tmp_path):
    args, phrases = EVALUATE_CASES[case]
    assert_one_line(_run("evaluate.py", [a.replace("{tmp}", str(tmp_path)) for a in args], tmp_path), *phrases)
    assert not (tmp_path / "out").exists()  # a refused evaluation leaves no Hydra folder behind


def test_structure_parallel_devices_that_do_not_divide_t_are_refused_in_one_line(tmp_path):
    assert_one_line(
        _run(
            "train.py",
            ["experiment=quick", "model.train_samples=4", "trainer.accelerator=cpu", "trainer.devices=3"],
            tmp_path,
        ),
        "T = 4 structures of a step over 3 devices",
        "model.parallel=data",
    )
    assert not (tmp_path / "out" / "checkpoints").exists()
