"""The command line of the generator: ``python -m dbsn.data.shift`` (`main`)."""

import argparse
from collections.abc import Sequence

from dbsn.data.shift.generate import GENERATED_CORRUPTIONS, write_generated_set
from dbsn.data.shift.published import MARKER, PUBLISHED


def main(argv: Sequence[str] | None = None) -> None:
    """python -m dbsn.data.shift --data cifar10 --root DATA --out FOLDER [--corruptions ...] [--seed 0]"""
    from dbsn.data.cifar import CIFAR10DataModule, CIFAR100DataModule

    parser = argparse.ArgumentParser(
        prog="python -m dbsn.data.shift",
        description="Generate a stand-in for CIFAR-10-C / CIFAR-100-C from the clean CIFAR test set, in the "
        f"published layout, marked as generated ({MARKER}).",
    )
    parser.add_argument("--data", choices=sorted(PUBLISHED), required=True)
    parser.add_argument("--root", required=True, help="folder holding the CIFAR files (as data.root)")
    parser.add_argument("--out", required=True, help="folder to write the generated set to")
    parser.add_argument(
        "--corruptions", nargs="+", default=list(GENERATED_CORRUPTIONS), choices=GENERATED_CORRUPTIONS,
        help="default: every corruption that can be generated",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    module = {"cifar10": CIFAR10DataModule, "cifar100": CIFAR100DataModule}[args.data](root=args.root)
    module.check_files()
    images, labels = module.read_split(train=False)
    print(f"{module.name} test set: {len(images)} images -> {args.out}", flush=True)
    write_generated_set(
        args.out, images, labels, args.corruptions, seed=args.seed,
        source=f"{module.name} test set from {module.root}", log=lambda line: print(line, flush=True),
    )  # fmt: skip
