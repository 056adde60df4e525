"""`dbsn-compare --tune` on several backbones, its methods spread over P processes at once, within one
wall-clock budget, joined into one comparison per backbone.

    python -m dbsn.tools.compare_parallel --out DIR --budget 300 [--processes 16] [--cores N]
        [--backbones structure_net,resnet18] [--methods dbsn,map,...] [--device auto|cpu|gpu|BACKBONE=DEVICE,...]
        [--data digits] [--epochs 50] [--lr-grid 0.025,...] [--batch-size 64] [--samples 100]
        [--join-seconds 60] [--keep-checkpoints] [--pack FILE] [--dry-run] [overrides ...]

Each process is one `dbsn.tools.compare --tune` on a group of methods (a deep ensemble with the
method its members are) in its own folder, with `OMP_NUM_THREADS` = cores / P and the same settings
as every other (data, epochs, batch, grid, S, validation split, seed, trainer, overrides): only
`--methods` and `--out` differ, so each method's run is the one a single comparison of every method
would make. Methods that train DBSN's cell network whatever the backbone run once for every backbone
on the same device; a method whose config does not compose is left out before anything starts, and
named. At the budget less `--join-seconds` the processes still running are stopped (each resumable
from its last epoch-end checkpoint), then each backbone's finished runs are joined (comparison.md,
comparison.json and the report, once `check_shared` has found the runs shared their settings), and
`DIR/summary.md` names each run's chosen rate, whether it converged and what did not finish. Called
again with the same `DIR`, it continues; `--pack FILE` writes one .tar.gz that a later call continues
from. Exit status 0 when all finished, 124 when the budget stopped some, 1 on a failure. The prepared
GPU command (`tools/gpu_compare.sh`) and its budget: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from dbsn.evaluation.runs import METRICS_FILE, read_run_record
from dbsn.methods.registry import method_config
from dbsn.tools.compare import LR_GRID, TUNING_FILE, backbone_choices, compared_methods, data_choices, names

#: The epochs of every run: 50 epochs of the 17 steps `--tune` leaves on digits (1,145 images, batch 64)
#: are 850 steps, every schedule compressed into them as in any comparison: more than the 600 steps that
#: BatchEnsemble at its authors' initialisation needs to catch up on the cell network (docs/field.md), where
#: the shorter CPU comparisons of docs/results.md left several methods short of convergence.
EPOCHS = 50
#: The backbones compared, each a comparison of its own (the cell network, and a ResNet-18 of width 16).
BACKBONES = ("structure_net", "resnet18")
#: Shared by every process: no per-epoch structure heatmaps (hundreds of figures, time and space, which
#: no table reads), no progress bars in the logs.
QUIET = (
    "callbacks.structure_posterior.save_figures=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
)
#: Seconds between SIGTERM (a run stops at the end of its batch) and SIGKILL.
GRACE = 10
#: Exit status when the budget stopped a process (as `timeout`'s).
STOPPED = 124


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, and a cgroup v2 quota (`cpu.max`) below it (a
    container may see every core of its host)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


@dataclass
class Job:
    """One process: `methods` (in the comparison's order) on `backbone`, on `device`."""

    backbone: str
    methods: tuple[str, ...]
    device: str
    part: Path
    log: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    state: str = "not started"
    rc: int | None = None
    seconds: float | None = None

    @property
    def name(self) -> str:
        return f"{self.backbone}/{'+'.join(self.methods)}"


def parse_devices(text: str, backbones) -> dict[str, str]:
    """`--device`'s value by backbone: one of auto/cpu/gpu for all, or `BACKBONE=DEVICE,...` (the rest
    auto); auto is the GPU when CUDA is available. A step of these small networks is a CPU core's
    arithmetic, or a few hundred small kernels that a GPU runs in far less time, so P processes
    sharing one GPU by time slices should still train faster than P cores: auto chooses the GPU for
    every backbone. `--device structure_net=cpu` moves a backbone to the cores where a GPU shared by
    many processes turns out slower."""
    chosen = {b: "auto" for b in backbones}
    for item in names(text):
        backbone, _, device = item.rpartition("=")
        if device not in ("auto", "cpu", "gpu") or (backbone and backbone not in chosen):
            raise SystemExit(
                f"--device {text}: {item!r} is not auto, cpu, gpu or BACKBONE=DEVICE with a backbone of "
                f"--backbones ({', '.join(backbones)})"
            )
        for b in [backbone] if backbone else list(chosen):
            chosen[b] = device
    if "auto" in chosen.values():
        import torch

        found = "gpu" if torch.cuda.is_available() else "cpu"
        chosen = {b: found if d == "auto" else d for b, d in chosen.items()}
    return chosen


def groups(methods) -> list[tuple[str, ...]]:
    """The methods as the processes take them, in the comparison's order: a deep ensemble after the
    method its members are, in one process (one comparison tunes it by its members' search)."""
    methods = list(methods)
    out, placed = [], set()
    for method in methods:
        if method in placed:
            continue
        group = [method, *(m for m in methods if (member := method_config(m).member) and member.name == method)]
        placed.update(group)
        out.append(tuple(group))
    return out


def shared_arguments(args) -> list[str]:
    """dbsn-compare's options and overrides that every process and join gets (not --methods, --out,
    --backbone, --resume, nor the trainer)."""
    grid = ",".join(f"{v:g}" for v in args.lr_grid)
    subset = ["--subset", str(args.subset)] if args.subset else []
    return [
        "--data",
        args.data,
        *subset,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--samples",
        str(args.samples),
        "--tune",
        "--lr-grid",
        grid,
    ]


def compare_argv(args, backbone: str, methods, device: str, out: Path, resume: bool) -> list[str]:
    """One dbsn-compare command line of this comparison."""
    return [
        sys.executable,
        "-m",
        "dbsn.tools.compare",
        *shared_arguments(args),
        "--backbone",
        backbone,
        "--methods",
        ",".join(methods),
        "--out",
        str(out),
        *(["--resume"] if resume else []),
        *QUIET,
        f"trainer={device}",
        *args.overrides,
    ]


def refused_configs(args) -> dict[tuple[str, str], str]:
    """(backbone, method) -> the first line of the error, for each method whose training config does not
    compose or validate on a backbone with these settings (dbsn-compare would stop on it): it is left out
    of the plan and named, before any process starts."""
    from dbsn.tools.compare import TUNE_VAL_SIZE, compose_train, method_overrides, shared_overrides
    from dbsn.tools.comparison_folder import validated

    refused = {}
    for backbone in args.backbones:
        for method in args.methods:
            model = method_overrides(
                method, args.epochs, 1, args.samples, (), args.batch_size, backbone, "fair", args.lr_grid[0]
            )
            shared = [*shared_overrides(args.data, args.batch_size, args.subset), *QUIET, *args.overrides]
            try:
                cfg = compose_train([*model, *shared, f"data.val_size={TUNE_VAL_SIZE}", f"paths.output_dir={args.out}"])
                validated(cfg)
            except Exception as err:  # noqa: BLE001 - whatever stops its composition, named in the summary
                refused[(backbone, method)] = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
    return refused


def plan(args, devices: dict[str, str], refused=None) -> tuple[list[Job], dict[str, list[str]]]:
    """(the processes in the order they start, the methods of each backbone's comparison, without those
    `refused` by `refused_configs`). The queue goes method by method in the comparison's order (DBSN
    first, the reference of the paired differences), each on every backbone; a method on DBSN's cells
    runs once per device."""
    out = Path(args.out)
    refused = refused or {}
    threads = max(1, args.cores // args.processes)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    comparison = {b: [m for m in args.methods if (b, m) not in refused] for b in args.backbones}
    owner: dict[tuple[str, str], str] = {}  # (cell method, device) -> the backbone that trains it
    jobs = []
    for whole in groups(args.methods):
        for backbone in args.backbones:
            group = tuple(m for m in whole if m in comparison[backbone])
            device = devices[backbone]
            if not group:
                continue
            if method_config(group[0]).networks == "cells":
                if owner.setdefault((group[0], device), backbone) != backbone:
                    continue
            part = out / "parts" / backbone / group[0]
            if all(finished(part / m) for m in group):
                continue  # finished in an earlier call
            resume = part.is_dir() and any(part.iterdir())
            jobs.append(
                Job(
                    backbone,
                    group,
                    device,
                    part,
                    out / "logs" / f"{backbone}-{group[0]}.log",
                    compare_argv(args, backbone, group, device, part, resume),
                    dict(env),
                )
            )
    return jobs, comparison


def finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` finished (run.json says so and metrics.json is there)."""
    record = read_run_record(run_dir) if Path(run_dir).is_dir() else None
    return record is not None and record.get("status") == "finished" and (Path(run_dir) / METRICS_FILE).is_file()


def run_jobs(jobs: list[Job], processes: int, deadline: float, poll: float = 0.5) -> None:
    """Run `jobs`, at most `processes` at once, in order; at `deadline` (time.monotonic()) stop the
    ones running (SIGTERM to the process group, SIGKILL after `GRACE` s) and start no more. Sets each
    job's state: finished (exit 0), failed (another status), stopped (by the budget), not started."""
    queue, running = list(jobs), {}
    try:
        while queue or running:
            while queue and len(running) < processes and time.monotonic() < deadline:
                job = queue.pop(0)
                job.log.parent.mkdir(parents=True, exist_ok=True)
                job.part.parent.mkdir(parents=True, exist_ok=True)
                with job.log.open("w") as log:
                    log.write("$ " + shlex.join(job.argv) + "\n")
                    log.flush()
                    proc = subprocess.Popen(
                        job.argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **job.env},
                        start_new_session=True,
                    )
                running[proc] = (job, time.monotonic())
                job.state = "running"
            for proc, (job, start) in list(running.items()):
                if proc.poll() is not None:
                    job.rc, job.seconds = proc.returncode, time.monotonic() - start
                    job.state = "finished" if proc.returncode == 0 else "failed"
                    del running[proc]
            if time.monotonic() >= deadline:
                stop(running)
                break
            time.sleep(poll)
    finally:
        stop(running)


def stop(running: dict) -> None:
    """Stop every running process group, SIGTERM then SIGKILL, and mark its job stopped."""
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + GRACE
    for proc, (job, start) in list(running.items()):
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        job.rc, job.seconds = proc.returncode, time.monotonic() - start
        job.state = "finished" if proc.returncode == 0 else "stopped"  # 0: it ended before the signal
        del running[proc]


def finished_runs(out: Path, devices: dict[str, str], comparison: dict[str, list[str]]) -> dict[str, dict[str, Path]]:
    """The finished run of each backbone's methods, by method in the comparison's order, from the
    processes' folders `out/parts/<backbone>/<group>/<method>`; a method on DBSN's cells trained
    under another backbone of the same device is that backbone's run."""
    found = {}  # (backbone, method) -> its finished run
    for part in sorted((out / "parts").glob("*/*")):
        for run in sorted(part.iterdir()):
            if finished(run):
                found[(part.parent.name, run.name)] = run
    runs = {}
    for backbone, methods in comparison.items():
        runs[backbone] = {}
        for method in methods:
            run = found.get((backbone, method))
            if run is None and method_config(method).networks == "cells":
                run = next(
                    (r for (b, m), r in found.items() if m == method and devices.get(b) == devices[backbone]), None
                )
            if run is not None:
                runs[backbone][method] = run
    return runs


#: The settings every run of a comparison must share (the method's own, `model.*`, differ by design).
SHARED_KEYS = ("data", "trainer", "seed", "callbacks", "statistics")


def check_shared(runs: dict[str, Path], lr_grid) -> None:
    """Refuse (`ConfigError`, one line) runs that did not share the comparison's settings: their
    resolved configs differ under `SHARED_KEYS` (absolute paths aside: a run's own folders),
    or a learning-rate search was not over `lr_grid`."""
    from dbsn.evaluation.runs import flatten_config, load_run_config
    from dbsn.runtime.config import ConfigError

    first, reference = None, {}
    for method, run in runs.items():
        config = {
            k: v
            for k, v in flatten_config(load_run_config(run)).items()
            if k.split(".", 1)[0] in SHARED_KEYS and not (isinstance(v, str) and v.startswith("/"))
        }
        if first is None:
            first, reference = method, config
        for key in sorted(reference.keys() | config.keys()):
            if reference.get(key, "<absent>") != config.get(key, "<absent>"):
                raise ConfigError(
                    f"{run} ran with {key}={config.get(key, '<absent>')}, {runs[first]} with "
                    f"{reference.get(key, '<absent>')}: the runs of one comparison share it; run them again into a new --out"
                )
        tuning = run / TUNING_FILE
        grid = json.loads(tuning.read_text())["grid"] if tuning.is_file() else None
        if grid != [float(v) for v in lr_grid]:
            raise ConfigError(f"{run}'s learning-rate search was over {grid}, not --lr-grid {list(lr_grid)}")


def join(out: Path, args, backbone: str, runs: dict[str, Path]) -> None:
    """One comparison of `runs` (method -> finished run) in `out/<backbone>`, as dbsn-compare writes
    it: comparison.md and comparison.json (`write_table`), and with more than one method the report
    of the processes' folders in report/ with the paired differences against DBSN
    (`reference_name`)."""
    from dbsn.evaluation.report import build_report
    from dbsn.tools.compare import print_paired, reference_name, write_table

    check_shared(runs, args.lr_grid)
    results = {}
    for method, run in runs.items():
        record = json.loads((run / METRICS_FILE).read_text())
        results[method] = {
            **record["metrics"],
            "train_seconds": record["train_seconds"],
            "intervals": record.get("intervals", {}),
            "cost": record.get("cost", {}),
        }
    subset = (record.get("budget") or {}).get("train_images") if args.subset else None
    folder = out / backbone
    write_table(results, folder, args.epochs, args.batch_size, args.data, subset)
    if len(runs) > 1:
        reference = reference_name(list(runs), backbone)
        report = build_report(sorted({run.parent for run in runs.values()}), folder / "report", reference)
        print_paired(report, reference)


def prune(out: Path) -> None:
    """Delete the checkpoints of finished runs (the methods' and their searches') under the processes'
    folders; an unfinished run keeps its last one, which `--resume` continues from."""
    for record in (out / "parts").glob("**/run.json"):
        if (read_run_record(record.parent) or {}).get("status") == "finished":
            for ckpt in (record.parent / "checkpoints").glob("*.ckpt"):
                ckpt.unlink()


#: Not packed (`pack`): checkpoints and locks, and in the runs the figures each draws for itself (the
#: report draws its own from the runs' files, and they are packed).
UNPACKED, UNPACKED_IN_RUNS = ("*.ckpt", ".dbsn.lock"), ("*.png",)


def pack(out: Path, path: Path) -> int:
    """A gzipped tar of what the comparison is read and continued from, paths relative to `out`: the
    summary, status and logs, each backbone's comparison and report, and every finished run (the
    methods' and their searches') without `UNPACKED` files; unfinished runs are left out (a later
    call starts them again). For machines that send back only a few files. Returns its size in bytes."""
    import fnmatch
    import tarfile

    def without(patterns):
        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            return None if any(fnmatch.fnmatch(Path(info.name).name, p) for p in patterns) else info

        return keep

    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(p.name for p in out.iterdir() if p.name != "parts"):
            if (out / name).resolve() != Path(path).resolve():
                tar.add(out / name, arcname=name, filter=without(UNPACKED))
        for record in sorted((out / "parts").glob("**/run.json")):
            run = record.parent
            if (read_run_record(run) or {}).get("status") == "finished":
                tar.add(run, arcname=str(run.relative_to(out)), filter=without(UNPACKED + UNPACKED_IN_RUNS))
    return Path(path).stat().st_size


def convergence_rows(runs: dict[str, Path]) -> list[dict]:
    """Each run's convergence record (metrics.json's "convergence") with its training loss at the
    first learning-rate decay (half the run) and at the end, and its chosen learning rate."""
    rows = []
    for method, run in runs.items():
        record = json.loads((run / METRICS_FILE).read_text()).get("convergence") or {}
        losses = record.get("epoch_losses") or []
        tuning = run / TUNING_FILE
        rows.append(
            {
                "method": method,
                "lr": json.loads(tuning.read_text()).get("chosen") if tuning.is_file() else None,
                "converged": record.get("converged"),
                "last_tenth_drop": record.get("last_tenth_drop"),
                "loss_half": losses[len(losses) // 2 - 1] if len(losses) >= 2 else None,
                "loss_end": losses[-1] if losses else None,
            }
        )
    return rows


CONVERGED = {True: "yes", False: "**no**", None: "unknown"}


def _num(value, digits=4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def summary(out: Path, args, devices, jobs, runs, why, refused=None) -> str:
    """summary.md: the settings, each backbone's table and its runs' convergence, what did not finish."""
    lines = [
        "# Every method on every backbone (dbsn.tools.compare_parallel)",
        "",
        f"Settings shared by every run: `{shlex.join(shared_arguments(args) + list(QUIET) + list(args.overrides))}`; "
        f"{args.processes} processes of {max(1, args.cores // args.processes)} thread(s); devices: "
        + ", ".join(f"{b} {d}" for b, d in devices.items())
        + f"; budget {args.budget:g} s.",
        "",
    ]
    states = {(job.backbone, m): job.state for job in jobs for m in job.methods}
    for backbone, done in runs.items():
        folder = out / backbone
        lines += [f"## {backbone}", ""]
        if backbone in why:
            lines += [f"No comparison written: {why[backbone]}.", ""]
        else:
            report = f"; report: `{backbone}/report/report.md`" if len(done) > 1 else ""
            lines += [(folder / "comparison.md").read_text().rstrip(), "", f"`{backbone}/comparison.md`{report}", ""]
        if done:
            rows = convergence_rows(done)
            lines += [
                "| method | chosen lr | converged | last-tenth drop | loss at half | final loss |",
                "|---|---|---|---|---|---|",
                *(
                    f"| {r['method']} | {'–' if r['lr'] is None else format(r['lr'], 'g')} | "
                    f"{CONVERGED[r['converged']]} | {_num(r['last_tenth_drop'], 3)} | {_num(r['loss_half'])} | "
                    f"{_num(r['loss_end'])} |"
                    for r in rows
                ),
                "",
            ]
            bad = [r["method"] for r in rows if r["converged"] is not True]
            lines += [
                f"**Not converged, or too few epochs to judge: {', '.join(bad)}.**" if bad else "Every run converged.",
                "",
            ]
        left_out = [f"{m} ({line})" for (b, m), line in (refused or {}).items() if b == backbone]
        if left_out:
            lines += [f"**Left out, their configs do not compose here:** {'; '.join(left_out)}.", ""]
        missing = [m for m in args.methods if m not in done and (backbone, m) not in (refused or {})]
        if missing:
            shown = ", ".join(f"{m} ({states.get((backbone, m), 'under another backbone')})" for m in missing)
            lines += [f"**Not finished:** {shown}.", ""]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    return text


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the folder of the comparisons (see above)")
    parser.add_argument("--budget", type=float, required=True, help="wall-clock seconds for everything, joins included")
    parser.add_argument("--processes", type=int, default=None, help="processes at once (default: --cores)")
    parser.add_argument(
        "--cores", type=int, default=None, help="cores shared by the processes (default: those this process may use)"
    )
    parser.add_argument("--backbones", type=names, default=list(BACKBONES))
    parser.add_argument("--methods", type=names, default=compared_methods())
    parser.add_argument("--device", default="auto", help="auto, cpu, gpu, or BACKBONE=DEVICE,... (see parse_devices)")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--subset", default=None)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--lr-grid", type=lambda t: [float(v) for v in names(t)], default=list(LR_GRID))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--join-seconds", type=float, default=60, help="of the budget, kept for the joins")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument(
        "--pack",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the comparison as one .tar.gz (finished runs, no checkpoints or run figures)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the processes and joins, run nothing")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run (e.g. seed=1)")
    args = parser.parse_args(argv)
    args.cores = available_cores() if args.cores is None else args.cores
    args.processes = args.cores if args.processes is None else args.processes
    unknown = sorted(set(args.methods) - set(compared_methods()))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(compared_methods())}")
    unknown = sorted(set(args.backbones) - set(backbone_choices()))
    if unknown:
        parser.error(f"unknown backbone(s) {unknown}; choose from {', '.join(backbone_choices())}")
    if args.data not in data_choices():
        parser.error(f"unknown dataset {args.data!r}; choose from {', '.join(data_choices())}")
    if any(o.split("=", 1)[0].lstrip("+~") == "trainer" for o in args.overrides):
        parser.error("choose the device with --device, not a trainer=... override")
    if args.processes < 1 or args.cores < 1 or args.budget <= args.join_seconds:
        parser.error(
            f"--processes {args.processes} and --cores {args.cores} must be at least 1, and --budget "
            f"{args.budget:g} more than --join-seconds {args.join_seconds:g}"
        )
    order = compared_methods()
    args.methods = sorted(args.methods, key=order.index)
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    out = Path(args.out).resolve()
    args.out = out
    devices = parse_devices(args.device, args.backbones)
    refused = refused_configs(args)
    for (backbone, method), why_not in refused.items():
        print(f"compare_parallel: {method} on {backbone} left out, its config does not compose: {why_not}")
    jobs, comparison = plan(args, devices, refused)
    if args.dry_run:
        threads = max(1, args.cores // args.processes)
        print(f"{len(jobs)} processes, {args.processes} at once, OMP_NUM_THREADS={threads}; devices: {devices}")
        for job in jobs:
            print(f"[{job.name}] OMP_NUM_THREADS={threads} {shlex.join(job.argv)} > {job.log}")
        for backbone in args.backbones:
            print(f"[join {backbone}] the finished runs of {', '.join(comparison[backbone])} into {out / backbone}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    handler = signal.signal(signal.SIGTERM, _interrupt)  # a timeout around this process stops its processes too
    try:
        run_jobs(jobs, args.processes, start + args.budget - args.join_seconds)
    except KeyboardInterrupt:
        print(
            "compare_parallel: interrupted; its processes were stopped, the finished runs are joined", file=sys.stderr
        )
    finally:
        signal.signal(signal.SIGTERM, handler)
    runs = finished_runs(out, devices, comparison)
    why, joins = {}, {}
    for backbone, done in runs.items():
        if not done:
            why[backbone] = "no method finished"
            continue
        began = time.monotonic()
        try:
            join(out, args, backbone, done)
        except Exception as err:  # noqa: BLE001 - one backbone's failure leaves the other's comparison
            traceback.print_exc()
            why[backbone] = f"{type(err).__name__}: {err}"
        joins[backbone] = time.monotonic() - began
    if not args.keep_checkpoints:
        prune(out)
    (out / "status.json").write_text(
        json.dumps(
            {
                "devices": devices,
                "jobs": [
                    {
                        "name": j.name,
                        "device": j.device,
                        "state": j.state,
                        "rc": j.rc,
                        "seconds": j.seconds,
                        "log": str(j.log),
                    }
                    for j in jobs
                ],
                "finished": {b: {m: str(r) for m, r in done.items()} for b, done in runs.items()},
                "not_joined": why,
                "join_seconds": joins,
                "left_out": {f"{b}/{m}": line for (b, m), line in refused.items()},
                "seconds": time.monotonic() - start,
            },
            indent=2,
        )
        + "\n"
    )
    print(summary(out, args, devices, jobs, runs, why, refused))
    if args.pack is not None:
        size = pack(out, args.pack)
        print(f"packed into {args.pack} ({size / 2**20:.1f} MiB)")
    if any(j.state == "failed" for j in jobs) or any(b in why for b, done in runs.items() if done):
        return 1
    if any(m not in runs[b] for b in comparison for m in comparison[b]):
        return STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
