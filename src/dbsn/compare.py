"""A small end-to-end comparison of every method on the embedded digits data (CPU, minutes).

    python -m dbsn.compare [--epochs 10] [--methods dbsn,map,...] [--batch-size 64] [--out DIR] [overrides ...]

Every method trains the paper's small network (B = 4, one cell per stage, ~41K parameters) with
the same data, batch, epochs and weight optimiser settings, and is tested with S = 100 members
where it is stochastic. Schedules written for 100 CIFAR epochs are compressed into the run, the
only per-method settings: DBSN, FBN and VOGN-FBN get the quick preset's structure schedules (τ
reaches 1 and β reaches 0.5 within the run, θ's Adam at 10x the paper's lr); VOGN and VOGN-FBN
warm their KL weight up over the first 10 % of the steps (the paper: 1000 steps). NEK-FAC is
left out: it is defined on VGG16-BN, not on this network. Prints and writes (comparison.md,
comparison.json) a table of error / NLL / Brier / ECE and training time; the runs' folders are
a sweep that `python report.py DIR` tabulates (training time as a ratio to DBSN: the paper's
Table 5 comparison is `--methods dbsn,vogn,vogn_fbn --batch-size 32`).
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import date
from pathlib import Path

from rich.console import Console
from rich.table import Table

METHODS = ("dbsn", "map", "map_fixed", "mc_dropout", "bbb", "fbn", "deep_ensemble", "vogn", "vogn_fbn")
STRUCTURE_SAMPLING = ("dbsn", "fbn", "vogn_fbn")
VOGN_METHODS = ("vogn", "vogn_fbn")
DIGITS_TRAIN = 1347  # digits training split (conf/data/digits.yaml)


def method_overrides(method: str, epochs: int, steps_per_epoch: int, n_samples: int = 100,
                     net_overrides: list[str] = ()) -> list[str]:
    model = "model.member" if method == "deep_ensemble" else "model"
    overrides = [f"model={method}", "data=digits", "data.num_workers=0", "trainer=cpu",
                 f"trainer.max_epochs={epochs}", "trainer.log_every_n_steps=10",
                 f"{model}.net.num_nodes=4", f"{model}.net.cells_per_stage=1",
                 *[f"{model}.net.{o}" for o in net_overrides]]
    if method == "deep_ensemble":
        overrides.append("model.size=3")
    if method not in ("map", "map_fixed", "deep_ensemble"):
        overrides.append(f"model.n_samples={n_samples}")
    total = epochs * steps_per_epoch
    if method in STRUCTURE_SAMPLING:  # compress the 100-epoch schedules into this run
        overrides += [f"model.tau.decay={math.log(3.0) / total:.3e}",
                      f"model.beta.decay_per_epoch={0.5 / (0.8 * epochs):.4f}",
                      "model.structure_optim.lr=3e-3"]
        if method not in VOGN_METHODS:  # VOGN-FBN: one structure per weight sample, no T
            overrides.append("model.train_samples=1")
    if method in VOGN_METHODS:
        overrides.append(f"model.vogn.kl_warmup_steps={max(1, total // 10)}")
    if method in ("mc_dropout", "bbb", *STRUCTURE_SAMPLING):
        overrides.append("model.samples_per_forward=4")
    return overrides


def run_comparison(methods=METHODS, epochs: int = 10, output_dir: Path = Path("outputs/compare"),
                   extra: list[str] | None = None, n_samples: int = 100,
                   net_overrides: list[str] = (), batch_size: int = 64) -> dict[str, dict[str, float]]:
    """Train and test each method into ``output_dir/<method>``; returns its test metrics plus
    ``train_seconds`` (the fit's wall time) by method."""
    from hydra import compose, initialize_config_dir

    from dbsn.run import train

    conf = Path(__file__).resolve().parents[2] / "conf"
    steps_per_epoch = DIGITS_TRAIN // batch_size  # drop_last
    results = {}
    for method in methods:
        run_dir = Path(output_dir) / method
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose("train", overrides=[*method_overrides(method, epochs, steps_per_epoch, n_samples, net_overrides),
                                               f"data.batch_size={batch_size}", *(extra or []),
                                               f"paths.output_dir={run_dir}", "task_name=compare"])
        metrics = train(cfg, run_dir)
        results[method] = {**metrics, "train_seconds": json.loads((run_dir / "metrics.json").read_text())["train_seconds"]}
    write_table(results, Path(output_dir), epochs, batch_size)
    return results


COLUMNS = (("error %", "test/error", lambda v: f"{100 * v:.2f}"), ("NLL", "test/nll", lambda v: f"{v:.4f}"),
           ("Brier", "test/brier", lambda v: f"{v:.4f}"), ("ECE", "test/ece", lambda v: f"{v:.4f}"),
           ("train min", "train_seconds", lambda v: "–" if v is None else f"{v / 60:.1f}"))


def write_table(results: dict[str, dict[str, float]], output_dir: Path, epochs: int, batch_size: int = 64) -> str:
    rows = [[method, *(fmt(m.get(key)) for _, key, fmt in COLUMNS)] for method, m in results.items()]
    header = ["method", *(name for name, _, _ in COLUMNS)]
    markdown = "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows]) + "\n"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "comparison.md").write_text(markdown)
    (output_dir / "comparison.json").write_text(json.dumps(
        {"date": date.today().isoformat(), "epochs": epochs, "batch_size": batch_size, "results": results},
        indent=2) + "\n")
    table = Table(*header, title=f"digits, {epochs} epochs, batch {batch_size}")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return markdown


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("outputs/compare"))
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every method")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return run_comparison(args.methods.split(","), args.epochs, args.out, args.overrides, batch_size=args.batch_size)


if __name__ == "__main__":
    main()
