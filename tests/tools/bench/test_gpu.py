"""The GPU benchmark suite (dbsn.tools.bench.gpu), end to end on the CPU."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_gpu_suite_runs_every_configuration_and_prints_its_table(tmp_path):
    """The GPU suite end to end on the CPU, small: every configuration gets a row (the CUDA-graph
    ones say they need a GPU), the projection is 100 epochs of steps plus the test pass, results
    accumulate in the JSON file over calls; the compiled cells run with dynamo's eager backend (the
    same graphs, no C++ build, no AOT trace)."""
    import json

    from dbsn.tools import bench
    from dbsn.tools.bench import gpu as bench_gpu

    out = tmp_path / "suite.json"
    common = [
        "--suite",
        "gpu",
        "--net",
        "tiny",
        "--batch",
        "4",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--compile-backend",
        "eager",
        "--json",
        str(out),
        "--prediction-batch",
        "1",
    ]
    bench.main([*common, "--configs", "fp32 eager per-edge"])
    first = json.loads(out.read_text())
    assert set(first["training"]) == {"fp32 eager per-edge | grouped"}
    result = bench.main([*common, "--configs", ",".join(bench_gpu.CONFIGS)])
    rows = result["training"]
    assert rows["fp32 eager per-edge | grouped"] == first["training"]["fp32 eager per-edge | grouped"]  # kept
    for name, (precision, cell, mode) in bench_gpu.CONFIGS.items():
        row = rows[f"{name} | grouped"]
        if mode == "graph":
            assert row == {"error": "needs a CUDA device"}
            continue
        assert "error" not in row, (name, row)
        steps = 100 * (50_000 // 4)
        rate = result["prediction_images_per_second"].get(name)
        test = 10_000 / rate if rate else 0.0
        assert abs(row["projected_hours_100_epochs"] - (steps * row["seconds_per_step"] + test) / 3600) < 1e-9
        flops = result["flops_per_step"]["grouped"]
        assert (
            abs(
                row["fraction_of_matmul_peak"]
                - flops / row["seconds_per_step"] / result["matmul_flops_per_second"][precision]
            )
            < 1e-9
        )
    table = bench_gpu.markdown(result)
    assert table.count("| bf16 eager fused | grouped |") == 1 and "100 epochs (h)" in table
    assert "| bf16 fused + CUDA graph | grouped | needs a CUDA device |" in table
