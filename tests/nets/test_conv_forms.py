"""The fused cell's convolution forms (dbsn.nets.conv_forms) against `F.conv2d`, in float64: each
form's outputs, input gradient and weight gradient (dilation 1 and 2, contiguous and
channels-last); a network of fused cells with the forms against the same network without
(outputs, every parameter's gradient, running statistics over training steps); a training step
of every method that runs on the fused cell (loss, weight and θ gradients, running statistics);
the settings refused in one line where they would not apply."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException

from dbsn.methods import Execution
from dbsn.nets import FusedCell, StructureNet, conv_forms
from dbsn.nets.batchnorm import accumulated_running_statistics
from dbsn.nets.conv_forms import StackedConv2d, set_conv_forms
from dbsn.nets.fused_cell import (
    _stacked_conv,  # the fused cell's own stacked convolution
    unfuse,
)
from dbsn.runtime.build import build_model
from tests.support.configs import compose_config, small_model
from tests.support.netutil import soft_alpha
from tests.support.steputil import assert_same, step_state

LAYOUTS = {"contiguous": torch.contiguous_format, "channels-last": torch.channels_last}


def _assert_exact(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Equal to 1e-12 of the tensor's scale (float64 round-off of sums taken in another order)."""
    actual, expected = actual.detach(), expected.detach()
    scale = max(1.0, float(expected.abs().max()))
    error = float((actual - expected).abs().max())
    assert actual.shape == expected.shape, name
    assert error <= 1e-12 * scale, f"{name}: max error {error:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "form, kernel, dilation",
    [("bmm", 1, 1), ("mulsum", 1, 1), ("stencil", 3, 1), ("stencil", 3, 2)],
    ids=["bmm", "mulsum", "stencil-d1", "stencil-d2"],
)
def test_each_form_equals_f_conv2d_with_its_gradients(form, kernel, dilation, layout):
    """A stacked convolution of 3 edges × 5 channels (the fused cell's shapes) in `form` against
    `F.conv2d` with the same weight: output, input gradient, weight gradient, and the output's layout."""
    edges, channels = 3, 5
    width = edges * channels
    conv = _stacked_conv(edges, channels, kernel, dilation).double()
    conv.to(memory_format=LAYOUTS[layout])
    set_conv_forms(conv, **{"conv_1x1" if kernel == 1 else "depthwise": form})
    assert conv.form == form
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, width, 7, 9, generator=generator, dtype=torch.float64).contiguous(memory_format=LAYOUTS[layout])
    x.requires_grad_()
    out = conv(x)
    expected = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
    assert out.is_contiguous(memory_format=LAYOUTS[layout]) == expected.is_contiguous(memory_format=LAYOUTS[layout])
    upstream = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, conv.weight), upstream)
    expected_grads = torch.autograd.grad(expected, (x, conv.weight), upstream)
    _assert_exact(out, expected, "output")
    for name, grad, reference in zip(("input gradient", "weight gradient"), grads, expected_grads):
        _assert_exact(grad, reference, name)


