"""The cell (dbsn.nets.cell): edge order, α entering linearly per op, node outputs, and the options
of the segmentation network's cells.
"""

import pytest
import torch
from torch import nn

from dbsn.nets import OPS, Cell
from tests.support.netutil import SEG_OPS, set_random_affine, soft_alpha

OP_NAMES = ("zero", "identity", "sep_conv_3x3", "dil_conv_3x3")


def make_cell(num_nodes=4, growth=3, in_channels=5):
    torch.manual_seed(0)
    cell = Cell(in_channels, num_nodes, growth, OP_NAMES)
    set_random_affine(cell)
    return cell


def run_cell_with_slices(cell, x, alpha):
    """Cell output split into (input, nodes), plus the projected slices via a hook."""
    seen = {}
    handle = cell.preprocess.register_forward_hook(lambda m, i, out: seen.update(out=out))
    out = cell(x, alpha)
    handle.remove()
    c_in = x.shape[1]
    nodes = out[:, c_in:].split(cell.growth, dim=1)
    slices = seen["out"].split(cell.growth, dim=1)
    return out[:, :c_in], nodes, slices


def test_cell_edge_order_and_output_channels():
    cell = make_cell(num_nodes=4)
    assert cell.edges == [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    assert len(cell.edge_ops) == 6 and all(len(ops) == 4 for ops in cell.edge_ops)
    x = torch.randn(4, 5, 7, 7)
    out = cell(x, soft_alpha(2, 6))
    assert out.shape == (4, 5 + 4 * 3, 7, 7)
    torch.testing.assert_close(out[:, :5], x)


def test_zero_on_every_edge_into_a_node_leaves_its_slice():
    cell = make_cell(num_nodes=4)
    alpha = soft_alpha(2, 6)
    j = 2
    into_j = [e for e, (_, tgt) in enumerate(cell.edges) if tgt == j]
    alpha[0, into_j] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # group 0 only: "zero" everywhere
    x = torch.randn(4, 5, 6, 6)
    _, nodes, slices = run_cell_with_slices(cell, x, alpha)
    torch.testing.assert_close(nodes[0], slices[0])
    torch.testing.assert_close(nodes[j][0::2], slices[j][0::2])  # group 0: rows 0, 2
    assert not torch.allclose(nodes[j][1::2], slices[j][1::2])  # group 1 has live edges


def test_alpha_enters_linearly_per_op():
    """Node 1 = slice 1 + sum_k alpha[0, k] op_k(node 0): linear in alpha[0]."""
    cell = make_cell(num_nodes=3)
    x = torch.randn(4, 5, 6, 6)
    base = soft_alpha(1, 3)

    def edge_term(alpha_edge0):
        alpha = base.clone()
        alpha[0, 0] = alpha_edge0
        _, nodes, slices = run_cell_with_slices(cell, x, alpha)
        return nodes[1] - slices[1]

    a, b = torch.tensor([0.3, 0.5, -0.2, 0.7]), torch.tensor([0.9, -0.4, 0.6, 0.1])
    torch.testing.assert_close(edge_term(a + 2 * b), edge_term(a) + 2 * edge_term(b), rtol=1e-4, atol=1e-5)
    # A one-hot alpha scaled by c gives c times that op alone.
    for k in (1, 2, 3):
        one_hot = torch.eye(4)[k]
        torch.testing.assert_close(edge_term(2.5 * one_hot), 2.5 * edge_term(one_hot), rtol=1e-4, atol=1e-5)
    assert edge_term(torch.eye(4)[0]).abs().max() == 0  # "zero" contributes nothing


def test_node_output_acts_on_every_node_as_its_successors_see_it():
    cell = make_cell(num_nodes=3)
    x, alpha = torch.randn(4, 5, 6, 6), soft_alpha(1, 3)
    seen = []

    class ZeroAndRecord(nn.Module):
        def forward(self, t):
            seen.append(t.detach().clone())
            return torch.zeros_like(t)

    cell.node_output = ZeroAndRecord()
    _, nodes, slices = run_cell_with_slices(cell, x, alpha)
    assert len(seen) == 3 and all(n.abs().max() == 0 for n in nodes)  # once per node, output replaced
    torch.testing.assert_close(seen[0], slices[0])
    # node 1 was computed from node 0 AFTER node_output (zeros), not from slice 0
    from_zeros = Cell._mixed_edge(torch.zeros_like(slices[0]), alpha[:, 0], cell.edge_ops[0])
    torch.testing.assert_close(seen[1], slices[1] + from_zeros)
    assert not torch.allclose(seen[1], slices[1] + Cell._mixed_edge(slices[0], alpha[:, 0], cell.edge_ops[0]))


def test_node_output_dropout_masks_are_per_group_with_shared_inputs():
    """With expand=True node 0 holds rows shared by all structures; a per-row layer on it must
    still draw one mask per group (per Bayes-ensemble member)."""
    cell = make_cell(num_nodes=3, growth=3)
    x, alpha = torch.randn(2, 5, 6, 6), soft_alpha(3, 3)
    node0 = lambda out: out[:, 5:8].reshape(2, 3, 3, 6, 6)  # (b, G, growth, H, W)
    shared = node0(cell(x, alpha, expand=True))
    assert torch.equal(shared[:, 0], shared[:, 1])  # identity node_output: the groups share node 0
    cell.node_output = nn.Dropout(0.5)
    torch.manual_seed(1)
    dropped = node0(cell(x, alpha, expand=True))
    assert not torch.equal(dropped[:, 0], dropped[:, 1]) and not torch.equal(dropped[:, 1], dropped[:, 2])
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], 2 * shared[kept])  # inverted dropout of the same values


