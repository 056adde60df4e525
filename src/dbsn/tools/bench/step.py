"""What predicts the paper step's time on a GPU, counted on any machine: operations per step.

On a GPU the paper network's eager step is bound by its dispatched operations, not by their
arithmetic (docs/performance.md), and a CUDA graph needs a step that never reads a device value
on the host. These rows count, for the per-edge and the fused cell, in one training step of the
paper network (B = 7, 12 cells, T = 4 grouped, batch 2, float32, contiguous as on a GPU, the fused
optimisers, the NaN guard attached; forward, backward and optimisers):

- aten operations (`TorchDispatchMode`), and those that launch a kernel on a GPU (all but views);
- host synchronisations: operations that read a device value on the host or copy host data to the
  device (target: 0);
- the fused step's kernel-launching operations by category (`dbsn.tools.bench.categories`);
- one cell's traced graph (dynamo + AOTAutograd call nodes, forward and backward) and its tracing time;
- the nodes-only regional compile (``compile.scope=nodes``, eager backend): graphs in the first
  step, graphs compiled again in a second step (0), the first step's seconds;
- CPU seconds of a training step and of the S = 100 prediction (the small network), fused over per-edge.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dbsn.methods import DBSN, Compilation, Execution, Prediction
from dbsn.nets import StructureNet
from dbsn.tools.bench.categories import CATEGORIES
from dbsn.tools.bench.common import NETS, VIEWS

#: operations that read a device value on the host, or copy host data to the device
HOST_READS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.is_nonzero",
        "aten.nonzero",
        "aten.masked_select",
        "aten.equal",
        "aten.allclose",
        "aten.unique",
        "aten._unique2",
        "aten.lift_fresh",
    }
)
CELLS = ("per_edge", "fused")


class OpCounter(TorchDispatchMode):
    """Counts every aten operation dispatched inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def launching(self) -> int:
        return sum(n for name, n in self.counts.items() if name not in VIEWS)

    @property
    def host_reads(self) -> int:
        return sum(n for name, n in self.counts.items() if name in HOST_READS)


def build(cell: str, net: str = "paper", train_samples: int = 4, compile: Compilation | None = None) -> DBSN:
    torch.manual_seed(0)
    execution = Execution(channels_last=False, compile=compile or Compilation())
    return DBSN(
        StructureNet(num_classes=10, cell=cell, **NETS[net]),
        train_samples=train_samples,
        dataset_size=50_000,
        prediction=Prediction(n_samples=100, samples_per_forward=25),
        execution=execution,
    )


def training_step(method: DBSN, batch: int):
    """A zero-argument callable: one training step as `Method.training_step` runs it."""
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    weights = [method.optim.build(method.weight_parameters(), 100)[0]]
    opts = [*weights, method.structure_optimizer().build(method.structure_parameters())]
    method.attach_guard(opts)
    method.train()

    def step():
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        method.step_body(x, y, opts, weights, lambda loss, last: loss.backward())
        method.on_after_optimizer_step(batch)

    return step


def count_step(cell: str, batch: int = 2, net: str = "paper") -> dict[str, int]:
    """aten, kernel-launching and host-reading operations of one step (the paper network's)."""
    step = training_step(build(cell, net), batch)
    step()  # optimiser state, the BatchNorm update's index tensors
    with OpCounter() as counter:
        step()
    return {"aten_ops": counter.total, "launching_ops": counter.launching, "host_syncs": counter.host_reads}


def count_categories(cell: str = "fused", batch: int = 2, net: str = "paper") -> dict[str, int]:
    """Kernel-launching operations of one step by category (`dbsn.tools.bench.categories`), and
    their total."""
    from dbsn.tools.bench.categories import Categories

    step = training_step(build(cell, net), batch)
    step()
    with Categories() as categories:
        step()
    return {**categories.counts, "total": categories.launching}


def nodes_compile(batch: int = 2, net: str = "paper", backend: str = "eager") -> dict:
    """The nodes-only regional compile of the fused cell (``compile.scope=nodes``): graphs dynamo
    makes in a first training step, graphs made again in a second (recompiles) and the first
    step's seconds; ``{"error": ...}`` where the option is not available."""
    from torch._dynamo.utils import counters

    try:
        compile = Compilation(enabled=True, scope="nodes", backend=backend)
    except (TypeError, ValueError) as error:
        return {"error": f"not available: {error}"}
    torch._dynamo.reset()
    counters.clear()
    try:
        step = training_step(build("fused", net, compile=compile), batch)
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        graphs = counters["stats"]["unique_graphs"]
        step()
        return {
            "graphs": graphs,
            "recompiles": counters["stats"]["unique_graphs"] - graphs,
            "first_step_seconds": seconds,
            "backend": backend,
        }
    finally:
        torch._dynamo.reset()


