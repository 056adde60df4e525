"""What lets a training step run without a host synchronisation, and be captured in a CUDA graph.

On a GPU the paper network's step is bound by the launching of its operations, not by their
arithmetic. Two things remove that cost: fewer operations (`dbsn.nets.fused_cell`), and a step
that the host queues without ever waiting for the device, which a CUDA graph then replays as
one launch. Waiting happens wherever the host reads a device value: ``.item()``, ``if tensor``,
a Python float made from a tensor, a tensor made from a host list. This module holds the two
pieces of the step that used to do so or that a graph needs:

- `FiniteGuard`: the NaN/inf guard, on the device. A non-finite loss sets a flag that the fused
  optimisers read (PyTorch's ``found_inf``, the mechanism of its mixed-precision scaler), so
  they skip their update in their kernel; the flag is sticky, so no later step moves a weight
  either; the BatchNorm running statistics stay (`RunningStatistics.apply`). The host reads the
  flag every `FiniteGuard.check_every` steps and on the last batch of every epoch, and then
  raises `NonFiniteLossError` naming the first bad step: the run stops with weights that were
  never touched by a bad loss, and before the epoch's checkpoint.
- `GraphedStep`: the whole step (forward, backward, clipping, optimisers, running statistics)
  captured once in a CUDA graph and replayed, with the inputs copied into static buffers.
  Everything the host changes between steps lives in device tensors that it writes in place
  before a replay (τ's progress, β, the learning rates, the guard's step number); random draws
  use the default CUDA generator, which graphs replay correctly.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor

__all__ = ["FiniteGuard", "GraphedForward", "GraphedStep", "NonFiniteLossError", "skips_on_device"]


class NonFiniteLossError(RuntimeError):
    """Raised at the first NaN/inf training loss, before it can reach the weights."""


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips its update on the device when its ``found_inf`` is set: PyTorch's
    fused SGD, Adam and AdamW."""
    return isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)) and all(
        group.get("fused") for group in optimizer.param_groups
    )


class FiniteGuard:
    """The training step's NaN/inf guard without a host synchronisation (see the module docstring).

    `attach` once the optimisers exist; `begin` before each step (host values only), `mark` with
    each loss inside it; `due` and `check` after it. Optimisers that cannot skip on the device
    (the natural-gradient ones) keep the immediate check of `Method._check_finite`."""

    check_every = 50

    def __init__(self) -> None:
        self.found_inf: Tensor | None = None
        self._first = self._loss = self._step = None
        self._positions: dict[int, tuple[int, int]] = {}

    def attach(self, optimizers: list[torch.optim.Optimizer], device: torch.device) -> bool:
        """Share the flag with `optimizers`; False (and nothing attached) when one of them cannot
        skip its update on the device."""
        if not optimizers or not all(skips_on_device(o) for o in optimizers):
            self.found_inf = None
            return False
        self.found_inf = torch.zeros((), device=device)
        self._first = torch.full((), -1, dtype=torch.long, device=device)
        self._loss = torch.zeros((), device=device)
        self._step = torch.zeros((), dtype=torch.long, device=device)
        self._positions = {}
        for opt in optimizers:
            opt.found_inf = self.found_inf
        return True

    @property
    def attached(self) -> bool:
        return self.found_inf is not None

    def guards(self, device: torch.device) -> bool:
        """Whether the guard is attached and a step on `device` can use it (a model moved after
        training, for a measurement, steps without it)."""
        return self.found_inf is not None and self.found_inf.device == device

    def detach(self) -> None:
        """Forget the optimisers (after training)."""
        self.found_inf = self._first = self._loss = self._step = None
        self._positions = {}

    def begin(self, global_step: int, epoch: int, batch: int) -> None:
        """Before a step: its number, on the device (written in place: no synchronisation)."""
        self._step.fill_(global_step)
        self._positions[global_step] = (epoch, batch)

    def mark(self, loss: Tensor) -> None:
        """Inside the step: note a non-finite `loss` (on the device)."""
        loss = loss.detach().float().reshape(())
        bad = ~torch.isfinite(loss)
        new = bad & (self.found_inf == 0)
        self._first.copy_(torch.where(new, self._step, self._first))
        self._loss.copy_(torch.where(new, loss, self._loss))
        self.found_inf.copy_(torch.maximum(self.found_inf, bad.float()))

    def due(self, global_step: int, last_batch: bool) -> bool:
        return last_batch or global_step % self.check_every == 0

    def check(self, last_checkpoint: str) -> None:
        """Read the flag (one synchronisation) and raise if a loss was not finite."""
        if not self.attached:
            return
        first = int(self._first)
        if first < 0:
            self._positions.clear()
            return
        epoch, batch = self._positions.get(first, (-1, -1))
        raise NonFiniteLossError(
            f"Training loss is {float(self._loss)} at global step {first} (epoch {epoch}, batch {batch}); the weights "
            f"and BatchNorm statistics were not updated with it, nor after it. Last good checkpoint: {last_checkpoint}. "
            "Common fixes: lower the learning rate (model.optim.lr), keep gradient clipping on "
            "(model.optim.grad_clip_norm), or use 32-bit precision (trainer.precision=32-true)."
        )


