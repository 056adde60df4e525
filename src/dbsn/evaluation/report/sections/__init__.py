"""The report's sections, one module per family: each section reads the finished runs' records,
writes its table(s) and figures through `dbsn.evaluation.report.writer`, and returns its part of
report.md ("" when no run has what it shows)."""
