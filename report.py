"""Tables, figures and report.md from finished runs: `python report.py DIR [DIR ...] [--out OUT]`
(the same as `dbsn-report ...`; see dbsn.evaluation.report)."""

from dbsn.tools.report import cli

if __name__ == "__main__":
    cli()
