"""Tests of the CamVid segmentation networks (FC-DenseNet67 and DBSNSegNet) and Cell options."""

import copy
import time

import pytest
import torch
from netutil import join_groups, set_random_affine, soft_alpha, split_groups
from torch import nn

from dbsn.nets import OPS, Cell, DBSNSegNet, FCDenseNet
from dbsn.nets.fcdensenet import _pad_to_multiple

SEG_OPS = ("identity", "sep_conv_3x3", "dil_conv_3x3")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small convs: OpenMP threads fighting over shared cores are far slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def count(net):
    return sum(p.numel() for p in net.parameters())


def tiny_dbsn(num_down=2, **kw):
    """B = 5 (10 edges per structure, alpha (G, 20, 3)) but few channels."""
    torch.manual_seed(0)
    net = DBSNSegNet(num_classes=4, first_channels=6, growth=2, num_down=num_down, **kw)
    set_random_affine(net)
    return net


def tiny_fcdensenet(**kw):
    torch.manual_seed(0)
    return FCDenseNet(num_classes=4, first_channels=6, growth=2, layers_per_block=2, **kw)


# --- parameter counts and shapes -----------------------------------------------------------

def test_parameter_counts_match_the_paper():
    fc, dbsn = FCDenseNet(), DBSNSegNet()
    print(f"params: FC-DenseNet67 {count(fc)}, DBSN-seg {count(dbsn)}")
    assert abs(count(fc) - 3.5e6) <= 0.1 * 3.5e6
    assert abs(count(dbsn) - 3.3e6) <= 0.1 * 3.3e6
    assert count(dbsn) < count(fc)  # "fewer parameters" (paper Table 3)
    assert dbsn.num_edges == 20 and dbsn.num_ops == 3 and dbsn.op_names == list(SEG_OPS)
    assert fc.num_edges == 0 and fc.num_ops == 0 and fc.op_names == [] and fc.edges == []


def test_structure_labels():
    net = DBSNSegNet()
    cell_edges = [(i, j) for j in range(1, 5) for i in range(j)]
    assert net.edges == cell_edges * 2
    assert net.structure_slices == {"down": slice(0, 10), "up": slice(10, 20)}
    names = net.edge_names()
    assert len(names) == 20 and names[0] == "down 0→1" and names[10] == "up 0→1" and names[-1] == "up 3→4"
    # Every cell is B = 5 with a 3x3 projection; bottleneck and up cells but the last pass new features only.
    cells = [*net.down_cells, net.bottleneck, *net.up_cells]
    assert len(cells) == 11 and all(c.preprocess[2].kernel_size == (3, 3) for c in cells)
    assert [c.keep_input for c in cells] == [True] * 5 + [False] * 5 + [True]


@pytest.mark.parametrize("size", [(36, 52), (33, 47), (64, 64), (5, 7)])
def test_output_has_the_input_size(size):
    x = torch.randn(2, 3, *size)
    for net in (tiny_fcdensenet(), tiny_dbsn(num_down=5)):
        net.eval()
        with torch.no_grad():
            out = net(x, soft_alpha(1, net.num_edges, net.num_ops))
        assert out.shape == (2, 4, *size), type(net).__name__


def test_padding_reflects_and_crops_back_exactly():
    x = torch.randn(1, 3, 33, 47)
    padded, (rows, cols) = _pad_to_multiple(x, 32)
    assert padded.shape[-2:] == (64, 64)
    torch.testing.assert_close(padded[..., rows, cols], x)  # the crop takes back the input
    torch.testing.assert_close(padded[..., rows.start - 1, cols], x[..., 1, :])  # reflect
    small, (rows, cols) = _pad_to_multiple(torch.randn(1, 3, 5, 7), 32)  # too small: zeros
    assert small.shape[-2:] == (32, 32) and small[..., 0, :].abs().max() == 0
    same, _ = _pad_to_multiple(x[..., :32, :32], 32)
    assert same.shape[-2:] == (32, 32)


def test_fcdensenet_camvid_resolution():
    net = FCDenseNet().eval()
    start = time.perf_counter()
    with torch.no_grad():
        out = net(torch.randn(1, 3, 360, 480))
    print(f"FC-DenseNet67 forward at 360x480: {time.perf_counter() - start:.1f} s")
    assert out.shape == (1, 11, 360, 480)


# --- FCDenseNet: interface and dropout ---------------------------------------------------

