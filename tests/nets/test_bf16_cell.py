"""The fused cell under bf16-mixed (CPU autocast, as Lightning sets it up): `EdgeAffine` and the
α-weighted sums of `SourceOps` keep the activations' dtype. EdgeAffine's output equals the float32
computation rounded once to bfloat16, bit for bit; each α multiply-add equals its float32 value
rounded once; the gradients of γ and β land in the float32 parameters and match float64 within
bfloat16's precision; one fused cell step makes fewer casts and no float32 activation-sized ops
in EdgeAffine than with type promotion (the form it replaces, rebuilt here)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dbsn.nets import FusedCell
from dbsn.nets import fused_cell as fused_module
from dbsn.nets.fused_cell import EdgeAffine
from tests.support.autocast import bf16_autocast

OPS = ["zero", "identity", "sep_conv_3x3", "dil_conv_3x3"]
#: bfloat16's unit round-off: 8 significant bits, a relative error of at most 2^-8 per rounding
BF16_EPS = 2.0**-8
LAYOUTS = [torch.contiguous_format, torch.channels_last]


class Trace(TorchDispatchMode):
    """Every aten op's name and output dtype; dtype-changing `_to_copy`s are the casts."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype | None, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        name = str(func.overloadpacket)
        if torch.is_tensor(first):
            if name == "aten._to_copy" and torch.is_tensor(args[0]) and args[0].dtype != first.dtype:
                name = "cast"
            self.ops.append((name, first.dtype, tuple(first.shape)))
        return out

    def count(self, name: str, dtype: torch.dtype | None = None, min_numel: int = 0) -> int:
        return sum(
            1
            for n, d, shape in self.ops
            if n == name and (dtype is None or d == dtype) and torch.Size(shape).numel() >= min_numel
        )


def _edge_affine(layout, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    affine = EdgeAffine(2, 3, 8)
    with torch.no_grad():
        affine.weight.copy_(1 + 0.5 * torch.randn(affine.weight.shape, generator=generator))
        affine.bias.copy_(0.5 * torch.randn(affine.bias.shape, generator=generator))
    x = torch.randn(4, 8, 6, 6, generator=generator).bfloat16().contiguous(memory_format=layout)
    return affine, x


@pytest.mark.parametrize("layout", LAYOUTS)
def test_edge_affine_is_bfloat16_and_equals_float32_rounded_once(layout):
    affine, x = _edge_affine(layout)
    with bf16_autocast():
        outputs = affine(x)
    m, n, c = affine.chains, affine.edges, affine.channels
    gamma, beta = affine.weight.view(m, n, c, 1, 1), affine.bias.view(m, n, c, 1, 1)
    for k, out in enumerate(outputs):
        assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=layout)
        for t in range(n):  # the explicit float32 product, then sum, then one rounding
            value = x.float() * gamma[k, t].detach()
            expected = torch.relu(value + beta[k, t].detach()).bfloat16()
            assert torch.equal(out[:, t * c : (t + 1) * c], expected), (k, t)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_edge_affine_gradients_reach_float32_parameters(layout):
    """x̂ and the incoming gradient are bfloat16 (exact in float64); the gradients of γ, β (float32)
    and x̂ (bfloat16, rounded once) match float64's within bfloat16's 2^-8 of their sums' scale."""
    affine, x = _edge_affine(layout, seed=1)
    x.requires_grad_()
    generator = torch.Generator().manual_seed(2)
    m, n, c = affine.chains, affine.edges, affine.channels
    grads = [torch.randn(4, n * c, 6, 6, generator=generator).bfloat16() for _ in range(m)]
    with bf16_autocast():
        outputs = affine(x)
    torch.autograd.backward(outputs, grads)
    assert affine.weight.grad.dtype == torch.float32 and affine.bias.grad.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16

    x64 = x.detach().double().contiguous().requires_grad_()
    g64 = affine.weight.detach().double().view(m, 1, n, c, 1, 1).requires_grad_()
    b64 = affine.bias.detach().double().view(m, 1, n, c, 1, 1).requires_grad_()
    out64 = torch.relu(x64.view(1, 4, 1, c, 6, 6) * g64 + b64)
    upstream = torch.stack([g.double().contiguous().view(4, n, c, 6, 6) for g in grads])
    (out64 * upstream).sum().backward()
    mask = (out64 > 0).double()
    # scales: the sums of absolute terms that each gradient adds up
    scale_gamma = (upstream.abs() * mask * x64.detach().abs().view(1, 4, 1, c, 6, 6)).sum((1, 4, 5))
    scale_beta = (upstream.abs() * mask).sum((1, 4, 5))
    scale_x = (upstream.abs() * mask * g64.detach().abs()).sum((0, 2)).squeeze(0)
    for actual, expected, scale, name in [
        (affine.weight.grad.view(m, n, c), g64.grad.view(m, n, c), scale_gamma, "γ"),
        (affine.bias.grad.view(m, n, c), b64.grad.view(m, n, c), scale_beta, "β"),
        (x.grad.double(), x64.grad, scale_x.view(4, c, 6, 6), "x̂"),
    ]:
        error = (actual.double() - expected).abs()
        assert bool((error <= BF16_EPS * scale.view(error.shape) + 1e-30).all()), (name, float(error.max()))


