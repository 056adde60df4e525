"""dbsn.tools.compare_parallel: dbsn-compare --tune spread over processes within a budget, joined per backbone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dbsn.runtime.config import ConfigError
from dbsn.tools import compare_parallel as cp


def _option(argv, name):
    return argv[argv.index(name) + 1]


def _without(argv, *names):
    """argv without these options and their values."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in names:
            skip = True
        else:
            out.append(item)
    return out


def _plan(tmp_path, *extra):
    args = cp.parse(
        ["--out", str(tmp_path), "--budget", "100", "--processes", "4", "--cores", "16"]
        + ["--methods", "mimo,deep_ensemble,map_fixed,dbsn", *extra]
    )
    return args, *cp.plan(args, cp.parse_devices(args.device, args.backbones))


def test_the_processes_share_every_setting_but_their_methods_and_folder(tmp_path):
    """A deep ensemble goes with its members' method; DBSN's cell runs once for both backbones of one
    device; every command is the same but for --methods, --out and --backbone; cores / P threads."""
    args, jobs, comparison = _plan(tmp_path, "--device", "cpu", "seed=3")
    assert [j.name for j in jobs] == [
        "structure_net/dbsn",
        "structure_net/map_fixed+deep_ensemble",
        "resnet18/map_fixed+deep_ensemble",
        "structure_net/mimo",
        "resnet18/mimo",
    ]
    assert comparison == {b: ["dbsn", "map_fixed", "deep_ensemble", "mimo"] for b in ("structure_net", "resnet18")}
    assert {j.env["OMP_NUM_THREADS"] for j in jobs} == {"4"}
    assert {tuple(_without(j.argv, "--methods", "--out", "--backbone")) for j in jobs} == {
        tuple(_without(jobs[0].argv, "--methods", "--out", "--backbone"))
    }
    argv = jobs[0].argv
    assert "--tune" in argv and "--resume" not in argv and argv[-2:] == ["trainer=cpu", "seed=3"]
    assert _option(argv, "--epochs") == str(cp.EPOCHS) and _option(argv, "--lr-grid") == "0.025,0.05,0.1,0.2,0.4"
    assert {Path(_option(j.argv, "--out")) for j in jobs} == {j.part for j in jobs}
    assert len({j.part for j in jobs}) == len(jobs)


def test_each_backbone_on_its_own_device_trains_its_own_cell_runs(tmp_path):
    _, jobs, _ = _plan(tmp_path, "--device", "structure_net=cpu,resnet18=gpu")
    assert "resnet18/dbsn" in [j.name for j in jobs]
    assert {j.backbone: j.argv[-1] for j in jobs} == {"structure_net": "trainer=cpu", "resnet18": "trainer=gpu"}


def test_a_method_whose_config_does_not_compose_on_a_backbone_is_left_out_before_anything_runs(tmp_path):
    """The cell network's settings on every method: ResNet-18 has no `num_nodes`, so MAP is left out
    there and named; DBSN (always on cells) and MAP on the cell network run."""
    args = cp.parse(["--out", str(tmp_path), "--budget", "100", "--methods", "dbsn,map", "model.net.num_nodes=3"])
    refused = cp.refused_configs(args)
    assert list(refused) == [("resnet18", "map")] and "num_nodes" in refused[("resnet18", "map")]
    jobs, comparison = cp.plan(args, {"structure_net": "cpu", "resnet18": "cpu"}, refused)
    assert comparison == {"structure_net": ["dbsn", "map"], "resnet18": ["dbsn"]}
    assert [j.name for j in jobs] == ["structure_net/dbsn", "structure_net/map"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "is not auto, cpu, gpu"),
        (["--device", "wrn28_10=gpu"], "is not auto, cpu, gpu"),
        (["trainer=gpu"], "choose the device with --device"),
        (["--budget", "30"], "more than --join-seconds"),
        (["--methods", "dbsn,nope"], "unknown method"),
    ],
)
def test_mistakes_are_refused_in_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        args = cp.parse(["--out", str(tmp_path), "--budget", "100", *argv])
        cp.parse_devices(args.device, args.backbones)
    assert message in str(err.value) + capsys.readouterr().err


