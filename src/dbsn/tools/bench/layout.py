"""`python -m dbsn.tools.bench --suite layout`: which memory layout `model.execution.channels_last=auto`
gives a CPU.

DBSN's eager training step (the fused cell) on a network (`make train`'s by default), contiguous
and channels-last, in float32 and under CPU bf16 autocast, timed in interleaved repetitions within
one process (ratios, not seconds, are what holds between runs), after two warm-up steps each. The
step is `Method.accumulate_gradients` and both optimisers, as the CPU suite's cases run it. Run it
on CPUs with and without native bf16 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX
MKL_ENABLE_INSTRUCTIONS=AVX2` emulates the latter on a native one).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from dbsn.methods import DBSN, Execution
from dbsn.nets import StructureNet
from dbsn.tools.bench.common import NETS

CASES = tuple((layout, precision) for layout in ("contiguous", "channels_last") for precision in ("fp32", "bf16"))


def step_of(net_name: str, train_samples: int, batch: int, channels_last: bool, bf16: bool):
    """One DBSN training step (forward, backward, both optimisers) as a zero-argument callable."""
    torch.manual_seed(0)
    method = DBSN(
        StructureNet(num_classes=10, **NETS[net_name]),
        train_samples=train_samples,
        execution=Execution(channels_last=channels_last),
    )
    method.dataset_size = 50_000
    groups = method.weight_parameter_groups()
    optimisers = [method.optim.build(group, 100, method.no_decay_parameters())[0] for group in groups]
    optimisers.append(method.structure_optimizer().build(method.structure_parameters()))
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step():
        for optimiser in optimisers:
            optimiser.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
        for optimiser in optimisers:
            optimiser.step()
        method.on_after_optimizer_step(batch)

    return step


def run(net_name: str = "quick", train_samples: int = 1, batch: int = 64, repeats: int = 5) -> dict:
    """Median seconds of each case and channels-last over contiguous, per precision."""
    steps = {
        case: step_of(net_name, train_samples, batch, case[0] == "channels_last", case[1] == "bf16") for case in CASES
    }
    for step in steps.values():
        step(), step()
    times: dict = {case: [] for case in CASES}
    for _ in range(repeats):
        for case, step in steps.items():
            start = time.perf_counter()
            step()
            times[case].append(time.perf_counter() - start)
    median = {f"{layout} {precision}": statistics.median(times[(layout, precision)]) for layout, precision in CASES}
    return {
        "net": net_name,
        "train_samples": train_samples,
        "batch": batch,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "seconds": median,
        "channels_last / contiguous": {
            p: median[f"channels_last {p}"] / median[f"contiguous {p}"] for p in ("fp32", "bf16")
        },
    }


def markdown(result: dict) -> str:
    ratio = result["channels_last / contiguous"]
    seconds = result["seconds"]
    return "\n".join(
        [
            f"DBSN eager step, T = {result['train_samples']}, {result['net']} network, batch {result['batch']}, "
            f"{result['threads']} thread(s), {result['cpu_capability']} (native bf16: {result['native_bf16']}), "
            f"median of {result['repeats']}:",
            "",
            "| precision | contiguous s | channels-last s | channels-last / contiguous |",
            "|---|---|---|---|",
            *[
                f"| {p} | {seconds[f'contiguous {p}']:.3f} | {seconds[f'channels_last {p}']:.3f} | {ratio[p]:.2f} |"
                for p in ("fp32", "bf16")
            ],
        ]
    )
