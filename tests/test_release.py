"""Releases: one source of the version, py.typed shipped, the version in checkpoints and
metrics.json, and a checkpoint from another version loading with one Note line saying so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

tomllib = pytest.importorskip("tomllib")

import dbsn
from dbsn.runtime.checkpoint import CONFIG_KEY, VERSION_KEY, load_checkpoint, version_note
from dbsn.runtime.integrity import with_digest

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_has_one_source():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dbsn.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", dbsn.__version__)
    # No other file of the package spells the version out.
    for path in (ROOT / "src" / "dbsn").rglob("*.py"):
        if path.name != "__init__.py" or path.parent.name != "dbsn":
            assert f'"{dbsn.__version__}"' not in path.read_text(), path


def test_py_typed_is_package_data_and_the_changelog_names_the_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["dbsn"]
    assert (ROOT / "src" / "dbsn" / "py.typed").is_file()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and f"## [{dbsn.__version__}]" in changelog


def _checkpoint(path: Path, version: str | None) -> Path:
    checkpoint = {"state_dict": {"w": torch.ones(2)}, CONFIG_KEY: {"model": {}}}
    if version is not None:
        checkpoint[VERSION_KEY] = version
    torch.save(with_digest(checkpoint), path)
    return path


@pytest.mark.parametrize("version", [None, "0.0.1"])
def test_a_checkpoint_from_another_version_loads_and_says_which_wrote_it(tmp_path, capsys, version):
    path = _checkpoint(tmp_path / "old.ckpt", version)
    checkpoint = load_checkpoint(path)
    assert torch.equal(checkpoint["state_dict"]["w"], torch.ones(2))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Note:")]
    assert len(notes) == 1
    writer = f"dbsn {version}" if version else "did not record its version"
    assert writer in notes[0] and f"this is dbsn {dbsn.__version__}" in notes[0]


def test_a_checkpoint_of_this_version_loads_without_a_note(tmp_path, capsys):
    load_checkpoint(_checkpoint(tmp_path / "new.ckpt", dbsn.__version__))
    assert "Note:" not in capsys.readouterr().err
    assert version_note("x.ckpt", {VERSION_KEY: dbsn.__version__}) is None
