"""MIMO (dbsn.methods.mimo, dbsn.nets.mimo): each head is scored on its own input, the training
batch's repetitions, the test-time tiling and the heads' rows i·M + m, the transform on every
backbone, and two training steps with a test pass on digits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dbsn.methods import MIMO
from dbsn.nets import VGG16BN, Backbone, StructureNet
from dbsn.nets.mimo import mimo, stem_of
from dbsn.nets.resnet import ResNet18
from dbsn.nets.wideresnet import WideResNet
from tests.support.configs import compose_config

M, CLASSES, WIDTH = 3, 8, 4  # members, classes, features per member


class Subnets(Backbone):
    """A network without BatchNorm (rows independent) whose MIMO version, after `block_diagonal`,
    is M separate subnetworks: feature block m reads only input block m, head m only feature
    block m."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__(num_classes)
        self.stem = nn.Conv2d(3, M * WIDTH, 3, padding=1)
        self.classifier = nn.Linear(M * WIDTH, num_classes)

    def logits(self, x: Tensor, groups: int) -> Tensor:
        return self.classifier(torch.tanh(self.stem(x)).mean((2, 3)))


def block_diagonal(net: Subnets) -> Subnets:
    with torch.no_grad():
        for m in range(M):
            feats = slice(m * WIDTH, (m + 1) * WIDTH)
            for k in range(M):
                if k != m:
                    net.stem.weight[feats, 3 * k : 3 * (k + 1)] = 0.0
                    net.classifier.weight[m * CLASSES : (m + 1) * CLASSES, k * WIDTH : (k + 1) * WIDTH] = 0.0
    return net


def subnet(net: Subnets, m: int, x: Tensor) -> Tensor:
    """Member m's logits on plain images x (b, 3, H, W), from its blocks of the weights alone."""
    feats = slice(m * WIDTH, (m + 1) * WIDTH)
    h = torch.tanh(F.conv2d(x, net.stem.weight[feats, 3 * m : 3 * (m + 1)], net.stem.bias[feats], padding=1)).mean(
        (2, 3)
    )
    rows = slice(m * CLASSES, (m + 1) * CLASSES)
    return F.linear(h, net.classifier.weight[rows, feats], net.classifier.bias[rows])


def subnets_method(**settings) -> MIMO:
    torch.manual_seed(0)
    method = MIMO(Subnets(), size=M, learn_structure=False, dataset_size=10, **settings)
    block_diagonal(method.net)
    with torch.no_grad():
        method.net.classifier.bias.normal_()  # heads that differ in every way
    return method


def test_each_head_is_scored_against_the_input_it_sees():
    """Every row of the training loss: its logits depend on exactly one image (gradient zero on
    all others), that image is its target's, and its value is its own member's subnetwork on it.
    Labels are unique per example, so a target names its image; pairing a member's targets with
    another member's permutation, concatenating the inputs in another order, or reading the heads
    out in another order breaks this."""
    method = subnets_method(batch_repetitions=2)
    x = torch.randn(CLASSES, 3, 6, 6, requires_grad=True)
    y = torch.arange(CLASSES)
    out = method.training_loss(x, y)
    logits, targets = out["logits"], out["targets"]
    assert logits.shape == (2 * CLASSES * M, CLASSES) and targets.shape == (2 * CLASSES * M,)
    for r in range(logits.shape[0]):
        (grad,) = torch.autograd.grad(logits[r].sum(), x, retain_graph=True)
        seen = grad.flatten(1).abs().sum(1) > 0
        assert seen.nonzero().flatten().tolist() == [targets[r].item()], r
        torch.testing.assert_close(logits[r], subnet(method.net, r % M, x[targets[r]].unsqueeze(0))[0])
    nll = F.cross_entropy(logits, targets)
    torch.testing.assert_close(out["nll"], nll)
    torch.testing.assert_close(out["loss"], M * nll)  # the members' NLLs summed, as the authors' code


def test_batch_and_input_repetition():
    """r = 3: every member sees every example 3 times, in its own order (ρ = 0); ρ = 1: all
    members see the same example on every row; ρ = 0.5: at least half the rows are shared."""
    b, r = 8, 3
    y = torch.arange(b)
    rows = {}
    for rho in (0.0, 0.5, 1.0):
        method = subnets_method(batch_repetitions=r, input_repetition=rho)
        torch.manual_seed(1)
        rows[rho] = method.mimo_batch(torch.randn(b, 3, 4, 4), y)[1].view(b * r, M)  # (n, M) labels
        for m in range(M):
            assert rows[rho][:, m].sort().values.tolist() == y.repeat_interleave(r).tolist()
    same = {rho: (t == t[:, :1]).all(1).sum().item() for rho, t in rows.items()}
    assert same[1.0] == b * r
    assert same[0.5] >= b * r - int(b * r * 0.5)
    assert same[0.0] < b * r // 2
    assert all(not torch.equal(rows[0.0][:, 0], rows[0.0][:, m]) for m in range(1, M))


def test_rho_one_gives_every_member_the_same_image():
    method = subnets_method(batch_repetitions=1, input_repetition=1.0)
    x, y = torch.randn(CLASSES, 3, 6, 6), torch.arange(CLASSES)
    inputs, targets = method.mimo_batch(x, y)
    assert all(torch.equal(inputs[:, 3 * m : 3 * (m + 1)], inputs[:, :3]) for m in range(M))
    assert torch.equal(inputs[:, :3], x[targets[::M]])


