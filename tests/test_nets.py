"""Tests of the structure-learnable network: ops, group BatchNorm, cell, StructureNet."""

import copy

import pytest
import torch
from netutil import join_groups, set_random_affine, soft_alpha, split_groups
from torch import nn

from dbsn.nets import OPS, Cell, GroupBatchNorm2d, StructureNet

OP_NAMES = ("zero", "identity", "sep_conv_3x3", "dil_conv_3x3")


def tiny_net(num_classes=5, **kw):
    args = dict(num_nodes=4, cells_per_stage=1, growth=4, stem_channels=8)
    args.update(kw)
    return StructureNet(num_classes, **args)


# --- GroupBatchNorm2d -------------------------------------------------------

@pytest.mark.parametrize("momentum", [0.1, None])
def test_group_bn_training_equals_separate_batchnorms(momentum):
    torch.manual_seed(0)
    groups, b, c = 3, 4, 5
    gbn = GroupBatchNorm2d(c, momentum=momentum)
    set_random_affine(gbn)
    separate = [nn.BatchNorm2d(c, momentum=momentum) for _ in range(groups)]
    for bn in separate:
        bn.load_state_dict(gbn.state_dict())

    for step in range(2):  # two steps: the running-stat update must compose too
        x = torch.randn(groups * b, c, 6, 6) * torch.arange(1, c + 1).view(1, c, 1, 1) + step
        y = gbn(x, groups)
        y_ref = join_groups([bn(xg) for bn, xg in zip(separate, split_groups(x, groups))])
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)

    # Running stats: the average of the G copies; step count as for one BN.
    for name in ("running_mean", "running_var"):
        mean_of_copies = torch.stack([getattr(bn, name) for bn in separate]).mean(0)
        torch.testing.assert_close(getattr(gbn, name), mean_of_copies, rtol=1e-5, atol=1e-6)
    assert int(gbn.num_batches_tracked) == 2

    # Gradients: grouped loss gradient = sum of the separate copies' gradients.
    gbn.zero_grad()
    w = torch.randn(groups * b, c, 6, 6)
    (gbn(x, groups) * w).sum().backward()
    for bn, xg, wg in zip(separate, split_groups(x, groups), split_groups(w, groups)):
        (bn(xg) * wg).sum().backward()
    torch.testing.assert_close(gbn.weight.grad, sum(bn.weight.grad for bn in separate))
    torch.testing.assert_close(gbn.bias.grad, sum(bn.bias.grad for bn in separate))


def test_group_bn_is_batchnorm_for_one_group_and_in_eval():
    torch.manual_seed(0)
    gbn, bn = GroupBatchNorm2d(4), nn.BatchNorm2d(4)
    set_random_affine(gbn)
    bn.load_state_dict(gbn.state_dict())
    x = torch.randn(6, 4, 5, 5) * 3 + 1
    torch.testing.assert_close(gbn(x, 1), bn(x))
    torch.testing.assert_close(gbn.running_var, bn.running_var)
    gbn.eval(), bn.eval()
    torch.testing.assert_close(gbn(x, 3), bn(x))  # eval: running stats, whatever the groups
    assert int(gbn.num_batches_tracked) == 1


# --- ops ----------------------------------------------------------------------

def test_ops_table_shapes_and_final_non_affine_bn():
    x = torch.randn(4, 6, 8, 8)
    for name, make in OPS.items():
        op = make(6)
        assert op(x, 1).shape == x.shape, name
        if name != "zero":
            last_bn = [m for m in op.modules() if isinstance(m, nn.BatchNorm2d)][-1]
            assert not last_bn.affine, f"{name} must end in a non-affine BN"
    assert sum(p.numel() for p in OPS["identity"](6).parameters()) == 0
    assert sum(p.numel() for p in OPS["zero"](6).parameters()) == 0


# --- cell -----------------------------------------------------------------------

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
    torch.testing.assert_close(edge_term(a + 2 * b), edge_term(a) + 2 * edge_term(b),
                               rtol=1e-4, atol=1e-5)
    # A one-hot alpha scaled by c gives c times that op alone.
    for k in (1, 2, 3):
        one_hot = torch.eye(4)[k]
        torch.testing.assert_close(edge_term(2.5 * one_hot), 2.5 * edge_term(one_hot),
                                   rtol=1e-4, atol=1e-5)
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


# --- StructureNet -------------------------------------------------------------

def test_grouped_forward_equals_separate_forwards_in_eval():
    torch.manual_seed(0)
    net = tiny_net()
    set_random_affine(net)
    G, b = 3, 2
    alpha = soft_alpha(G, net)
    with torch.no_grad():  # put non-trivial running statistics in place
        for step in range(3):
            net(torch.randn(G * b, 3, 16, 16) * 2 + step, alpha)
    net.eval()
    x = torch.randn(G * b, 3, 16, 16)
    with torch.no_grad():
        grouped = net(x, alpha)
        separate = join_groups([net(xg, alpha[g]) for g, xg in enumerate(split_groups(x, G))])
    torch.testing.assert_close(grouped, separate, rtol=1e-4, atol=1e-5)


