"""The lint and format gate: ruff check and ruff format --check pass on the whole repository.

Settings live in pyproject.toml ([tool.ruff]); `make lint` runs the same two commands. After a merge,
`ruff check --fix . && ruff format .` repairs what is mechanical.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def ruff_available():
    if _ruff("--version").returncode != 0:
        pytest.skip("ruff is not installed in this environment (it is in the dev extra: pip install -e '.[dev]')")


def test_ruff_check_passes(ruff_available):
    out = _ruff("check", "--output-format", "concise", ".")
    assert out.returncode == 0, "ruff check found:\n" + out.stdout + out.stderr


def test_ruff_format_check_passes(ruff_available):
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, "ruff format --check would reformat:\n" + out.stdout + out.stderr
