"""Tests of the tau and beta schedules against the paper's and the research code's formulas."""

import math

import pytest

from dbsn.structure.schedules import BetaSchedule, TauSchedule


def test_tau_schedule_paper_setting():
    tau = TauSchedule()
    assert tau(0) == 3.0
    assert tau(20_000) == pytest.approx(3.0 * math.exp(-0.3))
    values = [tau(t) for t in range(0, 200_000, 250)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    # 3 exp(-1.5e-5 t) = 1 at t = ln 3 / 1.5e-5 = 73240.8: tau is 1 from step 73241 on
    crossing = math.log(3.0) / 1.5e-5
    assert 73_240 < crossing < 73_241
    assert tau(73_240) > 1.0
    assert tau(73_241) == 1.0
    assert tau(10**7) == 1.0


def test_tau_schedule_is_configurable():
    tau = TauSchedule(initial=2.0, decay=2e-5, minimum=0.5)
    assert tau(0) == 2.0
    assert tau(10_000) == pytest.approx(2.0 * math.exp(-0.2))
    assert tau(10**6) == 0.5


def test_beta_schedule_paper_setting():
    beta = BetaSchedule()
    assert beta(0) == 1.0
    assert beta(1) == pytest.approx(0.99)
    assert beta(50) == pytest.approx(0.5)
    assert beta(100) == 0.5
    # the research code's max(1.01 - 0.01 * epoch, 0.5) with 1-based epochs
    for epoch in range(120):
        assert beta(epoch) == pytest.approx(max(1.01 - 0.01 * (epoch + 1), 0.5))


def test_beta_schedule_constant_for_dbsn_star():
    beta = BetaSchedule(start=1.0, end=1.0, decay_per_epoch=0.0)
    assert {beta(e) for e in range(100)} == {1.0}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"minimum": 0.0},
        {"minimum": -1.0},
        {"initial": 0.5, "minimum": 1.0},
        {"decay": -1e-5},
    ],
)
def test_tau_schedule_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        TauSchedule(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"end": 0.0},
        {"end": -0.5},
        {"start": 0.5, "end": 0.8},
        {"decay_per_epoch": -0.01},
    ],
)
def test_beta_schedule_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        BetaSchedule(**kwargs)


def test_negative_step_or_epoch_raises():
    with pytest.raises(ValueError):
        TauSchedule()(-1)
    with pytest.raises(ValueError):
        BetaSchedule()(-1)


def test_schedules_instantiate_from_hydra_config():
    instantiate = pytest.importorskip("hydra.utils").instantiate
    tau = instantiate({"_target_": "dbsn.structure.schedules.TauSchedule", "decay": 2e-5})
    beta = instantiate({"_target_": "dbsn.structure.schedules.BetaSchedule", "decay_per_epoch": 0.001})
    assert tau == TauSchedule(decay=2e-5)
    assert beta(100) == pytest.approx(0.9)


def test_camvid_tau_reaches_one_where_the_research_codes_step_count_did(tmp_path):
    """The research code decays τ by 2e-5 per optimiser step at batch 3 (τ = 1 at step 54,931,
    epoch ~450 of 850 with 366 images per epoch); counted in examples / 64 the config must put
    τ = 1 at the same epoch."""
    from hydra.utils import instantiate

    from dbsn.structure.schedules import REFERENCE_BATCH
    from tests.support.configs import compose_config

    cfg = compose_config("train", ["experiment=camvid_paper"], tmp_path)
    tau = instantiate(cfg.model.tau)
    examples_per_epoch = (367 // cfg.data.batch_size) * cfg.data.batch_size
    steps_to_one = math.log(3) / 2e-5
    epoch = steps_to_one / (367 // cfg.data.batch_size)
    assert 440 < epoch < 460
    assert tau(examples_per_epoch * (epoch - 2) / REFERENCE_BATCH) > 1.0
    assert tau(examples_per_epoch * (epoch + 2) / REFERENCE_BATCH) == 1.0
