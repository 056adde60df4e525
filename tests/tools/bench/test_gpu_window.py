"""The GPU window's parts (dbsn.tools.bench.window) and its script (tools/gpu_window.sh) on the CPU,
tiny: every part writes its JSON, the parts that need CUDA say so, the summary has every table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dbsn.tools import bench
from dbsn.tools.bench import window

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--suite", "gpu", "--device", "cpu", "--tiny", "--compile-backend", "eager"]


def test_each_part_runs_on_a_cpu_and_the_summary_holds_its_tables(tmp_path):
    out = ["--out", str(tmp_path)]
    for part in window.PARTS:
        bench.main([*TINY, *out, "--part", part])
    bench.main([*TINY, *out, "--part", "compile", "--cache", str(tmp_path / "compile_cache.bin")])
    results = {name: json.loads((tmp_path / f"gpu_{name}.json").read_text())
               for name in (*window.PARTS, "compile_warm")}
    assert results["profile"]["skipped"] == results["streams"]["skipped"] == "no CUDA"
    forms = results["forms"]
    assert set(forms["eager"]) == set(forms["compiled"]) == set(window.micro_cases(2, 4))
    assert all("ms_fwd_bwd" in row for table in ("eager", "compiled") for row in forms[table].values())
    steps = forms["steps"]
    assert len(steps) == len(window.STEP_FORMS) and steps["conv_1x1=conv depthwise=conv"]["ms_per_step"] > 0
    available = window.forms_available() is None
    assert all(("ms_per_step" in row) == available or key.endswith("=conv depthwise=conv")
               for key, row in steps.items())
    compiled = results["compile"]
    if window.nodes_compile_available() is None:
        assert compiled["graphs"] >= 1 and compiled["recompiles"] == 0 and compiled["ms_per_step"] > 0
    else:
        assert compiled["error"].startswith("compile.scope=nodes not available")
    bench.main(["--suite", "gpu", "--part", "summary", *out])
    text = (tmp_path / "summary.md").read_text()
    for heading in ("## Profile", "## Convolution forms", "## Nodes-only compile", "## CUDA graphs on streams"):
        assert heading in text
    assert "| 1x1 bmm |" in text and "| conv_1x1=conv depthwise=conv |" in text and "skipped: no CUDA" in text


def test_the_fastest_forms_come_from_the_forms_part(tmp_path):
    result = {"steps": {"conv_1x1=conv depthwise=conv": {"ms_per_step": 3.0},
                        "conv_1x1=bmm depthwise=stencil": {"ms_per_step": 2.0},
                        "conv_1x1=mulsum depthwise=conv": {"error": "x"}},
              "compiled": {"1x1 conv NCHW": {"ms_fwd_bwd": 2.0}, "1x1 bmm": {"ms_fwd_bwd": 3.0},
                           "1x1 mulsum": {"ms_fwd_bwd": 1.0}, "depthwise dil 1 conv NCHW": {"ms_fwd_bwd": 1.0},
                           "depthwise dil 2 conv NCHW": {"ms_fwd_bwd": 1.0},
                           "depthwise dil 1 stencil": {"ms_fwd_bwd": 0.5},
                           "depthwise dil 2 stencil": {"ms_fwd_bwd": 2.0}}}
    assert window.fastest_forms(tmp_path, compiled=False) is None
    (tmp_path / "gpu_forms.json").write_text(json.dumps(result))
    assert window.fastest_forms(tmp_path, compiled=False) == ("bmm", "stencil")
    assert window.fastest_forms(tmp_path, compiled=True) == ("mulsum", "conv")  # 2.0 against 2.5 over both dilations


@pytest.mark.slow
def test_the_window_script_runs_every_part_on_a_cpu(tmp_path):
    """tools/gpu_window.sh on the CPU stand-in: each part's exit status, log and JSON, the summary;
    results under $OUT (two parts, one that runs and one that needs CUDA: each is a process of its
    own, whose start dominates here; the parts themselves are the test above)."""
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable, "PARTS": "forms streams"}
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_window.sh"), "--device", "cpu", "--tiny",
                           "--compile-backend", "eager"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rc.txt").read_text().split() == ["forms=0", "streams=0"]
    for name in ("forms", "streams"):
        assert json.loads((tmp_path / f"gpu_{name}.json").read_text())["finished"]
        assert "done" in (tmp_path / f"{name}.log").read_text()
    assert "## Convolution forms" in (tmp_path / "summary.md").read_text()
    assert "streams: skipped: no CUDA" in done.stdout


def test_kernels_count_under_the_range_that_encloses_their_operation():
    """`kernels_by_category` on a profiler's event tree: a kernel counts for the nearest enclosing
    ``bench::`` range; one outside every range is unattributed."""
    from types import SimpleNamespace as Event

    from dbsn.tools.bench.categories import kernels_by_category

    def kernel(us):
        return Event(name="k", device=0, duration=us)

    outer = Event(name="bench::casts", kernels=[], cpu_parent=None)
    op = Event(name="aten::_to_copy", kernels=[kernel(1000), kernel(500)], cpu_parent=outer)
    inner = Event(name="aten::copy_", kernels=[kernel(250)], cpu_parent=op)
    stray = Event(name="aten::add", kernels=[kernel(100)], cpu_parent=None)
    table = kernels_by_category([outer, op, inner, stray])
    assert table == {"casts": {"count": 3, "ms": 1.75}, "unattributed": {"count": 1, "ms": 0.1}}
