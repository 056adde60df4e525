"""Tables, figures and report.md from finished runs: `python report.py DIR [DIR ...] [--out OUT]` (see dbsn.tools.report)."""

from dbsn.tools.report import main
from dbsn.runtime.errors import one_line_errors

if __name__ == "__main__":
    one_line_errors(main)()