@pytest.mark.parametrize(
    "form, kernel, dilation", [("bmm", 1, 1), ("mulsum", 1, 1), ("stencil", 3, 2)], ids=["bmm", "mulsum", "stencil-d2"]
)
def test_each_form_computes_in_autocast_s_dtype_as_f_conv2d(form, kernel, dilation):
    """Under bfloat16 autocast a form takes its operands in bfloat16 and returns bfloat16, as
    `F.conv2d` does, and both are near the float32 result (bfloat16's rounding of the operands)."""
    edges, channels = 2, 8
    width = edges * channels
    conv = _stacked_conv(edges, channels, kernel, dilation)
    formed = copy.deepcopy(conv)
    set_conv_forms(formed, **{"conv_1x1" if kernel == 1 else "depthwise": form})
    x = torch.randn(2, width, 6, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = conv(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected, out = conv(x), formed(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    scale = float(exact.abs().max())
    for name, value in (("form", out), ("F.conv2d", expected)):
        assert float((value.float() - exact).abs().max()) <= 2e-2 * scale, name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_forms_compile_without_a_graph_break(layout):
    """Each form traced whole by dynamo (``fullgraph``, the aot_eager backend: the same graphs as
    inductor's, without code generation), forward and backward, equal to eager."""
    torch._dynamo.reset()
    for kernel, dilation, setting in (
        (1, 1, {"conv_1x1": "bmm"}),
        (1, 1, {"conv_1x1": "mulsum"}),
        (3, 2, {"depthwise": "stencil"}),
    ):
        conv = StackedConv2d(
            12,
            12,
            kernel,
            padding=dilation * (kernel // 2),
            dilation=dilation,
            groups=12 if kernel > 1 else 3,
            bias=False,
            stacked_edges=3,
        ).double()
        conv.to(memory_format=LAYOUTS[layout])
        set_conv_forms(conv, **setting)
        x = torch.randn(2, 12, 5, 5, dtype=torch.float64).contiguous(memory_format=LAYOUTS[layout]).requires_grad_()
        compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
        outputs = [net(x) for net in (compiled, conv)]
        grads = [torch.autograd.grad(out.square().sum(), (x, conv.weight)) for out in outputs]
        _assert_exact(outputs[0], outputs[1], f"{setting}: output")
        for name, ours, theirs in zip(("input", "weight"), *grads):
            _assert_exact(ours, theirs, f"{setting}: {name} gradient")
    torch._dynamo.reset()


def _net(cell: str = "fused") -> StructureNet:
    """4 nodes (source nodes of 3, 2 and 1 out-edges), two stages: a few cell shapes in float64, with
    the ops with both dilations and random weights."""
    torch.manual_seed(0)
    net = StructureNet(
        num_classes=5, num_nodes=4, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8, cell=cell
    ).double()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for p in net.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return net


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("conv_1x1, depthwise", [("bmm", "stencil"), ("mulsum", "conv"), ("conv", "stencil")])
def test_fused_cells_train_the_same_in_every_form(conv_1x1, depthwise, layout):
    """Two SGD steps of the network with and without the forms, on the same batches and soft
    structures (grouped, with the shared first-cell rows): logits, α's gradient, every parameter's
    gradient, the running statistics after each step; then the evaluation outputs."""
    reference = _net().to(memory_format=LAYOUTS[layout])
    formed = copy.deepcopy(reference)
    count = set_conv_forms(formed, conv_1x1=conv_1x1, depthwise=depthwise)
    assert count == sum(isinstance(m, StackedConv2d) for m in formed.modules()) > 0
    assert formed.state_dict().keys() == reference.state_dict().keys()
    generator = torch.Generator().manual_seed(3)
    opts = [torch.optim.SGD(net.parameters(), lr=0.05) for net in (reference, formed)]
    for step in range(2):
        x = torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64).contiguous(memory_format=LAYOUTS[layout])
        alpha = soft_alpha(3, reference, seed=step).double()
        outputs, alpha_grads = [], []
        for net, opt in zip((reference, formed), opts):
            net.train()
            opt.zero_grad()
            a = alpha.clone().requires_grad_()
            with accumulated_running_statistics(net):
                out = net(x, a, replicate=True)
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            outputs.append(out.detach())
            alpha_grads.append(a.grad)
        _assert_exact(outputs[1], outputs[0], f"logits, step {step}")
        _assert_exact(alpha_grads[1], alpha_grads[0], f"alpha's gradient, step {step}")
        for (name, p), q in zip(reference.named_parameters(), formed.parameters()):
            _assert_exact(q.grad, p.grad, f"{name}'s gradient, step {step}")
        for opt in opts:
            opt.step()
        theirs = formed.state_dict()
        for key, value in reference.state_dict().items():
            _assert_exact(theirs[key].double(), value.double(), f"{key} after step {step}")
    x = torch.randn(3, 3, 8, 8, generator=generator, dtype=torch.float64).contiguous(memory_format=LAYOUTS[layout])
    alpha = soft_alpha(2, reference, seed=9).double()
    for net in (reference, formed):
        net.eval()
    with torch.no_grad():
        _assert_exact(formed(x, alpha, replicate=True), reference(x, alpha, replicate=True), "evaluation")


def test_checkpoints_and_unfuse_do_not_see_the_form():
    """The same state-dict keys and values; a checkpoint of a network in one form loads into one in
    another; `unfuse` gives the per-edge cell of the same function."""
    formed = _net()
    set_conv_forms(formed, conv_1x1="bmm", depthwise="stencil")
    plain = _net()
    plain.load_state_dict(formed.state_dict())
    assert all(m.form == "conv" for m in plain.modules() if isinstance(m, StackedConv2d))
    unfused = unfuse(copy.deepcopy(formed))
    assert not any(isinstance(m, FusedCell) for m in unfused.modules())
    x, alpha = torch.randn(2, 3, 8, 8, dtype=torch.float64), soft_alpha(2, formed).double()
    for net in (formed, plain, unfused):
        net.eval()
    with torch.no_grad():
        expected = plain(x, alpha, replicate=True)
        _assert_exact(formed(x, alpha, replicate=True), expected, "formed")
        _assert_exact(unfused(x, alpha, replicate=True), expected, "unfused")
    # back to conv: every stacked convolution is set again
    assert set_conv_forms(formed) == sum(isinstance(m, StackedConv2d) for m in formed.modules())
    assert all(m.form == "conv" for m in formed.modules() if isinstance(m, StackedConv2d))


def test_forms_are_refused_in_one_line_where_they_would_not_apply():
    with pytest.raises(ValueError, match="execution.conv_1x1 must be one of"):
        Execution(conv_1x1="matmul")
    with pytest.raises(ValueError, match="execution.depthwise must be one of"):
        Execution(depthwise="bmm")
    with pytest.raises(ValueError, match="model.execution.depthwise must be one of"):
        set_conv_forms(_net(), depthwise="mulsum")
    per_edge = _net("per_edge")
    assert set_conv_forms(per_edge) == 0  # the default applies everywhere: F.conv2d
    with pytest.raises(ValueError, match="model.execution.conv_1x1=bmm: StructureNet has no stacked convolutions"):
        set_conv_forms(per_edge, conv_1x1="bmm")
    with pytest.raises(ValueError, match="no stacked convolutions"):
        Execution(depthwise="stencil").apply_conv_forms(torch.nn.Conv2d(3, 3, 3))


def test_a_method_on_the_per_edge_cell_refuses_the_forms(tmp_path):
    cfg = compose_config(
        "train", small_model("map", "model.net.cell=per_edge", "model.execution.conv_1x1=mulsum"), tmp_path
    )
    refusal = "conv_1x1=mulsum: StructureNet has no stacked convolutions"
    with pytest.raises(InstantiationException, match=refusal) as caught:
        build_model(cfg.model, num_classes=5)
    assert isinstance(caught.value.__cause__, ValueError)  # the runtime prints it as one line


#: the methods on the fused cell (VOGN and Packed-Ensembles run the per-edge one), with their overrides;
#: BBB's and FBN's Gaussian weights sample on, the same draws in either form
METHODS = {
    "dbsn": [],
    "fbn": [],
    "map": [],
    "map_fixed": [],
    "mc_dropout": [],
    "bbb": [],
    "deep_ensemble": ["model.size=2"],
    "batch_ensemble": ["model/net=structure_net"],
}


def _method(model: str, tmp_path, **execution: str):
    """`model` on a tiny cell network in float64, with `execution`'s settings (its members' with an ensemble)."""
    prefix = "model.member" if model == "deep_ensemble" else "model"
    overrides = [
        *METHODS[model],
        f"{prefix}.net.growth=4",
        f"{prefix}.net.stem_channels=8",
        *(f"{prefix}.execution.{key}={value}" for key, value in execution.items()),
    ]
    if model in ("dbsn", "fbn"):
        overrides.append("model.train_samples=3")
    cfg = compose_config("train", small_model(model, *overrides), tmp_path)
    torch.manual_seed(0)
    method = build_model(cfg.model, num_classes=5).double()
    for m in [method, *getattr(method, "members", [])]:
        m.dataset_size = 50
    return method


def _counting(monkeypatch) -> dict[str, int]:
    """Calls of the two forms' functions from `convolve` (the layers' forward), counted."""
    calls = {"grouped_1x1": 0, "depthwise_stencil": 0}
    for name in calls:

        def counted(*args, _name=name, _function=getattr(conv_forms, name), **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(conv_forms, name, counted)
    return calls


@pytest.mark.parametrize("model", list(METHODS))
def test_every_fused_method_steps_the_same_in_the_fused_forms(model, tmp_path, monkeypatch):
    """One training step with ``conv_1x1=bmm depthwise=stencil`` against the default: loss, every
    weight's gradient, θ's gradient (DBSN, FBN, MAP), running statistics; the forms do compute
    (Gaussian weights' layers and BatchEnsemble's wrapped ones too)."""
    reference = _method(model, tmp_path)
    formed = _method(model, tmp_path, conv_1x1="bmm", depthwise="stencil")
    formed.load_state_dict(reference.state_dict())
    forms = {m.form for m in formed.modules() if hasattr(m, "stacked_edges")}
    assert forms == {"bmm", "stencil"}, forms
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 16, 16, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (6,), generator=generator)
    calls = _counting(monkeypatch)
    expected = step_state(reference, x, y)
    assert calls == {"grouped_1x1": 0, "depthwise_stencil": 0}
    actual = step_state(formed, x, y)
    assert calls["grouped_1x1"] > 0 and calls["depthwise_stencil"] > 0, calls
    kinds = assert_same(expected, actual, rtol=1e-10, atol=1e-12)
    assert kinds["weight gradients"] > 0 and kinds["running statistics"] > 0
    learns_structure = any(name.endswith("theta") for name, _ in formed.named_parameters())
    assert kinds["theta gradient"] == learns_structure and (learns_structure or model not in ("dbsn", "fbn", "map"))


def test_dbsn_steps_the_same_with_mulsum_in_the_contiguous_layout(tmp_path):
    reference = _method("dbsn", tmp_path, channels_last="false")
    formed = _method("dbsn", tmp_path, channels_last="false", conv_1x1="mulsum")
    formed.load_state_dict(reference.state_dict())
    x, y = torch.randn(6, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (6,))
    kinds = assert_same(step_state(reference, x, y), step_state(formed, x, y), rtol=1e-10, atol=1e-12)
    assert kinds["theta gradient"] == 1


def test_auto_is_the_measured_fastest_form_where_a_layer_runs_and_no_refusal_elsewhere():
    """`auto` (speed=fast's conv_1x1): the batched matmul for a 1×1 on a GPU, F.conv2d for it on a
    CPU and for every depthwise; on a network without fused cells it sets nothing and refuses nothing."""
    from dbsn.nets import ResNet18
    from dbsn.nets.conv_forms import StackedConv2d, resolved_form, set_conv_forms

    one = StackedConv2d(8, 8, 1, groups=2, bias=False, stacked_edges=2)
    depthwise = StackedConv2d(8, 8, 3, padding=2, dilation=2, groups=8, bias=False, stacked_edges=2)
    one.form = depthwise.form = "auto"
    assert (resolved_form(one, "cuda"), resolved_form(one, "cpu")) == ("bmm", "conv")
    assert (resolved_form(depthwise, "cuda"), resolved_form(depthwise, "cpu")) == ("conv", "conv")
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    one.double(), depthwise.double()
    for layer in (one, depthwise):  # on this CPU: F.conv2d itself, bit for bit
        assert torch.equal(
            layer(x),
            torch.nn.functional.conv2d(
                x, layer.weight, None, layer.stride, layer.padding, layer.dilation, layer.groups
            ),
        )
    assert set_conv_forms(ResNet18(num_classes=10, width=8), conv_1x1="auto", depthwise="auto") == 0
    with pytest.raises(ValueError, match="no stacked convolutions"):
        set_conv_forms(ResNet18(num_classes=10, width=8), conv_1x1="bmm")
