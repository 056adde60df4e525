"""Fault injection: what evaluate and the report write goes only where it belongs.

- evaluate writes into a new folder, or one it wrote for the same checkpoint(s): another run's
  evaluation folder, the run's own evaluation of an earlier checkpoint (the run resumed since),
  another post-hoc posterior's or another ensemble's folder, and a run folder holding another
  run's files are each refused in one line, before anything runs;
- the report writes only files it made: a folder of a user's files, or an earlier report beside
  which a user put or changed something, is refused, for `dbsn-report`, a sweep's evaluation and
  every caller of the builder;
- a mistyped path, or a path without runs, is an error.

Each refusal leaves every byte of what was there unchanged (digests before and after), and no
folder behind. Runs are hand-made (`tests.support.fakeruns.write_trained_run`: a tiny untrained
DBSN on digits, saved as train.py saves it), so that only the cases that must evaluate do.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dbsn.evaluation.report import ReportError, build_report, build_sweep_report
from dbsn.runtime.checkpoint import CheckpointError
from dbsn.runtime.config import ConfigError
from dbsn.runtime.evaluation_folder import identify
from dbsn.tools.report import cli as report_cli
from tests.support.configs import ROOT, evaluate_quietly
from tests.support.fakeruns import DATA, MODELS, write_run, write_trained_run
from tests.support.scripts import run_python

A, B = "a" * 32, "b" * 32
QUICK = ["n_samples=2", "ablation.sizes=[]", "statistics.resamples=20"]


def digests(folder: Path) -> dict[str, str]:
    """Every file below `folder` (and every folder, as "dir"), by path: its content's sha256."""
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two runs that name themselves (a and b), a's checkpoint evaluated into a/evaluation."""
    root = tmp_path_factory.mktemp("runs")
    a = write_trained_run(root / "a", A, seed=0)
    b = write_trained_run(root / "b", B, seed=1)
    evaluate_quietly(a / "checkpoints" / "last.ckpt", root / "hydra", QUICK)
    return root


@pytest.fixture
def runs(made, tmp_path):
    """A fresh copy of `made` for one test."""
    shutil.copytree(made, tmp_path / "sweep")
    return tmp_path / "sweep"


def ckpt(run: Path) -> Path:
    return run / "checkpoints" / "last.ckpt"


def refused(error, run_evaluation, *phrases, folders=()):
    """`run_evaluation()` raises `error` naming `phrases`, and every byte of `folders` stays as it was."""
    before = {folder: digests(folder) for folder in folders}
    with pytest.raises(error) as found:
        run_evaluation()
    message = str(found.value)
    assert "\n" not in message
    for phrase in phrases:
        assert phrase in message, message
    for folder in folders:
        assert digests(folder) == before[folder], folder
    return message


# ---------------------------------------------------------------------- evaluate
def test_another_runs_checkpoint_is_refused_from_a_runs_evaluation_folder(runs, tmp_path):
    a, b = runs / "a", runs / "b"
    assert json.loads((a / "evaluation" / "metrics.json").read_text())["run_id"] == A
    refused(
        ConfigError,
        lambda: evaluate_quietly(ckpt(b), tmp_path / "h", [*QUICK, f"output_dir={a / 'evaluation'}"]),
        f"output_dir={a / 'evaluation'} holds the evaluation of another checkpoint",
        "run aaaaaaaa",
        "run bbbbbbbb",
        "choose a new folder",
        folders=[a, b],
    )
    # an ensemble of a and b, and a post-hoc posterior of a, are other models too
    refused(
        ConfigError,
        lambda: evaluate_quietly(f"[{ckpt(a)},{ckpt(b)}]", tmp_path / "h", [*QUICK, f"output_dir={a / 'evaluation'}"]),
        "holds the evaluation of another checkpoint",
        folders=[a],
    )
    refused(
        ConfigError,
        lambda: evaluate_quietly(
            ckpt(a), tmp_path / "h", [*QUICK, "posthoc=temperature", f"output_dir={a / 'evaluation'}"]
        ),
        "holds another evaluation's results (the run's own predictive)",
        folders=[a],
    )


def test_the_same_checkpoint_may_be_evaluated_again_into_its_folder(runs, tmp_path):
    a = runs / "a"
    before = digests(a / "evaluation")
    evaluate_quietly(ckpt(a), tmp_path / "h", QUICK)  # <run>/evaluation: replaced, the same checkpoint
    assert set(digests(a / "evaluation")) == set(before)
    assert json.loads((a / "evaluation" / "metrics.json").read_text())["evaluated"][0]["run_id"] == A


