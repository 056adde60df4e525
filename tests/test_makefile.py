"""The Makefile's targets that choose something: `make evaluate` takes the newest run with a checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.support.configs import ROOT


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_evaluate_takes_the_newest_run_that_has_a_checkpoint(tmp_path):
    """A newer folder without a checkpoint (a start that stopped early) is passed over."""
    runs = tmp_path / "outputs" / "quick" / "runs"
    trained, stopped = runs / "2026-01-01_00-00-00", runs / "2026-01-02_00-00-00"
    (trained / "checkpoints").mkdir(parents=True)
    (trained / "checkpoints" / "last.ckpt").write_bytes(b"x")
    stopped.mkdir()
    (stopped / "train.log").write_text("refused")
    os.utime(trained, (time.time() - 60, time.time() - 60))
    for name in ("pyproject.toml", "constraints.txt"):  # the environment's stamp, up to date: nothing installed
        (tmp_path / name).write_text("")
        os.utime(tmp_path / name, (time.time() - 60, time.time() - 60))
    (tmp_path / "stamp").write_text("")

    def make() -> subprocess.CompletedProcess:  # evaluate.py's command echoed, not run
        return subprocess.run(
            ["make", "-s", "-f", str(ROOT / "Makefile"), "evaluate", "PY=echo", "STAMP=stamp"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = make()
    assert (
        done.returncode == 0
        and f"ckpt_path={trained}/checkpoints/last.ckpt".replace(str(tmp_path) + "/", "") in done.stdout
    )
    shutil.rmtree(trained)
    done = make()
    assert done.returncode != 0 and "No make-train run with a checkpoint" in done.stdout
