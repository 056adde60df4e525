"""Selective prediction: how well each uncertainty score ranks the errors (AURC, E-AURC, AUGRC,
the risk at 80 % coverage)."""

from __future__ import annotations

from dbsn.evaluation.report.collect import Report, Run
from dbsn.evaluation.report.population import PopulationCells
from dbsn.evaluation.report.sections.accuracy import per_method_table


def selective_section(report: Report, ok: list[Run], cells: PopulationCells | None = None) -> str:
    scores = (("max_probability", "MSP"), ("predictive_entropy", "entropy"), ("mutual_information", "MI"))
    columns = [(f"AURC ({short})", f"selective/{score}/aurc", 1000.0, 2) for score, short in scores]
    columns += [(f"E-AURC ({short})", f"selective/{score}/eaurc", 1000.0, 2) for score, short in scores[:2]]
    columns += [
        ("AUGRC (MSP)", "selective/max_probability/augrc", 1000.0, 2),
        ("risk@80 % (MSP, %)", "selective/max_probability/risk@80", 100.0, 2),
    ]
    return per_method_table(
        report,
        ok,
        "selective",
        "Selective prediction",
        "How well each uncertainty score ranks the errors, accepting the most certain predictions first: AURC "
        "(area under the risk–coverage curve), E-AURC (its excess over the oracle's, which depends only on the "
        "error rate), AUGRC (Traub et al. 2024) in units of 1e-3, and the error rate of the 80 % most certain "
        "predictions. Lower is better; tied scores are accepted together.",
        columns,
        cells,
    )
