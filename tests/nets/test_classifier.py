"""The structure-learnable classifier (dbsn.nets.classifier.StructureNet): grouped forwards equal
separate ones, shapes, errors, parameter counts, replication, and one compiled graph.
"""

from __future__ import annotations

import pytest
import torch

from dbsn.nets import StructureNet
from tests.support.invariants import assert_grouped_equals_copies, assert_replicate_equals_repeated_input
from tests.support.marks import needs_cpp_compiler
from tests.support.netutil import set_random_affine, soft_alpha


def tiny_net(num_classes=5, **kw):
    args = dict(num_nodes=4, cells_per_stage=1, growth=4, stem_channels=8)
    args.update(kw)
    return StructureNet(num_classes, **args)


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
    assert_grouped_equals_copies(net, x, alpha)


def test_grouped_forward_equals_separate_forwards_in_training():
    torch.manual_seed(0)
    net = tiny_net()
    set_random_affine(net)
    G, b = 3, 4
    alpha = soft_alpha(G, net, seed=1)
    x = torch.randn(G * b, 3, 16, 16)
    # outputs, the gradients of the summed loss and the running statistics (mean over the copies)
    assert_grouped_equals_copies(net, x, alpha)


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
    net.train(training)
    G, b = 3, 4
    alpha = soft_alpha(G, net, seed=2)
    x = torch.randn(b, 3, 16, 16)
    assert_replicate_equals_repeated_input(net, x, alpha)


# --- torch.compile ---------------------------------------------------------------
COMPILE_NET = dict(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)


def _networks(segmentation: bool):
    from dbsn.nets import DBSNSegNet

    nets = {"StructureNet": (StructureNet(**COMPILE_NET), (2, 3, 16, 16), 3)}
    if segmentation:
        nets["DBSNSegNet"] = (
            DBSNSegNet(num_classes=5, first_channels=8, growth=4, num_down=2, num_nodes=3),
            (1, 3, 16, 16),
            2,
        )
    return nets


@needs_cpp_compiler
@pytest.mark.parametrize(
    "channels_last, autocast",
    [(False, True), (True, False), (True, True)],
    ids=["bf16_autocast", "channels_last", "channels_last_bf16_autocast"],
)
def test_the_networks_compile_to_one_graph(channels_last, autocast):
    """No graph break in training or prediction, in either layout, with or without autocast: a
    break splits the compiled forward and recompiles per module (the float32 islands of
    `dbsn.precision` once broke every channels-last BatchNorm). dynamo's trace only, no code
    generation; the segmentation network (same cells and BatchNorm) in the last setting only."""
    for name, (net, shape, groups) in _networks(channels_last and autocast).items():
        if channels_last:
            net = net.to(memory_format=torch.channels_last)
        x = torch.randn(shape).contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        )
        for training in (True, False):
            net.train(training)
            alpha = torch.softmax(torch.randn(groups, net.num_edges, net.num_ops), -1)
            with torch.inference_mode(not training), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                explained = torch._dynamo.explain(net)(x, alpha, replicate=True)
            assert explained.graph_break_count == 0, (
                name,
                training,
                [str(b.reason)[:200] for b in explained.break_reasons],
            )
            assert explained.graph_count == 1
