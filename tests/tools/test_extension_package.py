"""An extension package found by every tool: docs/extending.md's package, installed with pip
(its `dbsn.extensions` entry point), is trained, evaluated and compared by name through
`dbsn-compare` and the report, with no edit to dbsn and no Hydra search path on the command line;
`DBSN_CONFIG_PATH` does the same without installing, and a package that cannot be read, or that
reuses a name, is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_extending import page_files
from tests.support.scripts import assert_one_line

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "myext"
version = "0.1"

[project.entry-points."dbsn.extensions"]
myext = "myext.conf"

[tool.setuptools.packages.find]
include = ["myext*"]

[tool.setuptools.package-data]
"myext.conf" = ["**/*.yaml"]
"""


def write_package(where: Path) -> Path:
    """docs/extending.md's package `myext` with a pyproject.toml that declares its configs."""
    for path, text in page_files().items():
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_text(text)
    (where / "myext" / "__init__.py").touch()
    (where / "myext" / "conf" / "__init__.py").touch()
    (where / "pyproject.toml").write_text(PYPROJECT)
    return where


def script(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def run(*args, env: dict, cwd: Path, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [*map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The package pip-installed (offline, no dependencies) into a folder of its own, which the
    tests' processes put on their path: an installed distribution with its entry point."""
    source = write_package(tmp_path_factory.mktemp("myext_source"))
    target = tmp_path_factory.mktemp("site")
    run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-index",
        "--no-build-isolation",
        "--target",
        target,
        source,
        env={},
        cwd=source,
    )
    assert (next(target.glob("myext-0.1.dist-info")) / "entry_points.txt").read_text().count("myext.conf") == 1
    return {"PYTHONPATH": str(target)}


@pytest.mark.slow
def test_an_installed_extension_is_compared_by_name(installed, tmp_path):
    out = tmp_path / "cmp"
    run(
        script("dbsn-compare"),
        "--data",
        "digits",
        "--subset",
        "200",
        "--epochs",
        "1",
        "--samples",
        "4",
        "--methods",
        "map_fixed,random_structures",
        "--out",
        out,
        env=installed,
        cwd=tmp_path,
    )
    results = json.loads((out / "comparison.json").read_text())["results"]
    assert {"map_fixed", "random_structures"} <= set(results)
    assert results["random_structures"]["test/mutual_information"] > 0  # its members' structures differ
    assert results["random_structures"]["cost"]["n_samples"] == 4  # --samples reaches the extension's method
    assert (
        "myext.random_structures.RandomStructures" in (out / "random_structures" / "resolved_config.yaml").read_text()
    )
    report = (out / "report" / "report.md").read_text()
    assert "| random_structures |" in report


def test_the_tools_see_an_installed_extension(installed, tmp_path):
    probe = (
        "from dbsn import conf_choices; from dbsn.tools.compare import backbone_choices, compared_methods, data_choices; "
        "from dbsn.tools.dashboard import posthoc_names; import json; "
        "print(json.dumps([compared_methods(), data_choices(), backbone_choices(), posthoc_names(), "
        "conf_choices('evaluations'), conf_choices('ood_score')]))"
    )
    methods, data, backbones, posthoc, evaluations, scores = json.loads(
        run(sys.executable, "-c", probe, env=installed, cwd=tmp_path).stdout.strip().splitlines()[-1]
    )
    assert "random_structures" in methods and "map" in methods
    assert "image_folder" in data and "digits" in data
    assert "small_cnn" in backbones and "resnet18" in backbones
    assert {"last_layer_noise", "label_prior", "temperature"} <= set(posthoc)
    assert "misclassification" in evaluations and "class_cosine" in scores


def test_the_search_path_setting_finds_an_uninstalled_extension(tmp_path, monkeypatch):
    from dbsn import conf_choices
    from dbsn.extensions import SEARCH_PATH_VARIABLE, config_dirs
    from dbsn.methods.registry import method_config

    package = write_package(tmp_path)
    monkeypatch.setenv(SEARCH_PATH_VARIABLE, str(package / "myext" / "conf"))
    monkeypatch.syspath_prepend(str(package))
    assert config_dirs()[1:] == [(package / "myext" / "conf").resolve()]
    assert "random_structures" in conf_choices("model") and "misclassification" in conf_choices("evaluations")
    assert method_config("random_structures").cls.__name__ == "RandomStructures"


def test_a_clash_or_a_broken_extension_is_refused_in_one_line(tmp_path):
    package = write_package(tmp_path / "pkg")
    clash = tmp_path / "clash"
    (clash / "model").mkdir(parents=True)
    (clash / "model" / "map.yaml").write_text("_target_: myext.random_structures.RandomStructures\n")
    line = assert_one_line(
        run(script("dbsn-train"), "data=digits", env={"DBSN_CONFIG_PATH": str(clash)}, cwd=tmp_path, check=False),
        "model/map.yaml",
        "rename it",
    )
    assert "dbsn's" in line
    missing = run(
        script("dbsn-compare"),
        "--epochs",
        "1",
        env={"DBSN_CONFIG_PATH": str(tmp_path / "nowhere")},
        cwd=tmp_path,
        check=False,
    )
    assert_one_line(missing, "DBSN_CONFIG_PATH", "not a folder")
    # an installed entry point whose package does not import
    site = tmp_path / "site"
    dist = site / "broken-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dbsn.extensions]\nbroken = broken_ext.conf\n")
    assert_one_line(
        run(script("dbsn-train"), env={"PYTHONPATH": str(site)}, cwd=tmp_path, check=False),
        "broken_ext.conf",
        "does not import",
        "uninstall",
    )
    assert not list(tmp_path.glob("outputs")) and package.is_dir()
