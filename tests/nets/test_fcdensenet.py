"""Tests of the CamVid segmentation networks (dbsn.nets.fcdensenet: FC-DenseNet67 and DBSNSegNet)."""

import time

import pytest
import torch
from torch import nn

from dbsn.nets import DBSNSegNet, FCDenseNet
from dbsn.nets.fcdensenet import _pad_to_multiple
from tests.support.invariants import assert_grouped_equals_copies, assert_replicate_equals_repeated_input
from tests.support.netutil import SEG_OPS, set_random_affine, soft_alpha


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
    grouped = assert_grouped_equals_copies(net, x, alpha)
    assert grouped.shape == (G * b, 4, 10, 14)


def test_dbsn_grouped_forward_equals_separate_forwards_in_training():
    net = tiny_dbsn()
    G, b = 2, 2
    alpha = soft_alpha(G, 20, 3, seed=1)
    x = torch.randn(G * b, 3, 10, 14)
    assert_grouped_equals_copies(net, x, alpha, grad_atol_scales=True)  # float32 sums: error scales with |grad|


@pytest.mark.parametrize("training", [True, False])
def test_dbsn_replicate_equals_forward_on_repeated_input(training):
    net = tiny_dbsn()
    net.train(training)
    G, x = 3, torch.randn(2, 3, 10, 14)
    alpha = soft_alpha(G, 20, 3, seed=2)
    assert_replicate_equals_repeated_input(net, x, alpha)


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