def _cell(seed: int = 0):
    torch.manual_seed(seed)
    cell = FusedCell(12, 4, 8, OPS)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))
    x = torch.randn(2 * 3, 12, 8, 8, generator=generator)
    alpha = torch.softmax(torch.randn(3, len(cell.edges), len(OPS), generator=generator), -1).requires_grad_()
    return cell, x, alpha


def _traced_step(cell, x, alpha) -> tuple[Trace, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward under autocast: its trace, the output and every gradient (α's too)."""
    cell.zero_grad(set_to_none=True)
    alpha.grad = None
    with bf16_autocast(), Trace() as trace:
        out = cell(x, alpha)
        out.float().square().mean().backward()
    gradients = {name: p.grad.clone() for name, p in cell.named_parameters()}
    return trace, out.detach(), {**gradients, "alpha": alpha.grad.clone()}


def test_alpha_sums_round_once_per_multiply_add():
    """SourceOps' output is bfloat16 and equals, bit for bit, the explicit chain of float32
    multiply-adds of its terms (the normalised input and each chain's output), each rounded once."""
    cell, x, alpha = _cell()
    terms: dict[str, torch.Tensor] = {}
    source = cell.sources[0]
    hooks = [source.norm.register_forward_hook(lambda m, i, o: terms.__setitem__("identity", o))]
    hooks += [
        chain.register_forward_hook(lambda m, i, o, name=name: terms.__setitem__(name, o))
        for name, chain in source.chains.items()
    ]
    captured = {}
    hooks.append(source.register_forward_hook(lambda m, i, o: captured.update(inputs=i, out=o)))
    with bf16_autocast():
        cell(x, alpha)
    for hook in hooks:
        hook.remove()
    node, weights, groups, shared = captured["inputs"]
    out = captured["out"]
    assert out.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in weights)
    b, g, n, c, h, w = out.shape
    expected = None
    for name, weight in zip(source.present, weights):
        term = terms[name].view(b, g, -1, c, h, w).float()
        expected = (
            (term * weight.float()).bfloat16()
            if expected is None
            else (expected.float() + term * weight.float()).bfloat16()
        )
    assert torch.equal(out, expected.expand_as(out))


def test_fused_cell_step_keeps_edge_affine_in_bfloat16_and_casts_less(monkeypatch):
    """One forward and backward of a fused cell under CPU autocast: every EdgeAffine and SourceOps
    output is bfloat16; against type promotion (EdgeAffine's float32 result left for autocast to
    cast at each chain's convolution), each source node with chains saves two casts (one forward
    and one backward instead of one per chain each way), and no ReLU, ReLU backward or unbind
    backward of EdgeAffine's size runs in float32."""
    cell, x, alpha = _cell()
    dtypes: list[torch.dtype] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: dtypes.extend(t.dtype for t in (o if isinstance(o, list) else [o])))
        for m in cell.modules()
        if isinstance(m, (EdgeAffine, fused_module.SourceOps))
    ]
    after, out, gradients = _traced_step(cell, x, alpha)
    for hook in hooks:
        hook.remove()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(g.dtype == torch.float32 for g in gradients.values())

    monkeypatch.setattr(fused_module, "_stored", lambda y, x: y)  # type promotion: the replaced form
    before, out_before, gradients_before = _traced_step(cell, x, alpha)
    sources = sum(1 for s in cell.sources if s.chains)
    assert {len(s.chains) for s in cell.sources} == {2}
    assert after.count("cast") == before.count("cast") - 2 * sources
    # EdgeAffine's output size (M·b·G·C·H·W for the last source node): float32 ops that large are its traffic
    size = 2 * 2 * 3 * 8 * 8 * 8
    for name in ("aten.relu", "aten.threshold_backward", "aten.stack"):
        assert before.count(name, torch.float32, size) > 0, name
        assert after.count(name, torch.float32, size) == 0, name
    # the same function bit for bit: the rounding moved from the convolutions' autocast into EdgeAffine,
    # before a ReLU that commutes with it, and the backward adds the same float32 values
    assert torch.equal(out, out_before)
    for name, gradient in gradients.items():
        assert torch.equal(gradient, gradients_before[name]), name
