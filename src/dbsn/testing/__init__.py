"""Checks for an extension of dbsn, one call each, usable from an outside package's tests:

    from dbsn.testing import check_method
    def test_my_method():
        check_method(MyMethod)

`check_method`, `check_ood_score`, `check_calibrator` and `check_evaluation` make the checks dbsn's own
tests make of its methods (tests/methods/test_member_outputs.py), OOD scores
(tests/evaluation/test_detection.py), calibrators (tests/posthoc/test_calibrators.py) and evaluations,
on small random inputs on the CPU, in seconds. Each raises AssertionError naming what failed, and
returns what it checked.
"""

from dbsn.testing.checks import (
    check_calibrator,
    check_evaluation,
    check_method,
    check_ood_score,
    make_subject,
    miscalibrated,
    tiny_net,
)

__all__ = [
    "check_calibrator",
    "check_evaluation",
    "check_method",
    "check_ood_score",
    "make_subject",
    "miscalibrated",
    "tiny_net",
]
