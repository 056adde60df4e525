"""Per-example statistics from captured layer inputs / output gradients vs torch.func and loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dbsn.natgrad import LayerCapture, kfac_factors, per_example_grads, sum_squared_grads
from dbsn.nets.ops import GroupBatchNorm2d
from tests.support.autocast import bf16_autocast


def _per_example_loss(out: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-example loss: output gradient r + out differs for every element."""
    return (out * r).sum() + 0.5 * out.square().sum()


def _func_per_example(model: nn.Module, x: torch.Tensor, r: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reference per-example gradients: vmap(grad(...)) over functional_call, one example at a time."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, ri):
        return _per_example_loss(functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0), ri)

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, r)


def _captured(model: nn.Module, x: torch.Tensor, r: torch.Tensor, layers=None) -> LayerCapture:
    cap = LayerCapture(model, layers)
    out = model(x)
    sum(_per_example_loss(out[i], r[i]) for i in range(x.shape[0])).backward()
    return cap


LAYERS = {
    "linear": (lambda: nn.Linear(5, 3), (6, 5)),
    "linear-nobias-3d": (lambda: nn.Linear(5, 3, bias=False), (6, 4, 5)),
    "conv-stride2-pad": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (5, 3, 7, 7)),
    "conv-dilation2": (lambda: nn.Conv2d(3, 4, 3, padding=2, dilation=2, bias=False), (5, 3, 7, 7)),
    "conv-depthwise": (lambda: nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4), (5, 4, 7, 7)),
    "conv-groups2-same-reflect": (
        lambda: nn.Conv2d(4, 6, 3, padding="same", dilation=2, groups=2, padding_mode="reflect"),
        (5, 4, 6, 6),
    ),
    "conv-1x1-output": (lambda: nn.Conv2d(3, 4, 5), (5, 3, 5, 5)),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_single_layer_matches_torch_func(name: str) -> None:
    torch.manual_seed(0)
    make, shape = LAYERS[name]
    layer = make()
    x = torch.randn(shape)
    r = torch.randn_like(layer(x))
    expected = _func_per_example(layer, x, r)
    with _captured(layer, x, r) as cap:
        a, g = cap.input(layer), cap.output_grad(layer)
        assert torch.allclose(g, r + layer(x).detach(), atol=1e-6)  # per-example output gradients
        grads = per_example_grads(layer, a, g)
        sums = sum_squared_grads(layer, a, g)
        chunked = sum_squared_grads(layer, a, g, chunk_size=2)
    names = ["weight"] + (["bias"] if layer.bias is not None else [])
    assert len(grads) == len(sums) == len(names)
    for n, pe, sq, ch in zip(names, grads, sums, chunked):
        assert pe.shape == expected[n].shape
        torch.testing.assert_close(pe, expected[n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sq, expected[n].square().sum(0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ch, sq, rtol=1e-5, atol=1e-6)


def test_network_of_convs_and_linears_matches_torch_func() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),  # in-place op on a hooked output
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4),
        nn.Tanh(),
        nn.Conv2d(4, 4, 1, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )
    x = torch.randn(6, 3, 8, 8)
    r = torch.randn(6, 5)
    expected = _func_per_example(net, x, r)
    with _captured(net, x, r) as cap:
        assert cap.layers == [m for m in net if isinstance(m, (nn.Conv2d, nn.Linear))]
        for idx, layer in enumerate(net):
            if layer not in cap.layers:
                continue
            names = [f"{idx}.weight"] + ([f"{idx}.bias"] if layer.bias is not None else [])
            a, g = cap.input(layer), cap.output_grad(layer)
            for n, pe, sq in zip(names, per_example_grads(layer, a, g), sum_squared_grads(layer, a, g)):
                torch.testing.assert_close(pe, expected[n], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(sq, expected[n].square().sum(0), rtol=1e-4, atol=1e-5)


def test_capture_scale_enabled_and_remove() -> None:
    torch.manual_seed(2)
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    cap = LayerCapture(layer, scale=4.0)
    layer(x).sum().div(4).backward()  # a mean over 4 examples
    torch.testing.assert_close(cap.output_grad(layer), torch.ones(4, 2))
    torch.testing.assert_close(cap.output_grad(layer, scale=1.0), torch.full((4, 2), 0.25))
    cap.clear()
    cap.enabled = False
    layer(x).sum().backward()
    assert not cap.has(layer)
    cap.enabled = True
    with torch.no_grad():
        layer(x)
    assert not cap.has(layer) and cap.num_calls(layer) == 0
    cap.remove()
    layer(x).sum().backward()
    assert not cap.has(layer)
    with pytest.raises(KeyError):
        cap.input(layer)
    with pytest.raises(TypeError):
        LayerCapture(layer, [nn.ReLU()])


def _bn_batch_grads(bn: nn.Module, x: torch.Tensor, r: torch.Tensor, groups: int = 1):
    """Captured per-example BN grads and the true batch gradient of the summed loss."""
    with LayerCapture(bn, [bn]) as cap:
        out = bn(x, groups) if groups > 1 else bn(x)
        (out * r).sum().backward()
        pe = per_example_grads(bn, cap.input(bn), cap.output_grad(bn))
        sq = sum_squared_grads(bn, cap.input(bn), cap.output_grad(bn))
    return pe, sq, [bn.weight.grad, bn.bias.grad]


@pytest.mark.parametrize("groups", [1, 2])
def test_batchnorm_training_per_example_grads_sum_to_batch_grad(groups: int) -> None:
    torch.manual_seed(3)
    bn = GroupBatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    x = torch.randn(8, 3, 4, 4) * 2 + 1
    x[1::2] += 3.0  # the two interleaved groups have different statistics
    r = torch.randn(8, 3, 4, 4)
    pe, sq, batch = _bn_batch_grads(bn, x, r, groups)
    for p, s, b in zip(pe, sq, batch):
        assert p.shape == (8, 3)
        torch.testing.assert_close(p.sum(0), b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, p.square().sum(0))


def test_batchnorm_eval_matches_torch_func() -> None:
    torch.manual_seed(4)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
    bn.eval()
    x, r = torch.randn(5, 3, 4, 4), torch.randn(5, 3, 4, 4)
    params = {k: v.detach() for k, v in bn.named_parameters()}
    expected = vmap(grad(lambda p, xi, ri: (functional_call(bn, p, (xi[None],))[0] * ri).sum()), in_dims=(None, 0, 0))(
        params, x, r
    )
    pe, sq, _ = _bn_batch_grads(bn, x, r)
    for n, p, s in zip(["weight", "bias"], pe, sq):
        torch.testing.assert_close(p, expected[n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, expected[n].square().sum(0), rtol=1e-4, atol=1e-5)


def test_kfac_factors_conv_match_explicit_loops() -> None:
    torch.manual_seed(5)
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=1)
    b, (kh, kw), (s, _), (p, _) = 2, conv.kernel_size, conv.stride, conv.padding
    x = torch.randn(b, 2, 5, 5)
    g = torch.randn_like(conv(x))
    factor_a, factor_s = kfac_factors(conv, x, g)
    xp = F.pad(x, (p, p, p, p))
    a_ref, s_ref, count = torch.zeros(2 * 9 + 1, 2 * 9 + 1), torch.zeros(3, 3), 0
    for i in range(b):
        for oh in range(g.shape[2]):
            for ow in range(g.shape[3]):
                patch = [xp[i, c, oh * s + u, ow * s + v] for c in range(2) for u in range(kh) for v in range(kw)]
                a = torch.stack(patch + [torch.tensor(1.0)])
                a_ref += torch.outer(a, a)
                s_ref += torch.outer(g[i, :, oh, ow], g[i, :, oh, ow])
                count += 1
    torch.testing.assert_close(factor_a, a_ref / count)
    torch.testing.assert_close(factor_s, s_ref / count)


def test_kfac_factors_linear_3d_and_grouped_conv() -> None:
    torch.manual_seed(6)
    lin = nn.Linear(4, 3, bias=False)
    x, g = torch.randn(2, 5, 4), torch.randn(2, 5, 3)
    factor_a, factor_s = kfac_factors(lin, x, g)
    a_ref = sum(torch.outer(x[i, t], x[i, t]) for i in range(2) for t in range(5)) / 10
    s_ref = sum(torch.outer(g[i, t], g[i, t]) for i in range(2) for t in range(5)) / 10
    torch.testing.assert_close(factor_a, a_ref)
    torch.testing.assert_close(factor_s, s_ref)

    conv = nn.Conv2d(4, 6, 3, padding=1, groups=2)
    x = torch.randn(3, 4, 5, 5)
    g = torch.randn_like(conv(x))
    factor_a, factor_s = kfac_factors(conv, x, g)
    assert factor_a.shape == (2, 2 * 9 + 1, 2 * 9 + 1) and factor_s.shape == (2, 3, 3)
    for k in range(2):  # group k is an ordinary conv on its channel slice
        sub = nn.Conv2d(2, 3, 3, padding=1)
        a_k, s_k = kfac_factors(sub, x[:, 2 * k : 2 * k + 2], g[:, 3 * k : 3 * k + 3])
        torch.testing.assert_close(factor_a[k], a_k)
        torch.testing.assert_close(factor_s[k], s_k)


# ---------------------------------------------------------------------- mixed precision
# VOGN's and NEK-FAC's curvature statistics are float32 islands (dbsn.precision).


def _captured_conv_net():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1, groups=6),
        GroupBatchNorm2d(6),
        nn.Flatten(),
        nn.Linear(6 * 8 * 8, 5),
    )
    layers = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear, GroupBatchNorm2d))]
    capture = LayerCapture(net, layers)
    x = torch.randn(7, 3, 8, 8)
    F.cross_entropy(net(x), torch.arange(7) % 5, reduction="sum").backward()
    return layers, capture


