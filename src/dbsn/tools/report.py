"""`dbsn-report DIR [DIR ...] [--out OUT]` (or `python report.py ...`): the paper's tables from
finished runs; see `dbsn.evaluation.report` for what is read and written."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import dbsn.evaluation.report
from dbsn.evaluation.report import Report, build_report
from dbsn.evaluation.statistics import Statistics


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(
        description=dbsn.evaluation.report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="folders searched (recursively) for runs and sweeps")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("outputs/report"),
        help="output folder (default outputs/report): new, empty, or one an earlier report wrote",
    )
    parser.add_argument(
        "--reference",
        default="dbsn",
        help="the method the others are compared with, example by example (paired differences; default dbsn)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the paired bootstrap (default 0)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    args = parser.parse_args(argv)
    report = build_report(
        args.dirs,
        args.out,
        args.reference,
        Statistics(seed=args.seed, resamples=args.resamples),
        choose="write the report into a new folder with --out <folder>",
    )
    counts = Counter(r.status for r in report.runs)
    others = "".join(f", {counts[s]} {s}" for s in ("inconsistent", "repeat") if counts[s])
    print(
        f"{len(report.runs)} runs ({counts['ok']} ok, {counts['failed']} failed, {counts['missing']} missing{others}); "
        f"report written to {report.out / 'report.md'}"
    )
    for line in report.summary:
        print(line)
    for warning in report.warnings:
        print(f"note: {warning}")
    return report


def cli() -> None:
    """`dbsn-report`: `main` on the command line's arguments, mistakes in one line (exit status 2)."""
    from dbsn.runtime.errors import one_line_errors

    one_line_errors(main)()


if __name__ == "__main__":
    cli()
