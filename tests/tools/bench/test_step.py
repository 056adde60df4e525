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


def test_the_step_categories_add_up_to_its_kernel_launching_operations():
    """Every kernel-launching operation of a step lands in exactly one category, and the cell's
    own parts get operations of their own (forward and backward)."""
    from dbsn.tools.bench.categories import ALPHA_SUMS, BATCHNORM, CONV, DEPTHWISE, EDGE_AFFINE

    method = step.build("fused", "tiny")
    run = step.training_step(method, 2)
    run()
    with step.OpCounter() as counter:
        run()
    counts = step.count_categories("fused", net="tiny")
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total") == counter.launching
    assert all(counts[key] > 0 for key in (CONV, DEPTHWISE, BATCHNORM, EDGE_AFFINE, ALPHA_SUMS))


def test_a_backward_operation_belongs_where_its_forward_ran():
    """A depthwise convolution, a cast and an EdgeAffine, forward and backward: each category gets
    exactly its own operations (the backward ones through the autograd node's forward module)."""
    import torch
    from torch import nn

    from dbsn.nets.fused_cell import EdgeAffine
    from dbsn.tools.bench.categories import CASTS, CATEGORIES, DEPTHWISE, EDGE_AFFINE, OTHER, Categories

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    def counted(run):
        with Categories() as categories:
            run()
        return categories

    depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    affine = EdgeAffine(1, 2, 4)
    plain = counted(lambda: (leaf(2, 8, 5, 5) * 1.0).sum().backward())  # what the other blocks add
    alone = counted(lambda: (depthwise(leaf(2, 4, 5, 5)) * 1.0).sum().backward())
    assert alone.counts[DEPTHWISE] == 2 and alone.counts[OTHER] == plain.launching  # convolution, its backward
    cast = counted(lambda: (leaf(2, 8, 5, 5).double() * 1.0).sum().backward())
    assert cast.counts[CASTS] == 2 and cast.counts[OTHER] == plain.launching  # the cast, its backward's cast back
    edge = counted(lambda: (affine(leaf(2, 4, 5, 5))[0] * 1.0).sum().backward())
    assert edge.counts[EDGE_AFFINE] >= 4 and edge.counts[OTHER] == plain.launching  # addcmul, relu and backwards
    assert set(edge.counts) == set(CATEGORIES) and edge.launching == edge.counts[EDGE_AFFINE] + plain.launching


def test_the_nodes_only_compile_makes_one_graph_per_cell_shape_and_recompiles_nothing():
    result = step.nodes_compile(net="tiny")
    if "error" in result:
        import pytest

        pytest.skip(result["error"])  # compile.scope=nodes is another part's option
    assert result["graphs"] >= 1 and result["recompiles"] == 0