def test_the_evaluation_of_an_earlier_checkpoint_of_the_run_is_kept(runs, tmp_path):
    """After a resume the run's last.ckpt is a later model: its evaluation folder is not replaced
    (a researcher may want both); the refusal says how to keep it and go on."""
    a = runs / "a"
    record = json.loads((a / "evaluation" / "metrics.json").read_text())
    earlier = dict(record["evaluated"][0], epoch=0, global_step=5, digest={"algorithm": "sha256", "tensors": "0" * 64})
    (a / "evaluation" / "metrics.json").write_text(json.dumps({**record, "evaluated": [earlier], "digest": None}))
    refused(
        ConfigError,
        lambda: evaluate_quietly(ckpt(a), tmp_path / "h", QUICK),
        f"{a / 'evaluation'} holds the evaluation of an earlier checkpoint of this run",
        "epoch 0, step 5",
        f"mv {a / 'evaluation'} {a / 'evaluation-epoch0'}",
        "output_dir=<a new folder>",
        folders=[a],
    )
    # a post-hoc posterior's folder, likewise
    posthoc = a / "posthoc" / "temperature" / "evaluation"
    posthoc.mkdir(parents=True)
    (posthoc / "metrics.json").write_text(json.dumps({**record, "evaluated": [earlier], "posthoc": "temperature"}))
    refused(
        ConfigError,
        lambda: evaluate_quietly(ckpt(a), tmp_path / "h", [*QUICK, "posthoc=temperature"]),
        "holds the evaluation of an earlier checkpoint of this run",
        folders=[a],
    )


def test_an_ensemble_s_folder_takes_the_same_members_in_any_order(tmp_path, runs):
    a, b, out = runs / "a", runs / "b", tmp_path / "ensemble"
    out.mkdir()
    (out / "metrics.json").write_text(
        json.dumps({"checkpoints": [str(ckpt(a)), str(ckpt(b))], "evaluated": identify([ckpt(a), ckpt(b)])})
    )
    from dbsn.runtime.evaluation_folder import check_folder

    assert check_folder(out, identities=identify([ckpt(b), ckpt(a)])) == out
    refused(ConfigError, lambda: check_folder(out, identities=identify([ckpt(a)])), "another checkpoint", folders=[out])
    refused(ConfigError, lambda: check_folder(out, identities=identify([ckpt(a), ckpt(a)])), "another checkpoint")


@pytest.mark.parametrize("fault", ["checkpoint", "metrics", "config"])
def test_a_run_folder_that_holds_another_runs_files_is_refused(runs, tmp_path, fault):
    a, b = runs / "a", runs / "b"
    if fault == "checkpoint":
        shutil.copyfile(ckpt(b), a / "checkpoints" / "epoch000.ckpt")
    elif fault == "metrics":
        shutil.copyfile(b / "metrics.json", a / "metrics.json")
    else:
        shutil.copyfile(b / "resolved_config.yaml", a / "resolved_config.yaml")
    refused(
        CheckpointError,
        lambda: evaluate_quietly(ckpt(a), tmp_path / "h", QUICK),
        f"ckpt_path={ckpt(a)}: the run folder {a} holds files of more than one run",
        folders=[a, b],
    )


def test_a_sweep_evaluates_no_run_into_another_checkpoints_folder(runs, tmp_path):
    a, b = runs / "a", runs / "b"
    shutil.copytree(a / "evaluation", b / "evaluation")  # b's folder holds a's evaluation
    shutil.copyfile(b / "metrics.json", a / "metrics.json")  # a's files disagree
    before = digests(runs)
    found = evaluate_quietly(runs, tmp_path / "h", QUICK)
    assert "holds files of more than one run" in found["not_evaluated"][str(a)]
    assert "holds the evaluation of another checkpoint" in found["not_evaluated"][str(b)]
    now = digests(runs)
    assert {k: v for k, v in now.items() if not k.startswith("report")} == before
    report = found["report"]
    assert {r.path.name: r.status for r in report.runs} == {"a": "inconsistent", "b": "inconsistent"}


