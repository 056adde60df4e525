"""Dataset shift: CIFAR-10-C and CIFAR-100-C (Hendrycks & Dietterich, ICLR 2019).

The CIFAR test set under 19 corruptions (15 standard, 4 extra held out in the paper for
validation) at 5 severities. Two ways to have it:

- the published files, from Zenodo (`PUBLISHED`), read by `corrupted_split` and checked by
  `check_corrupted_files` (`published`: the layout and its reader);
- a generated stand-in (`corrupt`, `write_generated_set`, ``python -m dbsn.data.shift``) when
  the published files cannot be had: the same corruptions with the original script's CIFAR
  severity parameters, written in the published layout plus a `MARKER` file, so that every
  result computed from it can say it came from generated data (`is_generated`). It is not the
  published data (`generate`: the generator; `cli`: its command line).
"""

from dbsn.data.shift.cli import main
from dbsn.data.shift.generate import (
    CHUNK,
    GENERATED_CORRUPTIONS,
    GENERATED_STANDARD,
    GENERATOR_VERSION,
    NOT_GENERATED,
    PARAMETERS,
    corrupt,
    severity_rng,
    write_generated_set,
)
from dbsn.data.shift.published import (
    ALL_CORRUPTIONS,
    CORRUPTIONS,
    EXTRA_CORRUPTIONS,
    IMAGE_SIZE,
    MARKER,
    PUBLISHED,
    SEVERITIES,
    PublishedSet,
    check_corrupted_files,
    corrupted_split,
    is_generated,
)

__all__ = [
    "ALL_CORRUPTIONS",
    "CHUNK",
    "CORRUPTIONS",
    "EXTRA_CORRUPTIONS",
    "GENERATED_CORRUPTIONS",
    "GENERATED_STANDARD",
    "GENERATOR_VERSION",
    "IMAGE_SIZE",
    "MARKER",
    "NOT_GENERATED",
    "PARAMETERS",
    "PUBLISHED",
    "SEVERITIES",
    "PublishedSet",
    "check_corrupted_files",
    "corrupt",
    "corrupted_split",
    "is_generated",
    "main",
    "severity_rng",
    "write_generated_set",
]
