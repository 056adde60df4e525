"""Several runs in one process (dbsn.runtime.group): each equals its solo run, bit for bit on the CPU
(the stand-in for a GPU's streams), in its own folder; a run that fails leaves the others alone; a
sweep asks for it with `hydra.launcher.runs_per_process`.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

from dbsn.runtime.config import ConfigError
from dbsn.runtime.group import train_group
from dbsn.runtime.run import train
from dbsn.runtime.turns import check_group, runs_per_process
from tests.support.configs import ROOT, TINY, compose_config
from tests.support.scripts import run_python

pytestmark = pytest.mark.slow

# 32 digits in 2 batches, 2 epochs: 4 steps, an epoch-end checkpoint in the middle; S = 2 at the test
RUN = [
    "data=digits",
    "data.train_subset=32",
    "data.batch_size=16",
    "data.eval_batch_size=150",
    *TINY,
    "model.prediction.n_samples=2",
    "trainer.max_epochs=2",
    "callbacks.structure_posterior.save_figures=false",
    "callbacks.structure_posterior.n_samples=10",
    "statistics.resamples=20",
]


class Boom(pl.Callback):
    """Fails its run at the end of its second training batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == 0 and batch_idx == 1:
            raise RuntimeError("boom at the second batch")


SEED = {0: ["seed=0"], 1: ["seed=1", "test=false"]}