def test_curvature_statistics_are_float32_under_autocast():
    """VOGN's squared-gradient sums and NEK-FAC's Kronecker factors from the same captured
    tensors, with and without autocast: the same float32 numbers (einsum and matmul would run
    in bfloat16 under autocast, a relative error of about 1e-2)."""
    layers, capture = _captured_conv_net()
    for layer in layers:
        a, g = capture.input(layer), capture.output_grad(layer)
        stats = {
            "sum_squared_grads": sum_squared_grads(layer, a, g),
            "per_example_grads": per_example_grads(layer, a, g),
        }
        if not isinstance(layer, GroupBatchNorm2d):
            stats["kfac_factors"] = kfac_factors(layer, a, g)
        with bf16_autocast():
            mixed = {
                "sum_squared_grads": sum_squared_grads(layer, a, g),
                "per_example_grads": per_example_grads(layer, a, g),
            }
            if "kfac_factors" in stats:
                mixed["kfac_factors"] = kfac_factors(layer, a, g)
        for name, values in stats.items():
            for reference, value in zip(values, mixed[name]):
                assert value.dtype == torch.float32, (name, layer)
                torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-7, msg=f"{name} of {layer}")


def test_statistics_of_bfloat16_captures_are_computed_in_float32():
    """A mixed-precision forward saves bfloat16 inputs and output gradients: the statistics
    upcast them instead of squaring and summing in bfloat16."""
    layers, capture = _captured_conv_net()
    conv = layers[0]
    a, g = capture.input(conv), capture.output_grad(conv)
    a16, g16 = a.bfloat16(), g.bfloat16()
    expected = sum_squared_grads(conv, a16.float(), g16.float())
    for value, reference in zip(sum_squared_grads(conv, a16, g16), expected):
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=0)
