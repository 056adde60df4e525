"""The report's paired CE² rows: method − reference of the unbiased squared calibration error on the
same test examples, tested with `metrics.ce2_inference` instead of the percentile bootstrap (which
is far too wide for this U-statistic where the truth is near 0).

Per seed: `paired_test` (the difference, the interval of the differences it does not reject, and its
p). Over k seeds the k differences share one test set: `test_cov` is the (k, k) covariance of their
test-set noise (`ce2_difference_covariance`), what `combine_seeds(values, test_cov, level)` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dbsn.metrics.ce2_inference import TestResult, ce2_difference_covariance, paired_test

__all__ = ["CE2_ROWS", "CE2Difference", "ce2_differences"]

#: the paired table's CE² rows and the predictions each is computed from
CE2_ROWS = {"CE²": "log_probs", "calibrated CE²": "calibrated_log_probs"}


@dataclass(frozen=True)
class CE2Difference:
    """One CE² row of method − reference: `seeds` {seed: (value, low, high)} from each seed's
    `paired_test`; `values` (k,) the differences in the order of `seeds`, `test_cov` (k, k) the
    covariance of their test-set noise; `single` the test itself where there is one seed (else None)."""

    seeds: dict
    values: Tensor
    test_cov: Tensor
    single: TestResult | None


def ce2_differences(method: dict, reference: dict, seeds: list, level: float) -> dict[str, CE2Difference]:
    """{row: CE2Difference} for each `CE2_ROWS` row both runs of every seed in `seeds` have
    (`method[seed]`, `reference[seed]`: predictions with "log_probs", "targets" and optionally
    "calibrated_log_probs", on the same test examples)."""
    out = {}
    for row, key in CE2_ROWS.items():
        if not seeds or any(key not in method[s] or key not in reference[s] for s in seeds):
            continue
        pairs = [(method[s][key].double().exp(), reference[s][key].double().exp()) for s in seeds]
        targets = [reference[s]["targets"] for s in seeds]
        tests = {s: paired_test(a, b, y, level) for s, (a, b), y in zip(seeds, pairs, targets)}
        if all(torch.equal(y, targets[0]) for y in targets):
            test_cov = ce2_difference_covariance(pairs, targets[0])
        else:  # seeds tested on different examples share no test noise
            test_cov = torch.diag(torch.cat([ce2_difference_covariance([p], y)[0] for p, y in zip(pairs, targets)]))
        out[row] = CE2Difference(
            seeds={s: tuple(t[:3]) for s, t in tests.items()},
            values=torch.tensor([tests[s].value for s in seeds], dtype=torch.float64),
            test_cov=test_cov,
            single=tests[seeds[0]] if len(seeds) == 1 else None,
        )
    return out
