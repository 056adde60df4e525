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

from contextlib import contextmanager
from typing import Iterator

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
