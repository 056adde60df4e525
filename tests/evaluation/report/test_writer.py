"""The report's section writer (dbsn.evaluation.report.writer) and the package's rule that its
modules share only public names."""

from __future__ import annotations

import ast
from pathlib import Path

import dbsn.evaluation.report
from dbsn.evaluation.report.collect import Report
from dbsn.evaluation.report.format import UNCONVERGED_MARK, md_table
from dbsn.evaluation.report.writer import write_section


def test_write_section_writes_its_csv_and_page_and_returns_its_text(tmp_path):
    report = Report(tmp_path, [])
    table = md_table(["method", "value"], [["dbsn", 1], ["map", None]])
    text = write_section(
        report, "things", "Things", "What they are.", table, ["method", "value"], [["dbsn", 1], ["map", None]]
    )
    assert text == f"## Things\n\nWhat they are. Files: `things.md`, `things.csv`.\n\n{table}"
    assert (tmp_path / "things.md").read_text() == "# " + text[3:]
    assert (tmp_path / "things.csv").read_bytes() == b"method,value\r\ndbsn,1\r\nmap,\r\n"  # None: an empty field
    assert report.files == [tmp_path / "things.csv", tmp_path / "things.md"]


def test_write_section_page_and_csv_only(tmp_path):
    report = Report(tmp_path, [], unconverged={"map"})
    table = md_table(["method", "value"], [["map", 1]])
    text = write_section(report, "bare", "Bare", "Intro.", f"{table}\n", ["method"], [], page=table)
    assert (
        tmp_path / "bare.md"
    ).read_text() == f"# Bare\n\n| method | value |\n|---|---|\n| map {UNCONVERGED_MARK} | 1 |\n"
    assert text.endswith(f"{table}\n") and "| map | 1 |" in text  # report.md is marked when it is written as a whole
    assert write_section(report, "only", "Only", "Intro.", "", ["a"], [], markdown=False).startswith(
        "## Only\n\nIntro. Files: `only.csv`."
    )
    assert not (tmp_path / "only.md").exists() and (tmp_path / "only.csv").is_file()


def test_no_private_name_is_imported_across_the_report_modules():
    package = Path(dbsn.evaluation.report.__file__).parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dbsn."):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.relative_to(package)} imports {private} from {node.module}"