# --- Cell options --------------------------------------------------------------------------


def test_cell_default_projection_is_unchanged():
    """projection_kernel=1 (the default) keeps the state_dict of the original cell."""
    names = ("zero", "identity", "sep_conv_3x3", "dil_conv_3x3")
    c_in, nodes, growth = 5, 4, 3
    expected = {
        "preprocess.0.weight": (c_in,),
        "preprocess.0.bias": (c_in,),
        "preprocess.0.running_mean": (c_in,),
        "preprocess.0.running_var": (c_in,),
        "preprocess.0.num_batches_tracked": (),
        "preprocess.2.weight": (nodes * growth, c_in, 1, 1),
        "preprocess.3.running_mean": (nodes * growth,),
        "preprocess.3.running_var": (nodes * growth,),
        "preprocess.3.num_batches_tracked": (),
    }
    for e in range(nodes * (nodes - 1) // 2):
        for k, name in enumerate(names):
            for key, value in OPS[name](growth).state_dict().items():
                expected[f"edge_ops.{e}.{k}.{key}"] = tuple(value.shape)
    for cell in (Cell(c_in, nodes, growth, names), Cell(c_in, nodes, growth, names, projection_kernel=1)):
        assert {k: tuple(v.shape) for k, v in cell.state_dict().items()} == expected
        assert cell.preprocess[2].padding == (0, 0) and cell.out_channels == c_in + nodes * growth
    three = Cell(c_in, nodes, growth, names, projection_kernel=3)
    assert three.preprocess[2].weight.shape == (nodes * growth, c_in, 3, 3)
    assert three.preprocess[2].padding == (1, 1)


@pytest.mark.parametrize("expand", [False, True])
def test_cell_keep_input_false_outputs_the_nodes_only(expand):
    torch.manual_seed(0)
    keep = Cell(5, 4, 3, SEG_OPS, projection_kernel=3)
    new_only = Cell(5, 4, 3, SEG_OPS, projection_kernel=3, keep_input=False)
    new_only.load_state_dict(keep.state_dict())
    assert new_only.out_channels == 12
    G, alpha = 2, soft_alpha(2, 6, 3)
    x = torch.randn(2 if expand else 2 * G, 5, 6, 6)
    full, nodes = keep(x, alpha, expand=expand), new_only(x, alpha, expand=expand)
    assert nodes.shape == (2 * G, 12, 6, 6)
    torch.testing.assert_close(nodes, full[:, 5:])
