"""What a method costs, beside how good it is: the cost columns of the comparison tables.

`parameter_count` (the parameters the method learns), `training_flops_per_image` (one training
step's forward and backward: all T structures, every chunk, every member),
`prediction_flops_per_image` (the Bayes-ensemble prediction at the method's S), `EpochTimer` (a
callback timing every training epoch, validation excluded), `peak_memory_mib` (the CUDA
allocator's peak on a GPU, the resident set's on a CPU); `measure_cost` -> `Cost` gives them all.

FLOPs are torch's `FlopCounterMode` totals: matmuls and convolutions only, 2 FLOPs per multiply-add.
Backward counts are the products autograd computes: every layer's weight gradient, the input
gradient only where one is needed (the first layer's backward costs one forward, every later
layer's two), and a grouped convolution's weight gradient with its groups (torch counts it as a
dense convolution's, which inflates a DBSN step's count: `flop_counter_mode`). Elementwise work
(activations, BatchNorm, softmax, the optimiser step) is not counted. Counts grow with T and S as
the network runs them: the structure-independent stem runs once per grouped forward, so a step
costs stem + T · the rest. Counting a compiled network has not been tried.

Every function leaves the method as it found it: the counts run on a copy (without the trainer),
under a forked random stream, so parameters, gradients, running statistics, buffers, modes and the
global random state are untouched.
"""

from __future__ import annotations

import copy
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from dbsn.methods.base import Method

__all__ = [
    "Cost",
    "EpochTimer",
    "measure_cost",
    "parameter_count",
    "peak_memory_mib",
    "prediction_flops_per_image",
    "training_flops_per_image",
]


def parameter_count(model: nn.Module) -> int:
    """The number of values the model learns: every parameter that requires a gradient (network
    weights, the structure logits θ, a Gaussian posterior's means and scales ρ), each shared
    tensor once; for a deep ensemble the sum over its members. Buffers are not counted
    (BatchNorm running statistics, a fixed α, the post-hoc temperature)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _device(model: nn.Module) -> torch.device:
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _detached_copy(method: Method, device: torch.device) -> Method:
    """A deep copy of the method on `device` without its trainer (LightningModule's `__getstate__`
    leaves `_trainer` out, its members' too): the copy runs as one device, whatever the run's DDP
    layout, and the trainer is neither copied nor touched."""
    twin = copy.deepcopy(method)
    for m in twin.modules():  # in case a Lightning version keeps it
        if isinstance(m, pl.LightningModule):
            m._trainer = None
    return twin.to(device)


@contextmanager
def _own_random_stream(device: torch.device):
    """The global random state (CPU, and the model's GPU) as it was before, afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def _outside_inference(t: Tensor) -> Tensor:
    """`t`, or a normal copy of it where it is an inference tensor (called outside inference mode)."""
    return t.clone() if t.is_inference() else t


def _grouped_conv_backward_flop(
    grad_out_shape,
    x_shape,
    w_shape,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed,
    _output_padding,
    _groups,
    output_mask,
    out_shape=None,
    **kwargs,
) -> int:
    """A convolution's backward: each gradient asked for (input, weight) costs the forward's FLOPs.
    torch's own formula leaves the groups out of the weight gradient (it counts a depthwise
    convolution's as a dense one's: C times too many; a DBSN cell is mostly depthwise)."""
    forward = flop_counter.conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def flop_counter_mode() -> FlopCounterMode:
    """torch's `FlopCounterMode` (matmuls and convolutions, 2 FLOPs per multiply-add), with the
    backward of grouped convolutions counted right (`_grouped_conv_backward_flop`)."""
    return FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.convolution_backward: _grouped_conv_backward_flop}
    )


def _count_flops(run) -> int:
    with flop_counter_mode() as counter:
        run()
    return int(counter.get_total_flops())


def training_flops_per_image(method: Method, x: Tensor, y: Tensor, device: torch.device | str | None = None) -> float:
    """FLOPs of one training step's forward and backward on the batch (x, y), divided by its
    size: `method.accumulate_gradients` in train mode, every chunk of the T structures and every
    member of an ensemble, without the optimiser step (see the module docstring for what is
    counted). Runs on a copy; a method whose `dataset_size` is unset gets the batch size there
    (N only scales the KL term, which has no matmuls). `device`: where the copy counts (default:
    where the method is).

    The inputs may be inference tensors (the examples a test pass keeps were made under Lightning's
    `torch.inference_mode`), and the caller may be inside `torch.no_grad()` or inference mode:
    the step runs with gradients on, outside inference mode, on normal copies of such inputs
    (autograd cannot save an inference tensor for backward)."""
    device = torch.device(device) if device is not None else _device(method)
    with torch.inference_mode(False), torch.enable_grad(), _own_random_stream(device):
        x, y = _outside_inference(x.to(device)), _outside_inference(y.to(device))
        twin = _detached_copy(method, device)
        twin.train()
        for m in twin.modules():
            if isinstance(m, Method) and m.dataset_size is None:
                m.dataset_size = x.shape[0]
        for p in twin.parameters():
            p.grad = None
        flops = _count_flops(lambda: twin.accumulate_gradients(x, y, lambda loss, last: loss.backward()))
    return flops / x.shape[0]


