"""The step suite (dbsn.tools.bench.step): operations, host reads and the traced cell of a training
step, per cell, on a tiny network."""

from __future__ import annotations

from dbsn.tools.bench import step


def test_the_fused_step_dispatches_fewer_operations_and_reads_nothing_on_the_host():
    result = step.run(batch=2, repeats=1, trace=True, net="tiny", timed_net="tiny")
    per_edge, fused = result["counts"]["per_edge"], result["counts"]["fused"]
    assert fused["aten_ops"] < per_edge["aten_ops"] and fused["launching_ops"] < per_edge["launching_ops"]
    assert 0 < fused["launching_ops"] < fused["aten_ops"]
    assert per_edge["host_syncs"] == fused["host_syncs"] == 0
    traced = result["traced_cell"]
    assert 0 < traced["fused"]["forward_nodes"] < traced["per_edge"]["forward_nodes"]
    assert traced["fused"]["backward_nodes"] > 0
    assert all(seconds > 0 for cell in result["seconds"].values() for seconds in cell.values())
    table = step.markdown(result, 2)
    assert "| host synchronisations | 0 | 0 |" in table and "traced forward" in table


def test_the_counter_sees_a_host_read():
    """Guards the zero above: `.item()` in the counted block is a host read."""
    import torch

    with step.OpCounter() as counter:
        torch.ones(3).sum().item()
    assert counter.host_reads == 1 and counter.launching >= 1
