"""Tables, figures and report.md from finished runs: `python report.py DIR [DIR ...] [--out OUT]` (see dbsn.tools.report)."""

from dbsn.tools.report import main

if __name__ == "__main__":
    main()