def test_a_refused_evaluate_py_leaves_no_folder_and_says_so_in_one_line(runs, tmp_path):
    a, b = runs / "a", runs / "b"
    before = digests(runs)
    done = run_python(
        ROOT / "evaluate.py",
        f"ckpt_path={ckpt(b)}",
        f"output_dir={a / 'evaluation'}",
        cwd=tmp_path,
        env={"HYDRA_FULL_ERROR": "0"},
        check=False,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "holds the evaluation of another checkpoint" in errors[0]
    assert digests(runs) == before
    assert not list((tmp_path / "outputs" / "evaluate" / "runs").glob("*"))  # Hydra's folder of this start: gone


# ---------------------------------------------------------------------- the report
@pytest.fixture
def finished(tmp_path):
    """Two finished hand-made runs for the report."""
    for seed in (1, 2):
        write_run(tmp_path / "runs" / str(seed), MODELS["dbsn"], DATA["cifar10"], seed, 0.05 * seed)
    return tmp_path / "runs"


def report_refused(capsys, argv, *phrases, folders=()):
    """`dbsn-report *argv` exits with status 2 and one line naming `phrases`; `folders` unchanged."""
    import sys

    before = {folder: digests(folder) for folder in folders}
    argv_was = sys.argv
    sys.argv = ["dbsn-report", *map(str, argv)]
    try:
        with pytest.raises(SystemExit) as exit_info:
            report_cli()
    finally:
        sys.argv = argv_was
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("Error: "), err
    for phrase in phrases:
        assert phrase in err, err
    for folder in folders:
        assert digests(folder) == before[folder], folder
    return err


def test_a_report_over_a_users_files_is_refused(finished, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("# my notes\n")
    (mine / "runs.csv").write_text("my,own\n")
    report_refused(
        capsys,
        [finished, "--out", mine],
        f"{mine} holds files the report did not write",
        "report.md",
        "runs.csv",
        "--out <folder>",
        folders=[mine, finished],
    )
    file = tmp_path / "a_file"
    file.write_text("x")
    report_refused(capsys, [finished, "--out", file], "is a file, not a folder", folders=[tmp_path / "runs"])
    assert file.read_text() == "x"


def test_a_report_rewrites_its_own_folder_and_nothing_a_user_put_there(finished, tmp_path, capsys):
    out = tmp_path / "report"
    ood = finished / "1" / "evaluation" / "adversarial"
    ood.mkdir(parents=True)
    (ood / "results.csv").write_text("attack,epsilon,accuracy,mean_entropy,n_examples\nfgsm,0.0,0.9,0.2,10\n")
    build_report([finished], out)
    assert (out / "adversarial.md").is_file()
    listed = json.loads((out / "report_files.json").read_text())["files"]
    assert set(listed) == {p.name for p in out.iterdir()} - {"report_files.json"}
    shutil.rmtree(finished / "1" / "evaluation")
    build_report([finished], out)  # its own folder: rewritten, the page it no longer writes removed
    assert not (out / "adversarial.md").exists() and (out / "report.md").is_file()
    # a file a user added beside the report, or a report file a user edited: refused, unchanged
    (out / "notes.txt").write_text("mine\n")
    report_refused(capsys, [finished, "--out", out], "notes.txt", "beside an earlier report", folders=[out])
    (out / "notes.txt").unlink()
    (out / "report.md").write_text((out / "report.md").read_text() + "my comment\n")
    report_refused(capsys, [finished, "--out", out], "were changed since it wrote them (report.md)", folders=[out])


def test_every_caller_of_the_report_refuses_a_users_files(finished, tmp_path, runs):
    """A sweep's report (SLURM sweeps and evaluate over a folder of runs) and dbsn-compare's
    (`build_report`) go through the same folder rule; evaluate refuses before any run is evaluated."""
    for root in (finished, runs):
        (root / "report").mkdir()
        (root / "report" / "report.md").write_text("mine\n")
    before = digests(finished)
    with pytest.raises(ReportError, match=r"holds files the report did not write .* --out <a new folder>"):
        build_sweep_report(finished)
    with pytest.raises(ReportError, match="choose a new or empty folder"):
        build_report([finished], finished / "report")
    assert digests(finished) == before
    before = digests(runs)
    with pytest.raises(ReportError, match=f"{runs / 'report'} holds files the report did not write"):
        evaluate_quietly(runs, tmp_path / "h", QUICK)
    assert digests(runs) == before  # no run was evaluated


def test_a_mistyped_path_or_a_path_without_runs_is_an_error(finished, tmp_path, capsys):
    report_refused(
        capsys, [finished, tmp_path / "typo", "--out", tmp_path / "r"], f"{tmp_path / 'typo'} does not exist"
    )
    (tmp_path / "empty").mkdir()
    report_refused(capsys, [tmp_path / "empty", "--out", tmp_path / "r"], "holds no run", "resolved_config.yaml")
    assert not (tmp_path / "r").exists()
