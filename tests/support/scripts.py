"""The one way tests start the project's scripts (train.py, evaluate.py, `python -m ...`,
`python -c ...`) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.configs import ROOT

# What a subprocess needs to import `tests.support` (the callbacks in cluster_probe.py and
# grad_probe.py, named by `+callbacks.<name>._target_=tests.support....`), in every process it
# starts (DDP ranks, SLURM jobs) too.
SUPPORT_ON_PATH = {"PYTHONPATH": str(ROOT)}


def run_python(
    *args, cwd=None, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """`python *args` (e.g. `ROOT / "train.py", "model=map"`) in `cwd`, with this process's
    environment plus unbuffered output plus `env`, its output captured as text. With `check`,
    a non-zero exit fails the test with the tails of stdout and stderr."""
    done = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def assert_one_line(result: subprocess.CompletedProcess, *phrases: str, status: int = 2) -> str:
    """A refused command: exit `status`, no traceback, exactly one `Error: ...` line on stderr that
    holds every phrase; returns that line."""
    output = result.stdout + result.stderr
    assert result.returncode == status, output[-3000:]
    assert "Traceback" not in output and "Error executing job" not in output, output[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def digests(folder) -> dict[str, str]:
    """sha256 of every file under `folder` (hidden ones too), by relative path: a folder's bytes."""
    import hashlib
    from pathlib import Path

    folder = Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
