"""python -m dbsn.data.shift: generate a stand-in for CIFAR-10-C / CIFAR-100-C (see `cli.main`)."""

import sys

from dbsn.data.shift.cli import main

if __name__ == "__main__":
    sys.exit(main())
