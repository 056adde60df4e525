"""What stays in float32 under mixed precision.

`trainer.precision=bf16-mixed` runs the training and prediction steps under `torch.autocast`:
convolutions and matrix products take bfloat16 inputs (8 bits of mantissa), which is what
makes them fast. Some computations must not lose those bits:

- the structure distribution: Gumbel noise, the log-softmax of Eq. 4, the density of Eq. 5
  and the KL estimate (`dbsn.structure`);
- the Gaussian weights' closed-form KL (`dbsn.bayes`);
- VOGN's and NEK-FAC's curvature statistics and updates (`dbsn.natgrad`), whose einsums and
  matrix products autocast would otherwise run in bfloat16;
- the Bayes ensemble's average of member probabilities and the training loss (on a CPU,
  autocast leaves `log_softmax` of a bfloat16 input in bfloat16).

BatchNorm keeps float32 running statistics and computes batch statistics in float32 itself.
The code that owns each of these enters `float32()` and upcasts its inputs with `full()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["float32", "full"]

_LOW = (torch.float16, torch.bfloat16)


@contextmanager
def float32() -> Iterator[None]:
    """Within the block autocast is off on every device type (CPU, and CUDA where present).

    Plain `with` blocks, so that torch.compile traces through them without a graph break."""
    if torch.cuda.is_available():
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            yield
    else:
        with torch.autocast("cpu", enabled=False):
            yield


def full(t: Tensor) -> Tensor:
    """`t` in float32 if it is a 16-bit float tensor, else unchanged (float64 stays float64)."""
    return t.float() if t.dtype in _LOW else t


def dilated_depthwise_bf16_gradient_error(channels_last: bool) -> float:
    """Relative error, against float64, of this CPU's bfloat16 weight gradient of a dilated
    depthwise convolution (3 x 3, dilation 2, 16 channels: a DBSN cell's dil_conv_3x3), NaN where
    it is not finite. oneDNN computes it wrongly in the channels-last layout on some CPUs (seen
    with torch 2.14.1: relative errors from 1.4 to 1e28, and NaN, varying from call to call) and
    right on others (an AMD EPYC without native bfloat16: 0.005, bfloat16's round-off)."""
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(4, 16, 32, 32, generator=generator), 1e-4 * torch.randn(4, 16, 32, 32, generator=generator)
    w = torch.randn(16, 1, 3, 3, generator=generator)
    layout = torch.channels_last if channels_last else torch.contiguous_format

    def weight_grad(x: Tensor, grad: Tensor, w: Tensor) -> Tensor:
        return torch.ops.aten.convolution_backward(
            grad, x, w, None, [1, 1], [2, 2], [2, 2], False, [0, 0], 16, [False, True, False]
        )[1]

    reference = weight_grad(x.double(), grad.double(), w.double())
    low = weight_grad(*(t.bfloat16().contiguous(memory_format=layout) for t in (x, grad, w)))
    return ((low.double() - reference).abs().max() / reference.abs().max()).item()


def cpu_bf16_channels_last_is_wrong(tries: int = 3) -> bool:
    """Whether this CPU's bfloat16 channels-last gradients of DBSN's dilated convolutions are wrong
    (any of `tries` calls off by more than 10 %: the wrong values vary from call to call)."""
    return any(not dilated_depthwise_bf16_gradient_error(channels_last=True) <= 0.1 for _ in range(tries))