def _cfg(folder, *extra):
    return compose_config("train", [*RUN, *extra], folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Seeds 0 and 1 alone, then together with a run that fails between them, in one process. Seed 1
    trains only (test=false): the runs of a group need not share their settings."""
    root = tmp_path_factory.mktemp("group")
    with pytest.MonkeyPatch.context() as patch:  # the test's figures unrendered (2 s a run): numbers only
        patch.setattr("dbsn.evaluation.results.save_figure", lambda fig, path: path.touch() or path)
        solo = {seed: train(_cfg(root / f"solo{seed}", *SEED[seed]), root / f"solo{seed}") for seed in (0, 1)}
        folders = [root / "g0", root / "boom", root / "g1"]
        cfgs = [_cfg(folders[0], *SEED[0]), _cfg(folders[1], "seed=5", f"+callbacks.boom._target_={__name__}.Boom")]
        cfgs.append(_cfg(folders[2], *SEED[1]))
        turns: list[int] = []
        with pytest.raises(RuntimeError, match="boom at the second batch") as raised:
            train_group(cfgs, folders, turns=turns)
    return root, solo, turns, raised.value


def _state(folder) -> dict:
    return torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


def _equal_states(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _metrics(folder) -> str:
    """metrics.json's numbers, as text (NaN equals NaN)."""
    return json.dumps(json.loads((folder / "metrics.json").read_text())["metrics"], sort_keys=True)


def test_two_runs_in_one_process_equal_their_solo_runs_each_in_its_own_folder(runs):
    root, solo, turns, _ = runs
    assert _metrics(root / "g0") == _metrics(root / "solo0")
    assert json.loads(_metrics(root / "g0")) == pytest.approx(solo[0], abs=0)
    assert json.loads((root / "g0" / "metrics.json").read_text())["seed"] == 0
    for seed in (0, 1):
        grouped = root / f"g{seed}"
        assert _equal_states(_state(grouped), _state(root / f"solo{seed}"))
        assert json.loads((grouped / "run.json").read_text())["status"] == "finished"
    assert not _equal_states(_state(root / "g0"), _state(root / "g1"))  # two seeds, two runs
    # the runs took turns, a batch each: 0, the failing run, 1, 0, the failing run's last; then 1 and 0 alternate
    assert turns[:5] == [0, 1, 2, 0, 1], turns
    assert turns[5:9] == [2, 0, 2, 0], turns


def test_a_run_that_fails_does_not_stop_or_change_the_others(runs):
    root, _, turns, error = runs
    assert str(error) == "boom at the second batch"
    record = json.loads((root / "boom" / "run.json").read_text())
    assert record["status"] == "failed" and "boom at the second batch" in record["history"][-1]["error"]
    assert not (root / "boom" / "metrics.json").exists()
    assert turns.count(1) == 2  # its two batches' turns, then out of the rotation
    assert all(json.loads((root / f"g{s}" / "run.json").read_text())["status"] == "finished" for s in (0, 1))


def test_a_sweep_trains_its_jobs_together_with_runs_per_process(runs, tmp_path):
    """`-m seed=0,1 hydra.launcher.runs_per_process=2` through train.py: two run folders, each with its
    own Hydra files and log, whose training ended where the solo runs' did (test=false: the fit only)."""
    root = runs[0]
    sweep = tmp_path / "sweep"
    run_python(
        ROOT / "train.py",
        "-m",
        *RUN,
        "test=false",
        "seed=0,1",
        "hydra.launcher.runs_per_process=2",
        f"hydra.sweep.dir={sweep}",
        env={"OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    for seed in (0, 1):
        job = sweep / str(seed)
        assert _equal_states(_state(job), _state(root / f"solo{seed}"))
        assert OmegaConf.load(job / ".hydra" / "overrides.yaml")[-1] == f"seed={seed}"
        assert OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.job.num == seed
        log = (job / "train.log").read_text()
        assert f"Seed set to {seed}" in log and f"Seed set to {1 - seed}" not in log, log
        assert json.loads((job / "run.json").read_text())["status"] == "finished"


def test_a_group_is_refused_in_one_line_where_it_cannot_run(tmp_path):
    for value in (0, -1, 1.5, "4", True):
        with pytest.raises(ConfigError, match=r"runs_per_process=.*whole number of at least 1") as raised:
            runs_per_process(value)
        assert "\n" not in str(raised.value)
    assert runs_per_process(3) == 3
    one = _cfg(tmp_path / "a", "seed=0")
    ddp = _cfg(tmp_path / "b", "trainer.devices=2")
    with pytest.raises(ConfigError, match=r"run #1 of the group: trainer.devices=2.*DDP runs one per process"):
        check_group([one, ddp], [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ConfigError, match="would both run in"):
        check_group([one, one], [tmp_path / "a", tmp_path / "a"])
    wandb = _cfg(tmp_path / "c", "logger=wandb")
    with pytest.raises(
        ConfigError, match=r"run #1 of the group: logger=wandb: W&B keeps one run per process"
    ) as raised:
        check_group([one, wandb], [tmp_path / "a", tmp_path / "c"])
    assert "\n" not in str(raised.value)
    # on SLURM: not yet, refused before anything is composed or submitted
    from types import SimpleNamespace

    from dbsn.runtime.cluster import submit_sweep

    slurm = SimpleNamespace(config=None, params={"runs_per_process": 2})
    with pytest.raises(ConfigError, match=r"runs_per_process=2: .*local launcher only.*Nothing was submitted"):
        submit_sweep(slurm, [["seed=0"], ["seed=1"]], 0)


def test_a_hand_over_puts_back_the_switches_a_trainer_sets():
    """cuDNN's benchmark, deterministic algorithms, the matmul precision, the default dtype and the
    warning filters are one per process: each run gets back its own at its turn."""
    import warnings

    from dbsn.runtime.turns import ProcessState

    mine = ProcessState.capture()
    try:
        torch.backends.cudnn.benchmark = not mine.switches[0]
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("medium")
        torch.set_default_dtype(torch.float64)
        warnings.simplefilter("ignore", UserWarning)
        theirs = ProcessState.capture()
        assert theirs.switches != mine.switches and theirs.warning_filters != mine.warning_filters
        mine.restore()
        assert ProcessState.capture().switches == mine.switches and warnings.filters == mine.warning_filters
        theirs.restore()
        assert torch.get_default_dtype() == torch.float64 and torch.are_deterministic_algorithms_enabled()
    finally:
        mine.restore()


def test_a_signal_reaches_every_run_of_the_group(tmp_path, capfd):
    """SIGTERM to the process of a group: the main thread's handler asks every run under way to stop
    (each leaves as `RunInterrupted`, resumable alone), and the handlers are put back afterwards."""
    import os
    import signal
    import time

    from dbsn.runtime.errors import RunInterrupted
    from dbsn.runtime.signals import current_watch, interruptible
    from dbsn.runtime.turns import run_group, turn_callbacks

    asked: dict[int, int | None] = {}

    @interruptible
    def run(index, folder):
        watch = current_watch()[0]
        turn_callbacks()[0].on_train_batch_end(None, None, None, None, 0)  # both runs are under way now
        if index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while watch.interruptions.signum is None and time.monotonic() < deadline:
            time.sleep(0.01)
        asked[index] = watch.interruptions.signum
        raise watch.interruptions.interrupted()

    before = signal.getsignal(signal.SIGTERM)
    outcomes = run_group([lambda i=i: run(i, tmp_path / str(i)) for i in range(2)])
    assert asked == {0: signal.SIGTERM, 1: signal.SIGTERM}
    assert [type(o.error) for o in outcomes] == [RunInterrupted, RunInterrupted]
    assert all(
        o.error.signum == signal.SIGTERM and o.error.run_dir == tmp_path / str(i) for i, o in enumerate(outcomes)
    )
    assert "SIGTERM received: every run of the group stops after its batch" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs on streams need a CUDA device")
def test_on_a_gpu_graphed_runs_of_a_group_equal_their_solo_runs(tmp_path):
    """Each run's CUDA graph replays on its own stream with its own generator state: the grouped runs
    end where their solo runs end (to the GPU's own run-to-run noise: atomics in cuDNN's backward), and
    the two seeds far apart from each other. 4 batches, 2 epochs: graphs captured after 3 eager steps."""
    gpu = [o for o in RUN if not o.startswith(("trainer.accelerator", "data.train_subset"))]
    gpu += ["trainer.accelerator=gpu", "trainer.devices=1", "data.train_subset=64", "model.execution.cuda_graph=true"]

    def cfg(folder, seed):
        return compose_config("train", [*gpu, f"seed={seed}", "test=false"], folder)

    for seed in (0, 1):
        train(cfg(tmp_path / f"solo{seed}", seed), tmp_path / f"solo{seed}")
    turns: list[int] = []
    folders = [tmp_path / "g0", tmp_path / "g1"]
    train_group([cfg(folders[0], 0), cfg(folders[1], 1)], folders, turns=turns)
    assert turns[:4] == [0, 1, 0, 1]

    def close(a, b) -> bool:
        return all(torch.allclose(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-4) for k in a)

    for seed in (0, 1):
        assert close(_state(tmp_path / f"g{seed}"), _state(tmp_path / f"solo{seed}")), seed
    assert not close(_state(tmp_path / "solo0"), _state(tmp_path / "solo1"))