def test_fcdensenet_dropout_layers():
    net = FCDenseNet()
    drops = [m for m in net.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 11 * 5 + 5  # every dense layer and every transition down
    assert all(d.p == 0.2 for d in drops)
    assert not [m for m in DBSNSegNet().modules() if isinstance(m, nn.Dropout)]


def test_fcdensenet_replicate_gives_copies():
    net = tiny_fcdensenet()
    x, G = torch.randn(2, 3, 20, 24), 3
    alpha = torch.empty(G, 0, 0)
    net.eval()
    with torch.no_grad():
        out = net(x, alpha, replicate=True)
        assert out.shape == (2 * G, 4, 20, 24)
        for g in range(G):
            torch.testing.assert_close(out[g::G], net(x))
        assert net(x.repeat(G, 1, 1, 1), alpha).shape == (2 * G, 4, 20, 24)  # replicate=False: as is
    net.train()  # training: each copy has its own dropout masks
    with torch.no_grad():
        out = net(x, alpha, replicate=True).view(2, G, 4, 20, 24)
    assert not torch.allclose(out[:, 0], out[:, 1])
    with pytest.raises(ValueError, match=r"alpha must have shape \(G, 0, 0\)"):
        net(x, torch.rand(1, 20, 3))


# --- DBSNSegNet: grouped forward ---------------------------------------------------------

def test_dbsn_grouped_forward_equals_separate_forwards_in_eval():
    net = tiny_dbsn()
    G, b = 2, 2
    alpha = soft_alpha(G, 20, 3)
    with torch.no_grad():  # non-trivial running statistics
        for step in range(2):
            net(torch.randn(G * b, 3, 10, 14) * 2 + step, alpha)
    net.eval()
    x = torch.randn(G * b, 3, 10, 14)
    with torch.no_grad():
        grouped = net(x, alpha)
        separate = join_groups([net(xg, alpha[g]) for g, xg in enumerate(split_groups(x, G))])
    assert grouped.shape == (G * b, 4, 10, 14)
    torch.testing.assert_close(grouped, separate, rtol=1e-4, atol=1e-5)


def test_dbsn_grouped_forward_equals_separate_forwards_in_training():
    net = tiny_dbsn()
    G, b = 2, 2
    alpha = soft_alpha(G, 20, 3, seed=1)
    copies = [copy.deepcopy(net) for _ in range(G)]
    x = torch.randn(G * b, 3, 10, 14)
    grouped = net(x, alpha)
    separate = [c(xg, alpha[g]) for g, (c, xg) in enumerate(zip(copies, split_groups(x, G)))]
    torch.testing.assert_close(grouped, join_groups(separate), rtol=1e-4, atol=1e-5)

    grouped.square().sum().backward()
    for out in separate:
        out.square().sum().backward()
    for name, p in net.named_parameters():
        ref = sum(dict(c.named_parameters())[name].grad for c in copies)
        atol = 1e-5 * max(1.0, float(ref.abs().max()))  # float32 sums: error scales with |grad|
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=atol, msg=name)
    for name, buf in net.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            ref = torch.stack([dict(c.named_buffers())[name] for c in copies]).mean(0)
            torch.testing.assert_close(buf, ref, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("training", [True, False])
def test_dbsn_replicate_equals_forward_on_repeated_input(training):
    net = tiny_dbsn()
    twin = copy.deepcopy(net)
    net.train(training), twin.train(training)
    G, x = 3, torch.randn(2, 3, 10, 14)
    alpha = soft_alpha(G, 20, 3, seed=2)
    expected = twin(x.repeat_interleave(G, 0), alpha)
    torch.testing.assert_close(net(x, alpha, replicate=True), expected, rtol=1e-4, atol=1e-5)
    for (name, buf), ref in zip(net.named_buffers(), twin.buffers()):
        torch.testing.assert_close(buf, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_down_and_up_slices_drive_their_cells():
    net = tiny_dbsn().eval()
    seen = []
    net.bottleneck.register_forward_hook(lambda m, i, out: seen.append(out))
    x, alpha = torch.randn(2, 3, 10, 14), soft_alpha(2, 20, 3)
    new_up, new_down = alpha.clone(), alpha.clone()
    new_up[:, 10:] = soft_alpha(2, 20, 3, seed=5)[:, 10:]
    new_down[:, :10] = soft_alpha(2, 20, 3, seed=5)[:, :10]
    with torch.no_grad():
        out, out_up, out_down = net(x, alpha), net(x, new_up), net(x, new_down)
    torch.testing.assert_close(seen[1], seen[0])  # up slice: bottleneck untouched ...
    assert not torch.allclose(out_up, out, atol=1e-4)  # ... but the output changes
    assert not torch.allclose(seen[2], seen[0], atol=1e-4)  # down slice reaches the bottleneck
    assert not torch.allclose(out_down, out, atol=1e-4)
    with pytest.raises(ValueError, match=r"alpha must have shape \(G, 20, 3\)"):
        net(x, torch.rand(2, 10, 3))


# --- Cell options --------------------------------------------------------------------------

def test_cell_default_projection_is_unchanged():
    """projection_kernel=1 (the default) keeps the state_dict of the original cell."""
    names = ("zero", "identity", "sep_conv_3x3", "dil_conv_3x3")
    c_in, nodes, growth = 5, 4, 3
    expected = {
        "preprocess.0.weight": (c_in,), "preprocess.0.bias": (c_in,),
        "preprocess.0.running_mean": (c_in,), "preprocess.0.running_var": (c_in,),
        "preprocess.0.num_batches_tracked": (),
        "preprocess.2.weight": (nodes * growth, c_in, 1, 1),
        "preprocess.3.running_mean": (nodes * growth,), "preprocess.3.running_var": (nodes * growth,),
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