def prediction_flops_per_image(method: Method, x: Tensor, device: torch.device | str | None = None) -> float:
    """FLOPs of the Bayes-ensemble prediction `method.predict_log_probs(x)` at the method's S
    (`prediction.n_samples`; one pass for a deterministic method, each member's own for a deep
    ensemble), in eval mode with test-time noise on (MC dropout), divided by the batch size.

    Runs on a copy; where the method computes per-structure BatchNorm statistics for its fixed
    members (DBSN's `bn_recalibration`), after a one-image prediction outside the count: work a
    method does once and keeps is not a per-image cost. `device`: where the copy counts (default:
    where the method is)."""
    device = torch.device(device) if device is not None else _device(method)
    x = x.to(device)
    with _own_random_stream(device), torch.no_grad():
        twin = _detached_copy(method, device)
        twin.eval()
        twin.enable_test_noise()
        if getattr(getattr(twin, "bn_recalibration", None), "enabled", False):
            twin.predict_log_probs(x[:1])
        flops = _count_flops(lambda: twin.predict_log_probs(x))
    return flops / x.shape[0]


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start `peak_memory_mib` afresh (a training run does before it fits, so that runs one after
    another in one process, as `dbsn-compare` makes them, each report their own peak): the CUDA
    allocator's peak, or on Linux the resident set's high-water mark (`/proc/self/clear_refs`)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        if torch.cuda.is_initialized():  # before CUDA starts nothing is allocated (and resetting fails)
            torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # elsewhere the peak is the process's since it started


def _high_water_mark_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_mib(device: torch.device | str | None = None) -> tuple[float, str]:
    """(peak memory in MiB, what it is): on a CUDA device the most the caching allocator held
    in tensors since the process started or its last `reset_peak_memory` (`torch.cuda.
    max_memory_allocated`, "cuda_max_allocated"); elsewhere the process's peak resident set size
    since it started or its last `reset_peak_memory` (Linux's VmHWM, else `getrusage`'s
    ru_maxrss; "cpu_max_rss": everything the process held, the Python interpreter and data
    included)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    hwm = _high_water_mark_kib()
    if hwm is not None:
        return hwm / 2**10, "cpu_max_rss"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "cpu_max_rss"


@dataclass
class Cost:
    """What a method costs (see the module docstring for how each is measured).

    Attributes:
        params: `parameter_count`.
        train_flops_per_image: `training_flops_per_image` (forward + backward, all T structures);
            None for a model that is not trained itself (a post-hoc posterior, built from a
            finished run whose cost is that run's).
        predict_flops_per_image: `prediction_flops_per_image` at `n_samples`.
        n_samples: the members the prediction averages (`method.num_members`: S for a
            stochastic method, 1 for a deterministic one, M networks for a deep ensemble).
        epoch_seconds: mean wall time of a training epoch (`EpochTimer`), None when not timed.
        peak_memory_mib: `peak_memory_mib` when the cost was measured, before its own counts.
        peak_memory_of: which peak that is ("cuda_max_allocated" or "cpu_max_rss"): the two
            do not compare.
    """

    params: int
    train_flops_per_image: float | None
    predict_flops_per_image: float
    n_samples: int
    epoch_seconds: float | None = None
    peak_memory_mib: float | None = None
    peak_memory_of: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_cost(
    method: Method, x: Tensor, y: Tensor, epoch_seconds: float | None = None, device: torch.device | str | None = None
) -> Cost:
    """Everything measurable of the method's cost on the batch (x, y); `epoch_seconds` from an
    `EpochTimer` of its training run. The peak memory is read first, so that it is the run's
    so far (call this after training, in the training process) and not the counts' copies.
    `device`: the run's device, where the counts run and whose peak memory is read (default:
    where the method is; after `trainer.test` that is the CPU, where Lightning's teardown leaves
    the model, whatever device the run used)."""
    device = torch.device(device) if device is not None else _device(method)
    peak, peak_of = peak_memory_mib(device)
    try:
        train_flops = training_flops_per_image(method, x, y, device)
    except NotImplementedError:  # built post hoc, not trained
        train_flops = None
    return Cost(
        params=parameter_count(method),
        train_flops_per_image=train_flops,
        predict_flops_per_image=prediction_flops_per_image(method, x, device),
        n_samples=int(method.num_members),
        epoch_seconds=epoch_seconds,
        peak_memory_mib=peak,
        peak_memory_of=peak_of,
    )


class EpochTimer(pl.Callback):
    """Wall time of every training epoch (`time.perf_counter`, from `on_train_epoch_start` to
    `on_train_epoch_end`), less the validation that Lightning runs inside the epoch: the
    training's own time, whatever the validation schedule and S. The list is kept in
    checkpoints, so a resumed run's mean covers the epochs before the resume too (an epoch cut
    short by the interruption is not recorded).

    Attributes:
        epoch_seconds: one entry per finished training epoch.
    """

    def __init__(self) -> None:
        self.epoch_seconds: list[float] = []
        self._started: float | None = None
        self._validation_started: float | None = None
        self._validation_seconds = 0.0

    @property
    def mean_epoch_seconds(self) -> float | None:
        """The mean over the finished epochs; None before the first one ends."""
        return statistics.fmean(self.epoch_seconds) if self.epoch_seconds else None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_seconds = 0.0
        self._validation_started = None
        self._started = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._started is not None:  # inside a training epoch (not the sanity check before it)
            self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_started is not None:
            self._validation_seconds += time.perf_counter() - self._validation_started
            self._validation_started = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._started is None:
            return
        self.epoch_seconds.append(time.perf_counter() - self._started - self._validation_seconds)
        self._started = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_seconds": list(self.epoch_seconds)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch_seconds = [float(s) for s in state_dict.get("epoch_seconds", [])]
