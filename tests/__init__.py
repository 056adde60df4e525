"""The test suite. Its folders mirror src/dbsn: tests/<package>/test_<module>.py tests
src/dbsn/<package>/<module>.py (a loose module of the package, dbsn/precision.py, at the top:
tests/test_precision.py); a test that runs train.py or evaluate.py end to end sits beside the
module whose behaviour it checks. Tests of the package as a whole sit at the top
(test_imports.py: the import layering) or by what they check (docs/test_extending.py: the page
docs/extending.md). Helpers shared by several test modules are in `tests.support`; fixtures
shared across folders in tests/conftest.py."""