def test_the_dry_run_prints_every_process_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert cp.main(["--out", str(out), "--budget", "100", "--processes", "2", "--cores", "2", "--device", "cpu",
                    "--methods", "dbsn,map", "--dry-run"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "3 processes, 2 at once, OMP_NUM_THREADS=1" in printed
    for name in ("structure_net/dbsn", "structure_net/map", "resnet18/map", "join structure_net", "join resnet18"):
        assert f"[{name}]" in printed
    assert not out.exists()


def _job(tmp_path, name, code):
    return cp.Job(
        "structure_net", (name,), "cpu", tmp_path / name, tmp_path / f"{name}.log", [sys.executable, "-c", code]
    )


def test_the_budget_stops_the_running_processes_and_starts_no_more(tmp_path, monkeypatch):
    """One process at a time: one finishes, one fails, one that ignores SIGTERM is killed at the
    deadline (after the grace), the last never starts."""
    monkeypatch.setattr(cp, "GRACE", 0.5)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    jobs = [
        _job(tmp_path, "ok", "pass"),
        _job(tmp_path, "bad", "raise SystemExit(3)"),
        _job(tmp_path, "slow", stubborn),
        _job(tmp_path, "later", "pass"),
    ]
    start = time.monotonic()
    cp.run_jobs(jobs, 1, start + 2.5, poll=0.05)
    assert time.monotonic() - start < 8
    assert [(j.state, j.rc) for j in jobs] == [("finished", 0), ("failed", 3), ("stopped", -9), ("not started", None)]
    assert "up" in (tmp_path / "slow.log").read_text()
    assert not (tmp_path / "later.log").exists()


def _run(folder: Path, status="finished", converged=True, grid=(0.1,), **config):
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"run_id": folder.name, "status": status}))
    base = {"data": {"batch_size": 64}, "trainer": {"max_epochs": 4, "default_root_dir": str(folder)}, "seed": 0}
    (folder / "resolved_config.yaml").write_text(yaml.safe_dump({**base, **config}))
    losses = [2.0, 1.0, 0.5, 0.1]
    (folder / "metrics.json").write_text(json.dumps({"convergence": {"converged": converged, "epoch_losses": losses}}))
    (folder / cp.TUNING_FILE).write_text(json.dumps({"grid": list(grid), "chosen": grid[-1]}))
    return folder


def test_the_finished_runs_of_each_backbone_and_the_shared_cell_runs(tmp_path):
    parts = tmp_path / "parts"
    dbsn = _run(parts / "structure_net" / "dbsn" / "dbsn")
    mimo = _run(parts / "structure_net" / "mimo" / "mimo")
    _run(parts / "resnet18" / "mimo" / "mimo", status="running")
    comparison = {b: ["dbsn", "mimo"] for b in ("structure_net", "resnet18")}
    same = cp.finished_runs(tmp_path, {"structure_net": "gpu", "resnet18": "gpu"}, comparison)
    assert same == {"structure_net": {"dbsn": dbsn, "mimo": mimo}, "resnet18": {"dbsn": dbsn}}
    other = cp.finished_runs(tmp_path, {"structure_net": "cpu", "resnet18": "gpu"}, comparison)
    assert other["resnet18"] == {}


def test_runs_that_did_not_share_the_settings_are_refused(tmp_path):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", model={"lr": 9})
    cp.check_shared({"x": a, "y": b}, [0.1])  # own folders and the method's settings differ
    c = _run(tmp_path / "c", trainer={"max_epochs": 5})
    with pytest.raises(ConfigError, match="trainer.max_epochs=5"):
        cp.check_shared({"x": a, "z": c}, [0.1])
    with pytest.raises(ConfigError, match="search was over"):
        cp.check_shared({"x": a}, [0.1, 0.4])


def test_the_pack_holds_the_finished_runs_without_checkpoints_and_a_later_call_finds_them(tmp_path):
    import tarfile

    out = tmp_path / "out"
    run = _run(out / "parts" / "structure_net" / "map" / "map")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run / "reliability_diagram.png").write_bytes(b"x")
    _run(out / "parts" / "structure_net" / "map" / "tune" / "map" / "lr_0.1", status="running")
    (out / "structure_net" / "report").mkdir(parents=True)
    (out / "structure_net" / "comparison.md").write_text("| map |")
    (out / "structure_net" / "report" / "pareto_digits.png").write_bytes(b"x")
    (out / "summary.md").write_text("s")
    cp.pack(out, out / "compare.tar.gz")  # written into the folder it packs: not packed into itself
    with tarfile.open(out / "compare.tar.gz") as tar:
        names = sorted(tar.getnames())
        tar.extractall(tmp_path / "back", filter="data")
    assert "summary.md" in names and "structure_net/comparison.md" in names and "compare.tar.gz" not in names
    assert "parts/structure_net/map/map/metrics.json" in names
    assert not [n for n in names if n.endswith((".ckpt", ".png")) and n != "structure_net/report/pareto_digits.png"]
    assert "structure_net/report/pareto_digits.png" in names and not [n for n in names if "/tune/" in n]
    runs = cp.finished_runs(tmp_path / "back", {"structure_net": "cpu"}, {"structure_net": ["map"]})
    assert runs == {"structure_net": {"map": tmp_path / "back" / "parts" / "structure_net" / "map" / "map"}}


