"""dbsn as a user installs it: the wheel holds every config of the package's tree, and from a folder
outside the checkout its console scripts train a short digits run, evaluate it and report it.

The wheel is built offline (`pip wheel --no-deps --no-build-isolation`) from a copy of the sources, so
the checkout gets no build/ folder. It is installed with `--no-deps` into a fresh virtual environment
whose only other path is this environment's site-packages (added by a `.pth` line, which Python does
not scan for further `.pth` files): dbsn comes from the wheel, never from the editable checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import dbsn
from tests.support.configs import ROOT

TINY_RUN = [
    "experiment=quick",
    "trainer.max_epochs=1",
    "model.net.num_nodes=3",
    "model.net.growth=4",
    "model.net.stem_channels=8",
    "model.prediction.n_samples=2",
    "model.prediction.samples_per_forward=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


def _run(*args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`args` in `cwd` without PYTHONPATH (nothing of the checkout on the path); fails with the output's tail."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the fresh environment's bin/ with dbsn installed from it)."""
    pytest.importorskip("setuptools", minversion="77")  # the build backend pyproject.toml names, built offline
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        source,
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        tmp / "dist",
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("dbsn-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip()
    (Path(purelib) / "dbsn_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp)
    return wheel, venv / "bin"


@pytest.mark.slow
def test_the_wheel_holds_every_config(installed):
    wheel, bin_dir = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    ours = {f"dbsn/conf/{p.relative_to(dbsn.CONF_DIR).as_posix()}" for p in dbsn.CONF_DIR.rglob("*.yaml")}
    assert len(ours) > 100 and ours <= names
    where = _run(bin_dir / "python", "-c", "import dbsn; print(dbsn.CONF_DIR)", cwd=wheel.parent).stdout.strip()
    assert Path(where).is_relative_to(bin_dir.parent) and (Path(where) / "train.yaml").is_file()


@pytest.mark.slow
def test_an_installed_wheel_trains_evaluates_and_reports_outside_the_checkout(installed, tmp_path):
    _, bin_dir = installed
    run = tmp_path / "runs" / "quick"
    _run(bin_dir / "dbsn-train", *TINY_RUN, f"hydra.run.dir={run}", cwd=tmp_path)
    record = json.loads((run / "metrics.json").read_text())
    assert 0 <= record["metrics"]["test/error"] <= 1
    checkpoint = run / "checkpoints" / "last.ckpt"
    _run(
        bin_dir / "dbsn-evaluate",
        f"ckpt_path={checkpoint}",
        "n_samples=2",
        "ablation.sizes=[]",
        "trainer.enable_progress_bar=false",
        cwd=tmp_path,
    )
    assert (run / "evaluation" / "metrics.json").is_file()
    _run(bin_dir / "dbsn-report", tmp_path / "runs", "--out", tmp_path / "report", "--resamples", "50", cwd=tmp_path)
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "runs.csv").is_file()
