"""Regional compilation (`Compilation(scope="cells")`): each cell's forward compiled, each cell shape
once, and no cell recompiling after the first step (dynamo's own backend: no code generation,
so this runs in seconds)."""

from __future__ import annotations

import torch

from dbsn.methods import DBSN, Compilation, Execution
from dbsn.nets import StructureNet
from tests.support.steputil import step_state


def _method(scope: str) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=3, num_stages=2, growth=4, stem_channels=8)
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
