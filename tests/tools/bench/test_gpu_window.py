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
    results = {
        name: json.loads((tmp_path / f"gpu_{name}.json").read_text()) for name in (*window.PARTS, "compile_warm")
    }
    assert results["profile"]["skipped"] == results["streams"]["skipped"] == "no CUDA"
    forms = results["forms"]
    assert set(forms["eager"]) == set(forms["compiled"]) == set(window.micro_cases(2, 4))
    assert all("ms_fwd_bwd" in row for table in ("eager", "compiled") for row in forms[table].values())
    steps = forms["steps"]
    assert len(steps) == len(window.STEP_FORMS) and steps["conv_1x1=conv depthwise=conv"]["ms_per_step"] > 0
    available = window.forms_available() is None
    assert all(
        ("ms_per_step" in row) == available or key.endswith("=conv depthwise=conv") for key, row in steps.items()
    )
    if available:
        used = steps["conv_1x1=bmm depthwise=stencil"]["forms"]  # every stacked 1x1 has its depthwise
        assert set(used) == {"bmm", "stencil"} and used["bmm"] == used["stencil"] > 0
    copies = forms["copies"]  # the graphed step with weight_copies, in the default forms and speed=fast's
    assert len(copies) == len(window.COPIES_FORMS) and copies["conv_1x1=conv depthwise=conv"]["ms_per_step"] > 0
    compiled = results["compile"]
    if window.nodes_compile_available() is None:
        assert compiled["graphs"] >= 1 and compiled["recompiles"] == 0 and compiled["ms_per_step"] > 0
    else:
        assert compiled["error"].startswith("compile.scope=nodes not available")
    bench.main(["--suite", "gpu", "--part", "summary", *out])
    text = (tmp_path / "summary.md").read_text()
    for heading in ("## Profile", "## Convolution forms", "## Nodes-only compile", "## CUDA graphs on streams"):
        assert heading in text
    assert "| whole step with weight_copies=true |" in text
    assert "| 1x1 bmm |" in text and "| conv_1x1=conv depthwise=conv |" in text and "skipped: no CUDA" in text


def test_the_fastest_forms_come_from_the_forms_part(tmp_path):
    result = {
        "steps": {
            "conv_1x1=conv depthwise=conv": {"ms_per_step": 3.0},
            "conv_1x1=bmm depthwise=stencil": {"ms_per_step": 2.0},
            "conv_1x1=mulsum depthwise=conv": {"error": "x"},
        },
        "compiled": {
            "1x1 conv NCHW": {"ms_fwd_bwd": 2.0},
            "1x1 bmm": {"ms_fwd_bwd": 3.0},
            "1x1 mulsum": {"ms_fwd_bwd": 1.0},
            "depthwise dil 1 conv NCHW": {"ms_fwd_bwd": 1.0},
            "depthwise dil 2 conv NCHW": {"ms_fwd_bwd": 1.0},
            "depthwise dil 1 stencil": {"ms_fwd_bwd": 0.5},
            "depthwise dil 2 stencil": {"ms_fwd_bwd": 2.0},
        },
    }
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
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_window.sh"), "--device", "cpu", "--tiny", "--compile-backend", "eager"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
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


def test_the_summary_of_a_gpu_window_has_its_headline_and_says_where_a_part_stopped(tmp_path):
    """The summary of results shaped as a GPU writes them (what a CPU cannot produce): the headline's
    fastest rows, each table, a row's error, and a compile stopped by its limit inside a step."""

    def write(name, result):
        (tmp_path / f"gpu_{name}.json").write_text(json.dumps({"date": "2026-12-04", "torch": "t", **result}))

    graphed = {
        "ms_per_step": 197.0,
        "kernels": 15109,
        "kernel_ms": 180.0,
        "by_category": {"cuDNN conv": {"count": 8000, "ms": 90.0}},
    }
    attributed = {
        "kernels": 15000,
        "kernel_ms": 170.0,
        "by_category": {"casts": {"count": 1291, "ms": 10.0}},
        "ops_by_category": {"casts": 1291},
    }
    write(
        "profile", {"steps": {"bf16 fused + CUDA graph": graphed, "eager, kernels by what launched them": attributed}}
    )
    write(
        "forms",
        {
            "steps": {
                "conv_1x1=conv depthwise=conv": {"ms_per_step": 197.0, "kernels": 15109},
                "conv_1x1=bmm depthwise=stencil": {"ms_per_step": 150.0, "kernels": 9000},
            }
        },
    )
    write(
        "compile",
        {
            "conv_1x1": "bmm",
            "depthwise": "stencil",
            "warmup_steps_s": [],
            "step 0 running": {"seconds_so_far": 165.0, "graphs_so_far": 3},
        },
    )
    write(
        "streams",
        {
            "copies": {"run 0": {"generator": "own"}},
            "conv_1x1": "conv",
            "depthwise": "conv",
            "runs": {
                "1": {"serial_ms_per_step_per_run": 197.0, "streams_ms_per_step_per_run": 196.0, "speedup": 1.0},
                "2": {"serial_ms_per_step_per_run": 197.0, "streams_ms_per_step_per_run": 120.0, "speedup": 1.64},
                "3": {"error": "OutOfMemoryError: out"},
            },
        },
    )
    (tmp_path / "nvidia_smi.txt").write_text("name, driver_version\nNVIDIA H200, 580\n")
    text = window.summary(tmp_path)
    assert text.startswith("# GPU window: 2026-12-04 on NVIDIA H200")
    assert "| fused cell + CUDA graph, bf16 (speed=fast) | 197.0 | 15,109 |" in text
    assert "| + the fastest forms, eager in the graph (conv_1x1=bmm depthwise=stencil) | 150.0 | 9,000 |" in text
    assert "| 2 runs, each graph on its own stream (per run) | 120.0 | - |" in text
    assert "| cold | stopped while step 0 running: 165.0 s, 3 graphs so far" in text
    assert "| 3 | OutOfMemoryError: out |" in text and "| casts | 1,291 | 10.00 | 1291 |" in text
    short = window.short_summary(tmp_path)
    assert "compile: stopped while step 0 running" in short and "streams R=3: OutOfMemoryError" in short