def traced_cell(cell: str, groups: int = 4, batch: int = 2, net: str = "paper") -> dict[str, float]:
    """Call nodes of one cell's forward and backward graphs as dynamo and AOTAutograd trace them (a
    cell of the paper network's second stage), and the seconds the trace took."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    counts: dict[str, int] = {}

    def counting(kind):
        def compiler(graph_module, inputs):
            counts[kind] = counts.get(kind, 0) + sum(1 for n in graph_module.graph.nodes if n.op == "call_function")
            return make_boxed_func(graph_module.forward)

        return compiler

    method = build(cell, net)
    module = method.net.stages[1][-1]
    channels = module.preprocess[0].num_features
    x = torch.randn(batch * groups, channels, 16, 16)
    alpha = torch.softmax(torch.randn(groups, method.net.num_edges, method.net.num_ops), -1).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(
        module, backend=aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))
    )
    start = time.perf_counter()
    compiled(x, alpha).sum().backward()
    seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return {
        "forward_nodes": counts.get("forward", 0),
        "backward_nodes": counts.get("backward", 0),
        "trace_seconds": seconds,
    }


def timings(batch: int, repeats: int, net: str = "quick") -> dict[str, dict[str, float]]:
    """Median CPU seconds of a training step (T = 4) and of the S = 100 prediction of `batch`
    images, per cell, interleaved."""
    steps = {cell: training_step(build(cell, net), batch) for cell in CELLS}
    predictors = {cell: build(cell, net) for cell in CELLS}
    x = torch.randn(batch, 3, 32, 32)
    for method in predictors.values():
        method.eval()

    def predict(method):
        with torch.inference_mode():
            method.predict_log_probs(x, 100)

    runs = {(cell, "step"): steps[cell] for cell in CELLS}
    runs.update({(cell, "prediction"): (lambda m=predictors[cell]: predict(m)) for cell in CELLS})
    for run in runs.values():
        run()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    return {cell: {kind: statistics.median(times[(cell, kind)]) for kind in ("step", "prediction")} for cell in CELLS}


def run(batch: int = 64, repeats: int = 3, trace: bool = True, net: str = "paper", timed_net: str = "quick") -> dict:
    """The rows of the module docstring: counts and the traced cell on `net`, seconds on `timed_net`."""
    result = {
        "counts": {cell: count_step(cell, net=net) for cell in CELLS},
        "categories": {cell: count_categories(cell, net=net) for cell in CELLS},
    }
    if trace:
        result["traced_cell"] = {cell: traced_cell(cell, net=net) for cell in CELLS}
        result["nodes_compile"] = nodes_compile(net=net)
    result["seconds"] = timings(batch, repeats, timed_net)
    return result


def markdown(result: dict, batch: int) -> str:
    counts = result["counts"]
    lines = [
        "The paper network's T = 4 step (batch 2, float32, contiguous, fused optimisers), per cell:",
        "",
        "| per step | per-edge | fused | fused / per-edge | target |",
        "|---|---|---|---|---|",
    ]
    targets = {"aten_ops": "≤ 10,000", "launching_ops": "≤ 5,500", "host_syncs": "0"}
    names = {
        "aten_ops": "aten operations",
        "launching_ops": "kernel-launching operations",
        "host_syncs": "host synchronisations",
    }
    for key, name in names.items():
        a, b = counts["per_edge"][key], counts["fused"][key]
        ratio = f"{b / a:.3f}" if a else "-"
        ok = "✓" if (b == 0 if key == "host_syncs" else b <= int(targets[key][2:].replace(",", ""))) else "✗"
        lines.append(f"| {name} | {a:,} | {b:,} | {ratio} | {targets[key]} {ok} |")
    if "traced_cell" in result:
        traced = result["traced_cell"]
        for key, name in (
            ("forward_nodes", "one cell's traced forward (call nodes)"),
            ("backward_nodes", "one cell's traced backward (call nodes)"),
            ("trace_seconds", "seconds to trace one cell"),
        ):
            a, b = traced["per_edge"][key], traced["fused"][key]
            fmt = "{:.1f}" if key == "trace_seconds" else "{:,}"
            lines.append(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.3f} | |")
    if "categories" in result:
        for key in (*CATEGORIES, "total"):
            a, b = result["categories"]["per_edge"][key], result["categories"]["fused"][key]
            ratio = f"{b / a:.3f}" if a else "-"
            lines.append(f"| kernel-launching operations: {key} | {a:,} | {b:,} | {ratio} | |")
    compiled = result.get("nodes_compile")
    if compiled is not None:
        text = (
            compiled["error"]
            if "error" in compiled
            else (
                f"{compiled['graphs']} graphs, {compiled['recompiles']} recompiled in a second step, "
                f"first step {compiled['first_step_seconds']:.1f} s ({compiled['backend']} backend)"
            )
        )
        lines.append(f"| nodes-only compile (compile.scope=nodes) | | {text} | | 4 graphs, 0 recompiled |")
    seconds = result["seconds"]
    for kind, name in (
        ("step", f"CPU seconds, T = 4 step of the small network, batch {batch}"),
        ("prediction", f"CPU seconds, S = 100 prediction of {batch} images"),
    ):
        a, b = seconds["per_edge"][kind], seconds["fused"][kind]
        lines.append(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.2f} | |")
    return "\n".join(lines)
