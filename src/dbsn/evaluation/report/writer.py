"""Writing into the report folder: every file a section writes goes through here, is listed in
`Report.files` and in the folder's manifest (`Report.folder`, `report.folder.ReportFolder`: the
report writes only files it made), and its markdown tables carry the unconverged mark
(`format.mark_unconverged`).
`write_section` writes a section's CSV and markdown page and returns its part of report.md."""

from __future__ import annotations

import csv
from pathlib import Path

from dbsn.evaluation.plots import save_figure
from dbsn.evaluation.report.collect import Report
from dbsn.evaluation.report.format import mark_unconverged


def _claim(report: Report, name: str) -> Path:
    if report.folder is not None:
        report.folder.claim(name)
    return report.out / name


def _written(report: Report, path: Path) -> None:
    report.files.append(path)
    if report.folder is not None and path:
        report.folder.record(path)


def write_markdown(report: Report, name: str, text: str) -> Path:
    """`text` into `<out>/<name>`, the unconverged methods' rows marked."""
    path = _claim(report, name)
    path.write_text(mark_unconverged(report.unconverged, text))
    _written(report, path)
    return path


def write_csv(report: Report, name: str, header: list[str], rows: list[list]) -> None:
    """`header` and `rows` into `<out>/<name>`, None as an empty field."""
    path = _claim(report, name)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if c is None else c for c in row] for row in rows])
    _written(report, path)


def write_figure(report: Report, figure, name: str) -> Path:
    """A matplotlib figure into `<out>/<name>` (`plots.save_figure`: falsy where none was saved)."""
    path = save_figure(figure, _claim(report, name))
    _written(report, path)
    return path


def read_rows(path: Path) -> list[dict]:
    """A run's CSV file as one dict per row."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_section(
    report: Report,
    stem: str,
    title: str,
    intro: str,
    body: str,
    header: list[str],
    rows: list[list],
    page: str | None = None,
    markdown: bool = True,
) -> str:
    """One section of report.md: `## title`, `intro` followed by the files it writes, then `body`.
    Writes `<stem>.csv` (`header`, `rows`) and, with `markdown`, the page `<stem>.md`: the section
    under a `# title` heading, or only `page` (e.g. the bare table) below it. Returns the section's text."""
    files = f"`{stem}.md`, `{stem}.csv`" if markdown else f"`{stem}.csv`"
    text = f"## {title}\n\n{intro} Files: {files}.\n\n{body}"
    write_csv(report, f"{stem}.csv", header, rows)
    if markdown:
        write_markdown(report, f"{stem}.md", text.replace("## ", "# ", 1) if page is None else f"# {title}\n\n{page}")
    return text
