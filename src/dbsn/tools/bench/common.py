"""What both bench suites share: the networks, device names and synchronisation."""

from __future__ import annotations

import platform
import time

import torch

NETS = {
    "quick": dict(num_nodes=4, cells_per_stage=1),  # the paper's ~41K-parameter small model
    "paper": dict(num_nodes=7, cells_per_stage=4),  # the paper's CIFAR model, ~1.0M parameters
    "tiny": dict(num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8),  # tests of the bench
}

#: aten operations that do not launch a kernel on a GPU (views, metadata, profiler marks)
VIEWS = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.detach",
        "aten.alias",
        "aten.select",
        "aten.slice",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.permute",
        "aten.expand",
        "aten.t",
        "aten.transpose",
        "aten.unbind",
        "aten.split",
        "aten.split_with_sizes",
        "aten.as_strided",
        "aten._reshape_alias",
        "aten.narrow",
        "aten.lift_fresh",
        "aten.promote_types",
        "aten.chunk",
        "aten.unflatten",
        "aten.movedim",
        "aten.result_type",
        "profiler._record_function_enter_new",
        "profiler._record_function_exit",
    }
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(run, device: torch.device) -> float:
    """Seconds of one call of `run`, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - start


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
