"""Invariants that several test modules check, each written once.

- `assert_grouped_equals_copies`: a network's grouped forward over G structures equals G
  separate forwards (StructureNet, DBSNSegNet), outputs and, in training, gradients and
  BatchNorm running statistics.
- `assert_replicate_equals_repeated_input`: `replicate=True` equals the forward on the input
  repeated G times.
- `assert_fixed_members`: a post-hoc posterior's fixed members (Laplace, SWAG).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from tests.support.netutil import join_groups, split_groups


def assert_grouped_equals_copies(
    net: nn.Module, x: torch.Tensor, alpha: torch.Tensor, grad_atol_scales: bool = False
) -> torch.Tensor:
    """`net(x, alpha)` on a grouped batch (row r in group r mod G, `alpha` (G, E, K)) equals G
    separate networks, group g run with alpha[g]. In eval mode: the outputs (the same network,
    its running statistics). In training mode, against G deep copies: the outputs, every
    parameter's gradient of the summed squared output (the sum of the copies'; with
    `grad_atol_scales` the tolerance grows with the gradient, for float32 sums of large ones) and
    the running statistics (the mean of the copies'). Returns the grouped output."""
    groups = alpha.shape[0]
    if not net.training:
        with torch.no_grad():
            grouped = net(x, alpha)
            separate = join_groups([net(xg, alpha[g]) for g, xg in enumerate(split_groups(x, groups))])
        torch.testing.assert_close(grouped, separate, rtol=1e-4, atol=1e-5)
        return grouped

    copies = [copy.deepcopy(net) for _ in range(groups)]
    grouped = net(x, alpha)
    separate = [c(xg, alpha[g]) for g, (c, xg) in enumerate(zip(copies, split_groups(x, groups)))]
    torch.testing.assert_close(grouped, join_groups(separate), rtol=1e-4, atol=1e-5)

    # Gradients of the summed loss and running statistics (mean over the copies) agree.
    grouped.square().sum().backward()
    for out in separate:
        out.square().sum().backward()
    for name, p in net.named_parameters():
        ref = sum(dict(c.named_parameters())[name].grad for c in copies)
        atol = 1e-5 * max(1.0, float(ref.abs().max())) if grad_atol_scales else 1e-5
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=atol, msg=name)
    for name, buf in net.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            ref = torch.stack([dict(c.named_buffers())[name] for c in copies]).mean(0)
            torch.testing.assert_close(buf, ref, rtol=1e-4, atol=1e-5, msg=name)
    return grouped


def assert_replicate_equals_repeated_input(net: nn.Module, x: torch.Tensor, alpha: torch.Tensor) -> None:
    """`net(x, alpha, replicate=True)` equals a twin's forward on every example repeated G times
    (G = len(alpha)), running statistics included, in the network's current mode."""
    twin = copy.deepcopy(net)
    expected = twin(x.repeat_interleave(alpha.shape[0], 0), alpha)
    torch.testing.assert_close(net(x, alpha, replicate=True), expected, rtol=1e-4, atol=1e-5)
    for (name, buf), ref in zip(net.named_buffers(), twin.buffers()):
        torch.testing.assert_close(buf, ref, rtol=1e-5, atol=1e-6, msg=name)


def assert_fixed_members(method, x, count: int, classes: int, first: int, n: int, differ: float):
    """A post-hoc method's `count` members: normalised, different from each other, the same on
    every call, members first .. first + n - 1 alone equal to the slice of all, and the
    prediction their mixture. Returns the members' log-probabilities (count, b, classes)."""
    with torch.no_grad():
        members = method.predict_members(x)
        again = method.predict_members(x)
        tail = method.predict_members(x, n, first=first)
        log_probs = method.predict_log_probs(x)
    assert members.shape == (count, len(x), classes) and method.num_members == count
    torch.testing.assert_close(members.logsumexp(-1), torch.zeros(count, len(x)), rtol=0, atol=1e-5)
    assert (members[1:] - members[:1]).abs().amax() > differ  # the members differ
    torch.testing.assert_close(again, members, rtol=0, atol=0)  # fixed members: every batch sees the same
    torch.testing.assert_close(tail, members[first : first + n], rtol=0, atol=1e-6)
    torch.testing.assert_close(log_probs, members.logsumexp(0) - math.log(count), rtol=0, atol=1e-6)
    return members