def test_the_summary_names_unconverged_and_unfinished_methods(tmp_path):
    args = cp.parse(["--out", str(tmp_path), "--budget", "100", "--methods", "dbsn,map", "--backbones", "resnet18"])
    runs = {"resnet18": {"dbsn": _run(tmp_path / "dbsn", converged=False)}}
    job = _job(tmp_path, "map", "pass")
    job.backbone, job.state = "resnet18", "stopped"
    why = {"resnet18": "its join failed"}
    text = cp.summary(tmp_path, args, {"resnet18": "gpu"}, [job], runs, why, {("resnet18", "vogn"): "Err: x"})
    assert "| dbsn | 0.1 | **no** | – | 1.0000 | 0.1000 |" in text
    assert "Not converged, or too few epochs to judge: dbsn" in text
    assert "**Not finished:** map (stopped)." in text and "No comparison written: its join failed" in text
    assert "**Left out, their configs do not compose here:** vogn (Err: x)." in text
    assert (tmp_path / "summary.md").read_text().strip() == text.strip()


ROOT = Path(__file__).resolve().parents[2]


def _script(work: Path, out: Path, budget: int, *argv: str) -> subprocess.CompletedProcess:
    """tools/gpu_compare.sh with this interpreter, the comparison in `work`, what comes back in `out`."""
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "BUDGET": str(budget), "PY": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_compare.sh"), *argv], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_script_end_to_end_on_a_cpu_and_a_budget_that_runs_out_keeps_what_finished(tmp_path):
    """tools/gpu_compare.sh, two methods in two processes at once, a tiny run of each (one epoch, a
    one-rate grid): the joined comparison and report, and the pack that comes back; then, in a folder
    unpacked from it, a third method under a budget that stops it: the first two are kept (not trained
    again), the third is named, 124."""
    out, back = tmp_path / "work", tmp_path / "back"
    common = ["--device", "cpu", "--cores", "2", "--backbones", "structure_net", "--epochs", "1", "--lr-grid", "0.1"]
    common += ["--samples", "2", "--subset", "128", "statistics.resamples=20"]
    common += ["model.net.num_nodes=3", "model.net.growth=4", "model.net.stem_channels=8"]
    done = _script(out, back, 300, *common, "--methods", "map,mc_dropout", "--processes", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in back.iterdir()) == ["compare.tar.gz", "environment.txt", "status.json", "summary.md"]
    table = (out / "structure_net" / "comparison.md").read_text()
    assert "| map |" in table and "| mc_dropout |" in table
    assert (out / "structure_net" / "report" / "report.md").is_file()
    assert "too few epochs to judge: map, mc_dropout" in (out / "summary.md").read_text()
    assert not list((out / "parts").glob("**/*.ckpt"))  # every run finished: no checkpoint kept

    import tarfile

    with tarfile.open(back / "compare.tar.gz") as tar:  # the next machine continues from what came back
        tar.extractall(tmp_path / "again", filter="data")
    out = tmp_path / "again"
    more = [*common, "--methods", "map,mc_dropout,bbb", "--processes", "1", "--budget", "20", "--join-seconds", "17"]
    assert cp.main(["--out", str(out), *more]) == cp.STOPPED  # in this process: one interpreter start less
    status = json.loads((out / "status.json").read_text())
    assert [(j["name"], j["state"]) for j in status["jobs"]] == [("structure_net/bbb", "stopped")]
    assert list(status["finished"]["structure_net"]) == ["map", "mc_dropout"]
    rows = [line.split(" | ")[0] for line in (out / "structure_net" / "comparison.md").read_text().splitlines()[2:]]
    assert rows == ["| map", "| mc_dropout"]
    assert "**Not finished:** bbb (stopped)." in (out / "summary.md").read_text()
