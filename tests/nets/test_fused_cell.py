"""The fused cell (dbsn.nets.fused_cell) against the per-edge reference cell, in float64: outputs,
α's gradient, every weight's gradient and the running statistics after several training steps
and in evaluation, for grouped structures, the shared first-cell prefix, channels-last,
per-structure BatchNorm statistics, segmentation cells and op lists with and without zero and
identity; checkpoints converting both ways; the stacked convolutions' initialisation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dbsn.nets import Cell, DBSNSegNet, FusedCell, StructureNet
from dbsn.nets.batchnorm import accumulated_running_statistics, structure_statistics, using_statistics
from dbsn.nets.fused_cell import unfuse
from tests.support.netutil import soft_alpha


def _assert_exact(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Equal to 1e-12 of the tensor's scale (float64 round-off of sums taken in another order)."""
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    error = float((actual.double() - expected.double()).abs().max()) if expected.numel() else 0.0
    assert actual.shape == expected.shape and error <= 1e-12 * scale, (
        f"{name}: max error {error:.3g} at scale {scale:.3g}"
    )


def _pair(make, seed: int = 0):
    """A per-edge network and a fused one holding the same state (random affine parameters, so
    that the tests see them), in float64."""
    torch.manual_seed(seed)
    reference = make("per_edge").double()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 1)
        for p in reference.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    fused = make("fused").double()
    fused.load_state_dict(reference.state_dict())
    return reference, fused


