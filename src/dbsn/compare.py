"""A small end-to-end comparison of every method on the embedded digits data (CPU, minutes).

    python -m dbsn.compare [--epochs 10] [--methods dbsn,map,...] [--out DIR] [overrides ...]

Every method trains the paper's small network (B = 4, one cell per stage, ~41K parameters) with
the same data, epochs and optimiser, and is tested with S = 100 members where it is
stochastic. DBSN and FBN get the quick preset's compressed structure schedules (τ reaches 1
and β reaches 0.5 within the run, θ's Adam at 10x the paper's lr) — the only per-method
settings. Prints and writes (comparison.md, comparison.json) a table of error / NLL / ECE.
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import date
from pathlib import Path

from rich.console import Console
from rich.table import Table

METHODS = ("dbsn", "map", "map_fixed", "mc_dropout", "bbb", "fbn", "deep_ensemble")
STRUCTURE_SAMPLING = ("dbsn", "fbn")


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
    if method in STRUCTURE_SAMPLING:  # compress the 100-epoch schedules into this run
        total = epochs * steps_per_epoch
        overrides += ["model.train_samples=1", "model.samples_per_forward=4",
                      f"model.tau.decay={math.log(3.0) / total:.3e}",
                      f"model.beta.decay_per_epoch={0.5 / (0.8 * epochs):.4f}",
                      "model.structure_optim.lr=3e-3"]
    if method in ("mc_dropout", "bbb"):
        overrides.append("model.samples_per_forward=4")
    return overrides


def run_comparison(methods=METHODS, epochs: int = 10, output_dir: Path = Path("outputs/compare"),
                   extra: list[str] | None = None, n_samples: int = 100,
                   net_overrides: list[str] = ()) -> dict[str, dict[str, float]]:
    from hydra import compose, initialize_config_dir

    from dbsn.run import train

    conf = Path(__file__).resolve().parents[2] / "conf"
    steps_per_epoch = 1347 // 64  # digits training split, batch 64, drop_last
    results = {}
    for method in methods:
        run_dir = Path(output_dir) / method
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose("train", overrides=[*method_overrides(method, epochs, steps_per_epoch, n_samples, net_overrides),
                                               *(extra or []),
                                               f"paths.output_dir={run_dir}", "task_name=compare"])
        results[method] = train(cfg, run_dir)
    write_table(results, Path(output_dir), epochs)
    return results


def write_table(results: dict[str, dict[str, float]], output_dir: Path, epochs: int) -> str:
    lines = ["| method | error % | NLL | Brier | ECE |", "|---|---|---|---|---|"]
    for method, m in results.items():
        lines.append(f"| {method} | {100 * m['test/error']:.2f} | {m['test/nll']:.4f} | "
                     f"{m['test/brier']:.4f} | {m['test/ece']:.4f} |")
    markdown = "\n".join(lines) + "\n"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "comparison.md").write_text(markdown)
    (output_dir / "comparison.json").write_text(json.dumps(
        {"date": date.today().isoformat(), "epochs": epochs, "results": results}, indent=2) + "\n")
    table = Table("method", "error %", "NLL", "Brier", "ECE", title=f"digits, {epochs} epochs")
    for method, m in results.items():
        table.add_row(method, f"{100 * m['test/error']:.2f}", f"{m['test/nll']:.4f}", f"{m['test/brier']:.4f}",
                      f"{m['test/ece']:.4f}")
    Console().print(table)
    return markdown


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=Path("outputs/compare"))
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every method")
    args = parser.parse_args(argv)
    return run_comparison(args.methods.split(","), args.epochs, args.out, args.overrides)


if __name__ == "__main__":
    main()
