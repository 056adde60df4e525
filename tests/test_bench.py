"""The benchmark's segmentation cases run and report what the README quotes."""

from __future__ import annotations

import pytest

from dbsn.bench import SEG_CASES, run_segmentation


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

    from dbsn.bench import build_case

    device = torch.device("cpu")
    build_case("dbsn_t4_chunked", "quick", 4, device, 2)()
    recalibrate = build_case("recal_100", "quick", 4, device, 25)
    recalibrate()
    alpha, statistics = recalibrate.method._members
    assert alpha.shape[0] == 100 and all(mean.shape[0] == 100 for mean, _ in statistics.values())
