"""Mixed precision as Lightning's bf16-mixed sets it up on the CPU, for the float32-island tests
(`dbsn.precision`)."""

import torch


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)
