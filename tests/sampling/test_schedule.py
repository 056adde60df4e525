"""The cyclical schedule (dbsn.sampling.CyclicalSchedule): the cosine step size of Eq. 1, the cycles
that partition the run, the exploration and sampling stages, and exactly `samples_per_cycle` kept
steps per cycle; the authors' CIFAR recipe step for step."""

from __future__ import annotations

import math

import pytest

from dbsn.sampling import CyclicalSchedule


def test_cycles_partition_the_run_and_restart_the_cosine():
    schedule = CyclicalSchedule(cycles=4, exploration=0.5, samples_per_cycle=1)
    total = 10  # not a multiple of M: cycles of 2, 3, 2, 3 steps
    bounds = [schedule.bounds(c, total) for c in range(4)]
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert [schedule.cycle(k, total) for k in range(total)] == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    for start, end in bounds:
        length = end - start
        assert [schedule.lr_factor(k, total) for k in range(start, end)] == pytest.approx(
            [(math.cos(math.pi * j / length) + 1) / 2 for j in range(length)]
        )
        assert schedule.lr_factor(start, total) == 1.0  # a warm restart at every cycle's first step
    with pytest.raises(ValueError, match="step 10 is outside the schedule's 10 steps"):
        schedule.cycle(10, total)


def test_noise_only_in_the_sampling_stage():
    total = 400
    for exploration, first_noisy in ((0.9, 90), (0.25, 25), (0.0, 0), (1.0, None)):
        schedule = CyclicalSchedule(cycles=4, exploration=exploration)
        for c in range(4):
            noisy = [k - 100 * c for k in range(100 * c, 100 * (c + 1)) if schedule.sampling(k, total)]
            assert noisy == ([] if first_noisy is None else list(range(first_noisy, 100))), exploration


def test_exactly_samples_per_cycle_kept_at_the_end_of_every_cycle():
    schedule = CyclicalSchedule(cycles=3, exploration=0.7, samples_per_cycle=3, sample_spacing=0.1)
    total = 301  # cycles of 100, 100, 101 steps
    kept = [k for k in range(total) if schedule.keeps(k, total)]
    assert kept == [79, 89, 99, 179, 189, 199, 280, 290, 300]  # after positions 0.8, 0.9 and 1 of each cycle
    assert kept == [k for c in range(3) for k in schedule.sample_steps(c, total)]
    assert all(schedule.sampling(k, total) for k in kept) and schedule.kept == 9


def test_the_authors_cifar_recipe_step_for_step():
    """cifar_csghmc.py: 200 epochs of 782 batches (50,000 / 64), M = 4, lr_0 = 0.5 * (cos(pi * (k mod
    T // M) / (T // M)) + 1) at iteration k (their counter with 782 batches per epoch; theirs counts
    N / B + 1 = 782.25, a float, which moves each restart by under one step), noise when
    `epoch % 50 + 1 > 45`, the network saved after every epoch with `epoch % 50 + 1 > 47`."""
    batches, epochs, cycles = 782, 200, 4
    total = epochs * batches
    schedule = CyclicalSchedule()  # the defaults are their recipe
    assert (schedule.cycles, schedule.exploration, schedule.samples_per_cycle, schedule.sample_spacing) == (
        4,
        0.9,
        3,
        0.02,
    )
    length = total // cycles
    for epoch in (0, 3, 44, 45, 47, 49, 50, 95, 99, 100, 149, 150, 199):
        for batch in (0, 1, 390, 781):
            k = epoch * batches + batch
            theirs = 0.5 * (math.cos(math.pi * (k % length) / length) + 1)
            assert schedule.lr_factor(k, total) == pytest.approx(theirs, rel=1e-12, abs=1e-15)
            assert schedule.sampling(k, total) == (epoch % 50 + 1 > 45)
    kept = [k for k in range(total) if schedule.keeps(k, total)]
    saved_after = [epoch for epoch in range(epochs) if epoch % 50 + 1 > 47]
    assert kept == [(epoch + 1) * batches - 1 for epoch in saved_after]  # the last step of each saving epoch
    assert len(kept) == 12


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(cycles=0), "cycles"),
        (dict(exploration=1.5), "exploration"),
        (dict(samples_per_cycle=0), "samples_per_cycle"),
        (dict(samples_per_cycle=3, sample_spacing=0.5), "sample_spacing"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        CyclicalSchedule(**settings)


def test_a_short_run_keeps_its_samples_a_step_apart_and_a_shorter_one_is_refused():
    schedule = CyclicalSchedule(cycles=4)  # 3 samples 0.02 of a cycle apart: less than a step in cycles of 10
    assert schedule.sample_steps(1, 40) == [17, 18, 19]
    schedule.check(12)  # cycles of 3 steps: a sample after each
    for total in (3, 11):
        with pytest.raises(ValueError, match=f"a run of {total} steps in 4 cycles cannot keep 3 samples"):
            schedule.check(total)
