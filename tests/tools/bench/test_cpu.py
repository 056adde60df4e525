"""The CPU benchmark (`python -m dbsn.tools.bench`, docs/performance.md; dbsn.tools.bench.cpu): the
segmentation cases report every case, and the step, machine-fraction and pipeline measurements run.
"""

from __future__ import annotations

import pytest

from dbsn.tools.bench.cpu import SEG_CASES, run_segmentation


@pytest.mark.slow
def test_segmentation_bench_reports_every_case():
    small = {"first_channels": 8, "growth": 4, "num_down": 2}
    result = run_segmentation(size=(36, 50), repeats=1, device="cpu", memory=False, net_kwargs=small)
    assert set(result["images_per_second"]) == set(SEG_CASES)
    assert all(rate > 0 for rate in result["images_per_second"].values())
    # S = 100 costs more than S = 1 for the same network
    assert result["images_per_second"]["dbsn_seg_s100"] < result["images_per_second"]["dbsn_seg_s1"]


def test_chunked_step_and_recalibration_cases_run():
    import torch

    from dbsn.tools.bench.cpu import build_case

    device = torch.device("cpu")
    build_case("dbsn_t4_chunked", "quick", 4, device, 2)()
    recalibrate = build_case("recal_100", "quick", 4, device, 25)
    recalibrate()
    alpha, statistics = recalibrate.method._members
    assert alpha.shape[0] == 100 and all(mean.shape[0] == 100 for mean, _ in statistics.values())


def test_machine_fraction_counts_a_matmuls_flops():
    """A step that is one n x n x n matmul does 2 n^3 FLOPs; its fraction of the machine's matmul
    FLOP/s is those FLOPs over the given time over the measured peak."""
    import torch

    from dbsn.tools.bench.cpu import machine_fraction

    a = torch.randn(256, 256)
    result = machine_fraction(lambda: a @ a, 0.5, torch.device("cpu"), matmul_size=256)
    assert result["flops_per_step"] == 2 * 256**3
    assert result["flops_per_second"] == 2 * 256**3 / 0.5
    assert abs(result["fraction"] - result["flops_per_second"] / result["matmul_flops_per_second"]) < 1e-12


def test_pipeline_rates_time_both_input_paths():
    import torch

    from dbsn.tools.bench.cpu import pipeline_rates

    rates = pipeline_rates(torch.device("cpu"), n_images=512, batch=64)
    assert set(rates) == {"dataloader", "on_device"} and all(r > 0 for r in rates.values())


@pytest.mark.slow
def test_the_cpu_suite_times_every_case_and_says_how_far_it_is(capsys):
    """`make bench` end to end on the tiny network (no memory processes, no compiled cases, no
    pipeline): a median for every case, the ratios from them, and progress lines on stderr
    (a log file, not a terminal, under pytest)."""
    from dbsn.tools.bench import cpu

    result = cpu.run(
        "tiny", batch=2, repeats=1, memory=False, compiled=False, pipeline_images=0, statistics_examples=300
    )
    assert result["statistics"]["examples"] == 300 and result["statistics"]["test_pass_seconds"] > 0
    assert set(result["seconds"]) == set(cpu.CASES) and all(s > 0 for s in result["seconds"].values())
    ratio = result["ratios"]["dbsn_t1 / map_fixed (target <= 1.10)"]
    assert ratio == result["seconds"]["dbsn_t1"] / result["seconds"]["map_fixed"]
    err = capsys.readouterr().err
    assert f"bench: build and warm up: started, {len(cpu.CASES)} steps" in err
    assert f"bench: timed steps: done, {len(cpu.CASES)} steps" in err
