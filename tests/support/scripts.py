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


def run_python(*args, cwd=None, env: dict[str, str] | None = None, timeout: float = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """`python *args` (e.g. `ROOT / "train.py", "model=map"`) in `cwd`, with this process's
    environment plus unbuffered output plus `env`, its output captured as text. With `check`,
    a non-zero exit fails the test with the tails of stdout and stderr."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done
