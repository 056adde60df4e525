"""The report's command line (`dbsn-report`, dbsn.tools.report) on hand-made run folders
(`tests.support.fakeruns`, the `outputs` fixture).
"""

from __future__ import annotations

from dbsn.tools.report import main


def test_cli_writes_report(outputs, tmp_path, capsys):
    out = tmp_path / "cli_report"
    report = main([str(outputs / "sweep"), str(outputs / "single"), "--out", str(out)])
    assert (out / "report.md").is_file() and (out / "runs.csv").is_file()
    assert len(report.runs) == 13
    printed = capsys.readouterr().out
    assert str(out / "report.md") in printed and "1 failed, 1 missing" in printed