def _autocast_for_capture(device_type: str = "cuda"):
    """The autocast state in force on `device_type`, with its cast cache off (cached casts and CUDA
    graphs do not mix).
    The warm-up before a capture runs under it too: the same function (the cache only saves
    re-casting a weight), and compiled regions see one autocast state, since dynamo guards the
    cache flag: warmed up with the cache on, every region would compile again inside the capture."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
    return nullcontext()


class GraphedStep:
    """One training step, captured in a CUDA graph on its `warmup` + 1-th call and replayed after.

    ``body(x, y) -> dict of tensors`` is the step without zeroing the gradients (the graph's
    backward writes them afresh); ``zero()`` sets them to None. The first `warmup` calls run eagerly
    on a side stream (lazy initialisation: optimiser state, cuDNN's algorithm search, the
    BatchNorm update's index tensors, a compiled region's graphs); the next is captured, then
    replayed; every later call with inputs of the same shape, dtype and autocast state copies them
    into the static buffers and replays. A call with other inputs (a last, shorter batch) runs
    eagerly: the same function. Every call that is not a replay runs under the capture's autocast
    settings (`_autocast_for_capture`), so a compiled step compiles nothing in the capture.
    Returns the body's outputs, cloned (the static outputs are overwritten by the next replay)."""

    warmup = 3

    def __init__(self, body: Callable[[Tensor, Tensor], dict[str, Tensor]], zero: Callable[[], None]) -> None:
        self.body, self.zero = body, zero
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self._key = None
        self._inputs: tuple[Tensor, Tensor] | None = None
        self._outputs: dict[str, Tensor] = {}

    @staticmethod
    def _signature(x: Tensor, y: Tensor) -> tuple:
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        return x.shape, x.dtype, x.device, y.shape, y.dtype, autocast

    def eager(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        with _autocast_for_capture():
            self.zero()
            return self.body(x, y)

    def __call__(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        key = self._signature(x, y)
        if self.graph is not None:
            if key != self._key:
                return self.eager(x, y)
            self._inputs[0].copy_(x)
            self._inputs[1].copy_(y)
            self.graph.replay()
            return {k: v.clone() for k, v in self._outputs.items()}
        self.calls += 1
        if self.calls <= self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.eager(x, y)
            torch.cuda.current_stream().wait_stream(side)
            return out
        self._key = key
        self._inputs = (x.clone(), y.clone())
        self.zero()
        self.graph = torch.cuda.CUDAGraph()
        with _autocast_for_capture(), torch.cuda.graph(self.graph):
            self._outputs = self.body(*self._inputs)
        self.graph.replay()  # capturing ran nothing: this is the step
        return {k: v.clone() for k, v in self._outputs.items()}

    def reset(self) -> None:
        """Forget the graph (new optimisers, a new fit)."""
        self.graph, self.calls, self._key, self._inputs, self._outputs = None, 0, None, None, {}


class GraphedForward:
    """A prediction forward (no gradients) captured in a CUDA graph per input signature, and replayed.

    ``forward(*inputs)`` is the network's forward on the members' inputs (the images and the members'
    structures): each new signature (shapes, dtypes, autocast, inference mode, `state()`: the modules'
    train/eval modes) is warmed up on a side stream, captured, and replayed from then on, with the
    inputs copied into its static buffers; at most `limit` signatures are kept, others run eagerly.
    A capture that fails runs eagerly from then on, with a warning. The output is cloned (the next
    replay overwrites it)."""

    limit = 4

    def __init__(self, forward: Callable[..., Tensor], state: Callable[[], tuple] = tuple) -> None:
        self.forward, self.state = forward, state
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], Tensor]] = {}
        self.failed = False

    def __call__(self, *inputs: Tensor) -> Tensor:
        if self.failed or torch.is_grad_enabled() or not all(t.is_cuda for t in inputs):
            return self.forward(*inputs)
        key = (
            tuple((t.shape, t.dtype, t.device) for t in inputs),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
            self.state(),
        )
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.limit:
                return self.forward(*inputs)
            try:
                entry = self.graphs[key] = self._capture(inputs)
            except RuntimeError as error:  # a forward that cannot be captured: predict eagerly
                import warnings

                warnings.warn(
                    f"model.execution.cuda_graph_prediction: the forward could not be captured "
                    f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); predicting eagerly."
                )
                self.failed = True
                return self.forward(*inputs)
        graph, static, output = entry
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        return output.clone()

    def _capture(self, inputs: tuple[Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, list[Tensor], Tensor]:
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _autocast_for_capture():
            self.forward(*static)  # lazy initialisation, cuDNN's algorithm search, compiled graphs
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with _autocast_for_capture(), torch.cuda.graph(graph):
            output = self.forward(*static)
        return graph, static, output