def test_prediction_tiles_the_image_and_reads_head_m_as_member_m():
    method = subnets_method().eval()
    x = torch.randn(5, 3, 6, 6)
    with torch.no_grad():
        members = method.stochastic_forward(x, M)  # (M, b, C)
        wanted = torch.stack([subnet(method.net, m, x) for m in range(M)])
        torch.testing.assert_close(members, wanted)
        torch.testing.assert_close(method.stochastic_forward(x, 1, first=2)[0], wanted[2])
        log_probs = method.predict_log_probs(x)
    torch.testing.assert_close(log_probs, wanted.softmax(-1).mean(0).log())


def test_runs_are_reproducible_from_the_global_seed():
    method = subnets_method()
    x, y = torch.randn(8, 3, 4, 4), torch.arange(8)
    torch.manual_seed(3)
    first = method.mimo_batch(x, y)[1]
    torch.manual_seed(3)
    assert torch.equal(method.mimo_batch(x, y)[1], first)
    assert not torch.equal(method.mimo_batch(x, y)[1], first)


NETS = {
    "vgg16_bn": lambda: VGG16BN(10, width=0.25),
    "resnet18": lambda: ResNet18(10, width=4),
    "wrn": lambda: WideResNet(10, depth=10, widen_factor=1),
    "structure_net": lambda: StructureNet(10, num_nodes=4, cells_per_stage=1, growth=4, stem_channels=8),
}


@pytest.mark.parametrize("name", NETS)
def test_transform_widens_the_stem_and_the_classifier(name):
    torch.manual_seed(0)
    net = NETS[name]()
    path = next(p for p, module in net.named_modules() if isinstance(module, nn.Conv2d))
    stem, head = net.get_submodule(path), net.classifier
    before = sum(p.numel() for p in net.parameters())
    mimo(net, M)
    wide = net.get_submodule(path)
    assert (
        stem_of(net)[2] is wide and wide.in_channels == M * stem.in_channels and wide.out_channels == stem.out_channels
    )
    assert (wide.kernel_size, wide.stride, wide.padding) == (stem.kernel_size, stem.stride, stem.padding)
    assert net.classifier.out_features == M * head.out_features and net.num_classes == 10
    extra = (M - 1) * (stem.weight.numel() + head.weight.numel() + head.out_features)
    assert sum(p.numel() for p in net.parameters()) == before + extra
    # fan-in over M images: the stem keeps its output scale; the heads keep the classifier's
    assert wide.weight.std().item() == pytest.approx(stem.weight.std().item() / math.sqrt(M), rel=0.25)
    assert net.classifier.weight.std().item() == pytest.approx(head.weight.std().item(), rel=0.25)
    alpha = torch.full((1, net.num_edges, net.num_ops), 1.0 / max(net.num_ops, 1))
    assert net(torch.randn(2, 3 * M, 32, 32), alpha).shape == (2, 10 * M)
    if name == "structure_net":
        assert path == "stem"
    with pytest.raises(ValueError, match="already a MIMO network"):
        mimo(net, M)


def test_refuses_a_network_without_classifier():
    with pytest.raises(ValueError, match="`classifier`"):
        mimo(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), M)


def _train_on_digits(tmp_path, *extra):
    from dbsn.runtime.run import train

    overrides = [
        "model=mimo",
        *extra,
        "data=digits",
        "data.batch_size=8",
        "data.eval_batch_size=64",
        "model.batch_repetitions=2",
        "model.prediction.samples_per_forward=2",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_test_batches=1",
        "statistics.resamples=20",
        "callbacks.structure_posterior=null",
    ]
    cfg = compose_config("train", overrides, tmp_path)
    metrics = train(cfg, tmp_path)
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] >= 2
    state = checkpoint["state_dict"]
    assert state["net.stem.weight" if "net.stem.weight" in state else "net.conv1.weight"].shape[1] == 3 * M
    assert state["net.classifier.weight"].shape[0] == 10 * M
    return cfg, metrics


def test_trains_two_steps_and_predicts_on_digits_on_the_cell_network(tmp_path):
    """Through train.py's path: two steps, the test pass and the evaluations, with M members."""
    _, metrics = _train_on_digits(
        tmp_path,
        "model/net=structure_net",
        "model.net.num_nodes=4",
        "model.net.cells_per_stage=1",
        "model.net.growth=4",
        "model.net.stem_channels=8",
    )
    assert all(math.isfinite(v) for v in metrics.values()) and "test/nll" in metrics


def test_trains_two_steps_and_predicts_on_digits_on_a_backbone(tmp_path):
    """The default network, WRN-28-10, made tiny: two steps, then the checkpoint's M members on
    digits test images."""
    from hydra.utils import instantiate

    from dbsn.runtime.build import load_method

    cfg, _ = _train_on_digits(tmp_path, "model.net.depth=10", "model.net.widen_factor=1", "test=false")
    method = load_method(tmp_path / "checkpoints" / "last.ckpt", num_classes=10).eval()
    data = instantiate(cfg.data)
    data.setup("test")
    images, targets = next(iter(data.test_dataloader()))
    with torch.no_grad():
        members = method.predict_members(data.preprocess(images[:16]))
    assert members.shape == (M, 16, 10) and torch.isfinite(members).all()
    torch.testing.assert_close(members.exp().sum(-1), torch.ones(M, 16))
