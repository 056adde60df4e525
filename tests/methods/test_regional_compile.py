"""Regional compilation (`Compilation(scope="cells")`): each cell's forward compiled, each cell shape
once, and no cell recompiling after the first step (dynamo's own backend: no code generation,
so this runs in seconds)."""

from __future__ import annotations

import pytest
import torch

from dbsn.methods import DBSN, Compilation, Execution
from dbsn.nets import StructureNet
from tests.support.steputil import assert_same, step_state


def _method(scope: str) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=1, growth=4, stem_channels=8)
    compile = Compilation(enabled=True, scope=scope, backend="eager")
    return DBSN(net, train_samples=2, dataset_size=10, execution=Execution(compile=compile))


def test_compiled_cells_compile_each_shape_once_and_not_again_after_the_first_step():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    method = _method("cells")
    eager = _method("network")
    eager.execution.compile.enabled = False
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    first = step_state(method, x, y)
    graphs = counters["stats"]["unique_graphs"]
    cells = sum(1 for stage in method.net.stages for _ in stage)
    assert 0 < graphs <= cells, (graphs, cells)  # each cell shape once (a dense cell's width grows cell by cell)
    eager.load_state_dict(method.state_dict())
    try:
        torch.compiler.set_stance("fail_on_recompile")
        second = step_state(method, x * 0.5, y, seed=8)  # new data, new structures: nothing compiles
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == graphs
    # and the compiled cells compute what the eager ones do
    for key, value in step_state(eager, x * 0.5, y, seed=8).items():
        torch.testing.assert_close(second[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert first.keys() == second.keys()
    torch._dynamo.reset()


# ------------------------------------------------------------------ compile.scope=nodes
def _counted():
    """A fresh dynamo state and its counters (unique_graphs: graphs compiled)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters["stats"]


def _nodes_method(net_kwargs: dict, backend: str = "eager", dtype=torch.float32, **kwargs) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(**net_kwargs).to(dtype)
    compile = Compilation(enabled=True, scope="nodes", backend=backend, fullgraph=True)
    return DBSN(net, dataset_size=10, execution=Execution(compile=compile), **kwargs).to(dtype)


TINY = dict(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=1, growth=4, stem_channels=8)


def test_nodes_compile_of_the_paper_network_makes_4_graphs_and_none_in_a_second_step():
    # the paper's CIFAR network (B = 7, 3 stages of 4 cells) at T = 4, as the bench builds it: a cell's
    # nodes have the same shapes in every cell of a stage but the first, whose rows are shared by the T
    # structures; the running statistics' list grows cell by cell and must not be seen
    stats = _counted()
    method = _nodes_method(dict(num_classes=10, num_nodes=7, cells_per_stage=4), train_samples=4)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    step_state(method, x, y)
    assert stats["unique_graphs"] == 4
    try:
        torch.compiler.set_stance("fail_on_recompile")
        step_state(method, x * 0.5, y, seed=8)  # new data, new structures
    finally:
        torch.compiler.set_stance("default")
    assert stats["unique_graphs"] == 4
    torch._dynamo.reset()


def test_a_warm_up_under_the_captures_autocast_settings_leaves_nothing_to_compile_in_the_capture():
    # GraphedStep's warm-up and capture, on a CPU: Lightning's autocast (cache on) around the capture's
    # settings (`_autocast_for_capture`: cache off)
    from dbsn.methods.step import _autocast_for_capture

    stats = _counted()
    method = _nodes_method(TINY, train_samples=2)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # Lightning's
        with _autocast_for_capture("cpu"):
            assert not torch.is_autocast_cache_enabled()
            step_state(method, x, y)  # warm-up: compiles
        graphs = stats["unique_graphs"]
        assert graphs > 0
        try:
            torch.compiler.set_stance("fail_on_recompile")
            with _autocast_for_capture("cpu"):
                step_state(method, x * 0.5, y, seed=8)  # the capture: nothing new
        finally:
            torch.compiler.set_stance("default")
        assert stats["unique_graphs"] == graphs
        step_state(method, x, y)  # a warm-up under Lightning's own settings would have compiled again:
    assert stats["unique_graphs"] > graphs  # dynamo guards the cache flag
    torch._dynamo.reset()


def _equals_eager(train_samples: int, chunk: int | None) -> None:
    stats = _counted()
    kwargs = dict(train_samples=train_samples, train_samples_per_forward=chunk)
    method = _nodes_method(TINY, backend="aot_eager", dtype=torch.float64, **kwargs)
    eager = _nodes_method(TINY, dtype=torch.float64, **kwargs)
    for cell in eager.net.modules():
        if hasattr(cell, "nodes_compile"):
            cell.nodes_compile = None
    eager.load_state_dict(method.state_dict())
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (4,))
    for seed in (7, 8):  # the second step also moves running statistics that the first moved
        compiled, reference = step_state(method, x, y, seed=seed), step_state(eager, x, y, seed=seed)
        assert_same(reference, compiled, rtol=1e-10, atol=1e-12)
    graphs = stats["unique_graphs"]
    assert 0 < graphs <= 2 * 3  # per stage: a first cell (shared rows), the others; twice with a last short chunk
    torch._dynamo.reset()


def test_the_nodes_compiled_step_equals_eager_in_float64_with_t_in_chunks():
    # chunks of 2 and 1 structures: the first a grouped forward under a detached leaf, the last under α
    # itself, as the grouped step runs (whose graph count the paper network's test checks)
    _equals_eager(train_samples=3, chunk=2)


def test_nodes_compile_refuses_a_network_of_per_edge_cells():
    net = StructureNet(**TINY, cell="per_edge")
    with pytest.raises(ValueError, match="compile.scope=nodes compiles the fused cell's nodes.*model.net.cell=fused"):
        Compilation(enabled=True, scope="nodes", backend="eager").apply(net)


def test_nodes_compiled_prediction_and_per_structure_statistics_equal_eager_and_compile_once():
    # eval mode (running statistics), and the statistics of each structure, which every BatchNorm
    # collects into a list of its own that grows batch by batch (dynamo's graphs run as traced: what is
    # checked is what the region sees and hands back; the step's test checks aot_eager's functional graphs)
    from dbsn.nets.batchnorm import structure_statistics, using_statistics
    from tests.support.steputil import prediction

    stats = _counted()
    method = _nodes_method(TINY, dtype=torch.float64, train_samples=2)
    eager = _nodes_method(TINY, dtype=torch.float64, train_samples=2)
    for cell in eager.net.modules():
        if hasattr(cell, "nodes_compile"):
            cell.nodes_compile = None
    eager.load_state_dict(method.state_dict())
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    alpha = torch.softmax(torch.randn(2, len(method.net.edges), len(method.net.op_names), dtype=torch.float64), -1)
    torch.testing.assert_close(prediction(method, x, 4), prediction(eager, x, 4), rtol=1e-10, atol=1e-12)
    graphs = stats["unique_graphs"]
    try:
        torch.compiler.set_stance("fail_on_recompile")
        torch.testing.assert_close(
            prediction(method, x * 0.5, 4), prediction(eager, x * 0.5, 4), rtol=1e-10, atol=1e-12
        )
    finally:
        torch.compiler.set_stance("default")
    batches = [x, x.flip(0)]
    per_structure = [
        structure_statistics(lambda b, m=m: m.net(b, alpha, replicate=True), m.net, batches, 2) for m in (method, eager)
    ]
    assert per_structure[0].keys() == per_structure[1].keys()
    for name, (mean, var) in per_structure[1].items():
        torch.testing.assert_close(per_structure[0][name][0], mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(per_structure[0][name][1], var, rtol=1e-10, atol=1e-12)
    with torch.no_grad(), using_statistics(method.net, per_structure[0]), using_statistics(eager.net, per_structure[1]):
        torch.testing.assert_close(
            method.net(x, alpha, replicate=True), eager.net(x, alpha, replicate=True), rtol=1e-10, atol=1e-12
        )
    # at most one set of graphs each for prediction, collecting statistics (whatever the batch) and using them
    assert stats["unique_graphs"] <= graphs * 3
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nodes_compiled_step_in_a_cuda_graph_compiles_nothing_after_the_first_warm_up_step(precision):
    # GraphedStep under Lightning's autocast (cache on): three warm-up steps, the capture, replays; from
    # the second step on nothing may compile, and the losses follow the eager step's
    from dbsn.methods.step import GraphedStep

    def steps(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        net = StructureNet(**TINY)
        compile = Compilation(enabled=compiled, scope="nodes", backend="aot_eager", fullgraph=True)
        execution = Execution(compile=compile, cuda_graph=True)
        method = DBSN(net, train_samples=4, dataset_size=100, execution=execution).cuda()
        weights = [method.optim.build(method.weight_parameters(), 10, capturable=True)[0]]
        opts = weights + [method.structure_optimizer().build(method.structure_parameters(), capturable=True)]
        method.attach_guard(opts)
        method.train()
        run = GraphedStep(
            lambda x, y: method.step_body(x, y, opts, weights, lambda loss, last: loss.backward()),
            lambda: [opt.zero_grad(set_to_none=True) for opt in opts],
        )
        generator = torch.Generator(device="cuda").manual_seed(1)
        torch.manual_seed(2)
        losses = []
        try:
            for step in range(7):
                if compiled and step == 1:
                    torch.compiler.set_stance("fail_on_recompile")
                x = torch.randn(6, 3, 16, 16, device="cuda", generator=generator)
                y = torch.randint(0, 5, (6,), device="cuda", generator=generator)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    losses.append(run(x, y)["loss"].float())
                method.on_after_optimizer_step(6)
        finally:
            torch.compiler.set_stance("default")
        assert run.graph is not None
        return torch.stack(losses)

    stats = _counted()
    compiled = steps(True)
    assert stats["unique_graphs"] > 0
    tolerance = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(compiled, steps(False), **tolerance)
    torch._dynamo.reset()