def _as_per_edge(reference: nn.Module, fused: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` named as `fused`'s parameters and buffers (gradients, say), renamed and cut as the
    per-edge network holds them (through the checkpoint conversion)."""
    state = fused.state_dict()
    state.update(tensors)
    twin = copy.deepcopy(reference)
    twin.load_state_dict(state)
    return dict(twin.state_dict())


def _assert_states_equal(reference: nn.Module, fused: nn.Module) -> int:
    ours = _as_per_edge(reference, fused, {})
    theirs = reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        _assert_exact(ours[key], theirs[key], key)
    return len(theirs)


def _gradients(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def _structure_net(**kwargs):
    return lambda cell: StructureNet(
        num_classes=5, num_nodes=4, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8, cell=cell, **kwargs
    )


def _train_and_compare(
    reference,
    fused,
    steps: int,
    groups: int,
    replicate: bool,
    layout=torch.contiguous_format,
    x_size: int = 8,
    classes_last: bool = False,
):
    """`steps` SGD steps of both networks on the same batches and structures; after each: logits,
    α's gradient, every weight's gradient, running statistics; then evaluation outputs."""
    generator = torch.Generator().manual_seed(3)
    opts = [torch.optim.SGD(n.parameters(), lr=0.05) for n in (reference, fused)]
    for step in range(steps):
        b = 4 if replicate else 4 * groups
        x = torch.randn(b, 3, x_size, x_size, generator=generator, dtype=torch.float64).contiguous(memory_format=layout)
        alpha = soft_alpha(groups, reference, seed=step).double()
        outputs, alpha_grads = [], []
        for net, opt in zip((reference, fused), opts):
            net.train()
            opt.zero_grad()
            a = alpha.clone().requires_grad_()
            with accumulated_running_statistics(net):
                out = net(x, a, replicate=replicate)
            weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
            (out * weight).sum().backward()
            outputs.append(out.detach())
            alpha_grads.append(a.grad)
        _assert_exact(outputs[1], outputs[0], f"logits, step {step}")
        _assert_exact(alpha_grads[1], alpha_grads[0], f"alpha's gradient, step {step}")
        grads = _as_per_edge(reference, fused, _gradients(fused))
        for name, grad in _gradients(reference).items():
            _assert_exact(grads[name], grad, f"{name}'s gradient, step {step}")
        for opt in opts:
            opt.step()
        _assert_states_equal(reference, fused)
    for net in (reference, fused):
        net.eval()
    x = torch.randn(3, 3, x_size, x_size, generator=generator, dtype=torch.float64).contiguous(memory_format=layout)
    alpha = soft_alpha(2, reference, seed=99).double()
    with torch.no_grad():
        _assert_exact(fused(x, alpha, replicate=True), reference(x, alpha, replicate=True), "evaluation")


@pytest.mark.parametrize("replicate", [True, False], ids=["shared-prefix", "grouped-input"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels-last"])
def test_fused_network_trains_and_predicts_as_the_per_edge_one(replicate, layout):
    reference, fused = _pair(_structure_net())
    if layout == torch.channels_last:
        reference, fused = (n.to(memory_format=layout) for n in (reference, fused))
    _train_and_compare(reference, fused, steps=3, groups=3, replicate=replicate, layout=layout)


@pytest.mark.parametrize(
    "ops",
    [("identity", "sep_conv_3x3", "dil_conv_3x3"), ("zero", "sep_conv_3x3"), ("zero", "identity"), ("dil_conv_3x3",)],
    ids=lambda ops: "+".join(ops),
)
def test_every_op_list_fuses_exactly(ops):
    reference, fused = _pair(_structure_net(ops=ops))
    _train_and_compare(reference, fused, steps=2, groups=2, replicate=True)


def test_segmentation_cells_fuse_exactly():
    """DBSNSegNet's cells: 3×3 input projection, the bottleneck and up path without the input."""
    reference, fused = _pair(
        lambda cell: DBSNSegNet(num_classes=4, first_channels=8, growth=4, num_nodes=3, num_down=2, cell=cell)
    )
    _train_and_compare(reference, fused, steps=2, groups=2, replicate=True, x_size=16)


def test_per_structure_statistics_are_the_same_with_either_cell():
    """`structure_statistics` and `using_statistics` (per-structure BatchNorm at prediction) name the
    fused cell's own modules: the statistics differ in layout, the predictions do not."""
    reference, fused = _pair(_structure_net())
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randn(6, 3, 8, 8, generator=generator, dtype=torch.float64) for _ in range(2)]
    alpha = soft_alpha(3, reference, seed=1).double()
    x = torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)
    outputs = []
    for net in (reference, fused):
        net.eval()
        statistics = structure_statistics(lambda b, n=net: n(b, alpha, replicate=True), net, batches, 3)
        with torch.no_grad(), using_statistics(net, statistics):
            outputs.append(net(x, alpha, replicate=True))
    _assert_exact(outputs[1], outputs[0], "prediction")


def test_checkpoints_convert_both_ways_and_back():
    reference, fused = _pair(_structure_net())
    assert _assert_states_equal(reference, fused) > 0
    back = _structure_net()("per_edge").double()
    back.load_state_dict(fused.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    # fused -> fused and per-edge -> per-edge load as they are
    _structure_net()("fused").double().load_state_dict(fused.state_dict())
    assert not any(key.startswith("stages.0.0.edge_ops") for key in fused.state_dict())
    assert not any(key.startswith("stages.0.0.sources") for key in reference.state_dict())


def test_fused_cell_stacks_the_parameters_into_fewer_tensors():
    reference, fused = _structure_net()("per_edge"), _structure_net()("fused")
    count = lambda net: sum(p.numel() for p in net.parameters())  # noqa: E731
    assert count(fused) == count(reference)
    assert len(list(fused.parameters())) < len(list(reference.parameters())) / 2


def test_stacked_convolutions_get_each_edge_s_fan_out():
    """The research code's He (fan-out) initialisation of a stacked convolution uses one edge's
    fan-out, not the stack's: the weights' spread matches the per-edge cell's."""
    torch.manual_seed(0)
    fused = StructureNet(num_classes=10, num_nodes=7, cells_per_stage=1, growth=16, cell="fused")
    torch.manual_seed(0)
    reference = StructureNet(num_classes=10, num_nodes=7, cells_per_stage=1, growth=16, cell="per_edge")
    depthwise = lambda net: torch.cat(
        [
            m.weight.flatten()
            for m in net.modules()  # noqa: E731
            if isinstance(m, nn.Conv2d) and m.groups == m.in_channels and m.kernel_size == (3, 3)
        ]
    )
    ratio = depthwise(fused).std() / depthwise(reference).std()
    assert 0.95 < float(ratio) < 1.05, float(ratio)


def test_unfuse_keeps_the_function_and_the_node_outputs():
    reference, fused = _pair(_structure_net())
    dropout = nn.Dropout(0.0)
    for cell in fused.modules():
        if isinstance(cell, FusedCell):
            cell.node_output = dropout
    unfused = unfuse(copy.deepcopy(fused))
    assert not any(isinstance(m, FusedCell) for m in unfused.modules()) and unfused.cell == "per_edge"
    assert all(c.node_output is not None for c in unfused.modules() if isinstance(c, Cell))
    x, alpha = torch.randn(2, 3, 8, 8, dtype=torch.float64), soft_alpha(2, reference).double()
    fused.eval(), unfused.eval()
    with torch.no_grad():
        _assert_exact(unfused(x, alpha, replicate=True), fused(x, alpha, replicate=True))


def test_unknown_ops_and_cell_kinds_are_refused_in_one_line():
    with pytest.raises(ValueError, match="cell must be one of"):
        StructureNet(num_classes=3, cell="wide")
    with pytest.raises(ValueError, match="set model.net.cell=per_edge"):
        FusedCell(4, 3, 4, ["identity", "max_pool_3x3"])