def test_grouped_forward_equals_separate_forwards_in_training():
    torch.manual_seed(0)
    net = tiny_net()
    set_random_affine(net)
    G, b = 3, 4
    alpha = soft_alpha(G, net, seed=1)
    copies = [copy.deepcopy(net) for _ in range(G)]
    x = torch.randn(G * b, 3, 16, 16)

    grouped = net(x, alpha)
    separate = [c(xg, alpha[g]) for g, (c, xg) in enumerate(zip(copies, split_groups(x, G)))]
    torch.testing.assert_close(grouped, join_groups(separate), rtol=1e-4, atol=1e-5)

    # Gradients of the summed loss and running statistics (mean over the copies) agree.
    grouped.square().sum().backward()
    for out in separate:
        out.square().sum().backward()
    for name, p in net.named_parameters():
        ref = sum(dict(c.named_parameters())[name].grad for c in copies)
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-5, msg=name)
    for name, buf in net.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            ref = torch.stack([dict(c.named_buffers())[name] for c in copies]).mean(0)
            torch.testing.assert_close(buf, ref, rtol=1e-4, atol=1e-5, msg=name)


def test_one_group_alpha_as_matrix_or_batch_of_one():
    net = tiny_net()
    x, alpha = torch.randn(4, 3, 16, 16), soft_alpha(1, net)
    torch.testing.assert_close(net(x, alpha[0]), net(x, alpha))
    # The grouped BN path with G = 1 in eval also matches (fast path check).
    net.eval()
    torch.testing.assert_close(net(x, alpha[0]), net(x, alpha))


def test_output_shape_and_gradients_reach_alpha():
    net = tiny_net(num_classes=7)
    alpha = soft_alpha(2, net).requires_grad_()
    out = net(torch.randn(6, 3, 16, 16), alpha)
    assert out.shape == (6, 7)
    out.logsumexp(-1).sum().backward()
    assert alpha.grad is not None and alpha.grad.shape == alpha.shape
    assert torch.all(alpha.grad[..., 0] == 0)  # "zero" is never computed
    assert torch.all(alpha.grad[..., 1:].abs().sum(-1) > 0)  # every edge of every group


def test_bad_alpha_and_ops_raise_helpful_errors():
    net = tiny_net()
    x = torch.randn(4, 3, 16, 16)
    with pytest.raises(ValueError, match=r"alpha must have shape \(G, 6, 4\)"):
        net(x, torch.rand(2, 5, 4))
    with pytest.raises(ValueError, match="alpha must have shape"):
        net(x, torch.rand(6, 3))
    with pytest.raises(ValueError, match="not divisible"):
        net(x, soft_alpha(3, net))
    with pytest.raises(ValueError, match="sep_conv_3x3"):
        tiny_net(ops=("zero", "max_pool_3x3"))
    custom = tiny_net(ops=("identity", "sep_conv_3x3", "dil_conv_3x3"))  # K = 3, no zero
    assert custom.num_ops == 3 and custom.op_names == ["identity", "sep_conv_3x3", "dil_conv_3x3"]
    assert custom(x, soft_alpha(1, custom, num_ops=3)).shape == (4, 5)


def test_parameter_counts_of_paper_and_small_models():
    def count(net):
        return sum(p.numel() for p in net.parameters())

    c10, c100 = StructureNet(10), StructureNet(100)
    small = StructureNet(10, num_nodes=4, cells_per_stage=1)
    print(f"params: paper C10 {count(c10)}, C100 {count(c100)}, small (B=4, 3 cells) {count(small)}")
    assert c10.num_edges == 21 and c10.num_ops == 4 and small.num_edges == 6
    assert 0.9e6 <= count(c10) <= 1.1e6
    assert 1.05e6 <= count(c100) <= 1.15e6
    assert 38e3 <= count(small) <= 44e3

    c10.eval()  # one tiny forward of the paper-size net
    with torch.no_grad():
        assert c10(torch.randn(2, 3, 8, 8), soft_alpha(2, c10)).shape == (2, 10)


@pytest.mark.parametrize("training", [True, False])
def test_replicate_equals_forward_on_repeated_input(training):
    torch.manual_seed(0)
    net = tiny_net()
    set_random_affine(net)
    twin = copy.deepcopy(net)
    net.train(training), twin.train(training)
    G, b = 3, 4
    alpha = soft_alpha(G, net, seed=2)
    x = torch.randn(b, 3, 16, 16)
    expected = twin(x.repeat_interleave(G, 0), alpha)
    torch.testing.assert_close(net(x, alpha, replicate=True), expected, rtol=1e-4, atol=1e-5)
    for (name, buf), ref in zip(net.named_buffers(), twin.buffers()):
        torch.testing.assert_close(buf, ref, rtol=1e-5, atol=1e-6, msg=name)
