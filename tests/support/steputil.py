"""One training step and one prediction of a method, outside Lightning, to compare two ways of
running the same method (channels-last against contiguous, compiled against eager)."""

from __future__ import annotations

import torch

from dbsn.methods import Method


def step_state(method: Method, x: torch.Tensor, y: torch.Tensor, seed: int = 7) -> dict[str, torch.Tensor]:
    """The loss of one training step, the gradient of every parameter (θ included) before the
    optimiser uses it, and the BatchNorm running statistics after the step's forward: what
    `Method.training_step` computes, through the method's own
    `accumulate_gradients` (grouped or chunked), from a seeded random stream."""
    method.train()
    for p in method.parameters():
        p.grad = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        logs = method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
    state = {"loss": logs["loss"].detach()}
    state.update(
        {f"grad/{name}": p.grad.detach().clone() for name, p in method.named_parameters() if p.grad is not None}
    )
    state.update(
        {name: b.detach().clone() for name, b in method.named_buffers() if "running_" in name or "num_batches" in name}
    )
    return state


def prediction(method: Method, x: torch.Tensor, n_samples: int, seed: int = 11) -> torch.Tensor:
    """Members' log-probabilities (S, b, C) of the Bayes ensemble, from a seeded random stream."""
    method.eval()
    method.enable_test_noise()
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        return method.predict_members(x, n_samples)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> dict[str, int]:
    """Every entry of `a` equals `b`'s; returns how many entries of each kind were compared."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    kinds = {"loss": 0, "weight gradients": 0, "theta gradient": 0, "running statistics": 0}
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(b[key], a[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert torch.equal(a[key], b[key]), key
        kind = (
            "loss"
            if key == "loss"
            else "theta gradient"
            if key.endswith("theta") and key.startswith("grad/")
            else "weight gradients"
            if key.startswith("grad/")
            else "running statistics"
        )
        kinds[kind] += 1
    return kinds
