"""The GPU benchmark suite (dbsn.tools.bench.gpu), end to end on the CPU."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_gpu_suite_runs_every_configuration_and_prints_its_table(monkeypatch, tmp_path):
    """The GPU suite end to end on the CPU, small: every configuration x {grouped, chunked} gets a
    row, the projection is 100 epochs of steps plus the test pass, results accumulate in the JSON
    file over calls. On a CPU bf16 + channels-last may be refused (wrong oneDNN gradients on some), so the
    compiled configurations run in float32 here, with the aot_eager backend (no C++ build)."""
    import json

    from dbsn.tools import bench
    from dbsn.tools.bench import gpu as bench_gpu

    configs = {**bench_gpu.CONFIGS, "bf16 + channels-last + compile": ("fp32", True, "default")}
    monkeypatch.setattr(bench_gpu, "CONFIGS", configs)
    out = tmp_path / "suite.json"
    common = ["--suite", "gpu", "--net", "tiny", "--batch", "4", "--steps", "2", "--device", "cpu",
              "--compile-backend", "aot_eager", "--json", str(out), "--segmentation", "no", "--prediction-batch", "1"]
    bench.main([*common, "--configs", "fp32 eager"])
    first = json.loads(out.read_text())
    assert set(first["training"]) == {"fp32 eager | grouped", "fp32 eager | chunked"}
    result = bench.main([*common, "--configs", "fp32 eager,bf16,bf16 + channels-last,bf16 + channels-last + compile"])
    rows = result["training"]
    assert rows["fp32 eager | grouped"] == first["training"]["fp32 eager | grouped"]  # kept, not re-measured
    for key in ("fp32 eager | grouped", "bf16 | chunked", "bf16 + channels-last + compile | grouped",
                "bf16 + channels-last + compile | chunked"):
        row = rows[key]
        assert "error" not in row, (key, row)
        steps = 100 * (50_000 // 4)
        test = 10_000 / result["prediction_images_per_second"][key.split(" | ")[0]]
        assert abs(row["projected_hours_100_epochs"] - (steps * row["seconds_per_step"] + test) / 3600) < 1e-9
        flops = result["flops_per_step"][key.split(" | ")[1]]
        precision = "bf16" if key.startswith("bf16 |") else "fp32"
        assert abs(row["fraction_of_matmul_peak"] - flops / row["seconds_per_step"] / result["matmul_flops_per_second"][precision]) < 1e-9
    from dbsn.precision import cpu_bf16_channels_last_is_wrong

    if cpu_bf16_channels_last_is_wrong():  # some CPUs compute those gradients wrongly, others not
        assert rows["bf16 + channels-last | grouped"]["error"].startswith("refused on this CPU")
    table = bench_gpu.markdown(result)
    assert table.count("| bf16 + channels-last + compile | grouped |") == 1 and "100 epochs (h)" in table
