"""The runtime's one way into the tools (`dbsn.tools`): the paper's tables of a folder of runs."""

from __future__ import annotations

from pathlib import Path


def build_sweep_report(folder: Path):
    """`dbsn.tools.report.build_report` of every run under `folder`, into `folder/report`."""
    from dbsn.tools.report import build_report

    return build_report([folder], Path(folder) / "report")
