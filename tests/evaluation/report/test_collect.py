"""Collecting runs for the report (dbsn.evaluation.report.collect): the jobs a Hydra sweep should
have produced.
"""

from __future__ import annotations

from dbsn.evaluation.report.collect import expected_jobs
from tests.support.fakeruns import write_yaml


def test_sweep_expansion_handles_choice_range_and_lists(tmp_path):
    write_yaml(
        tmp_path / "multirun.yaml",
        {
            "hydra": {
                "sweeper": {"params": {"seed": "range(1,3)", "model": ["dbsn", "map"], "x": "choice(a,b)"}},
                "overrides": {"task": ["x=c", "trainer=cpu"]},
            }
        },
    )  # the command line replaces the sweeper's x
    jobs = expected_jobs(tmp_path)
    assert len(jobs) == 4
    assert {(j["seed"], j["model"], j["x"], j["trainer"]) for j in jobs} == {
        (s, m, "c", "cpu") for s in ("1", "2") for m in ("dbsn", "map")
    }


def test_a_field_sweeps_missing_jobs_are_named_by_method_and_backbone(tmp_path):
    from dbsn.evaluation.report.collect import missing_runs

    write_yaml(
        tmp_path / "multirun.yaml",
        {
            "hydra": {
                "sweeper": {
                    "params": {"field": "structure_net/dbsn,wrn28_10/mimo,wrn28_10/sngp_cifar100", "seed": "1"}
                },
                "runtime": {"choices": {"model": "dbsn", "data": "cifar100"}},
            }
        },
    )
    assert sorted(r.method for r in missing_runs(tmp_path, [])) == ["dbsn", "mimo@wrn28_10", "sngp@wrn28_10"]
