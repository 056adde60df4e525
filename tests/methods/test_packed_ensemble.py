"""Packed-Ensembles (dbsn.nets.packed, dbsn.methods.PackedEnsemble): one member without
subgroups is the plain network; with M members each is a narrow network of its own weights; the
packed ResNet-18 and WideResNet-28-10 have the authors' parameter counts; the method trains two
steps and predicts on digits on DBSN's cell network and on ResNet-18."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dbsn.methods import MAP, PackedEnsemble
from dbsn.nets import VGG16BN
from dbsn.nets.fused_cell import unfuse
from dbsn.nets.packed import PackedLinear, pack
from dbsn.nets.resnet import ResNet18
from dbsn.nets.wideresnet import WideResNet
from dbsn.runtime.build import build_model
from dbsn.runtime.config import validate_config
from tests.support.configs import compose_config
from tests.support.fakedata import normalised_digits
from tests.support.netutil import set_random_affine, soft_alpha, tiny_structure_net
from tests.support.steputil import assert_same, prediction, step_state

TINY = {
    "resnet18": lambda: ResNet18(10, width=4),
    "vgg16_bn": lambda: VGG16BN(10, width=0.25),
    "structure_net": tiny_structure_net,
}


def _structure(net, groups: int = 1) -> torch.Tensor:
    """A soft structure for the cell network, (groups, 0, 0) for a backbone."""
    return soft_alpha(groups, net) if net.num_edges else torch.zeros(groups, 0, 0)


def _member(state: dict[str, torch.Tensor], m: int, size: int) -> dict[str, torch.Tensor]:
    """Member m's weights in a packed network's state: the m-th of `size` blocks of every tensor's
    first dimension (output channels, BatchNorm channels, the head's rows)."""
    return {k: v if v.dim() == 0 else v.chunk(size)[m] for k, v in state.items()}


@pytest.mark.parametrize("kind", list(TINY))
def test_one_member_without_subgroups_is_the_plain_network(kind):
    torch.manual_seed(0)
    plain = MAP(unfuse(TINY[kind]()), dataset_size=100)  # packing runs every edge's own layers
    set_random_affine(plain)
    packed = PackedEnsemble(TINY[kind](), size=1, alpha=1, gamma=1, dataset_size=100)
    assert isinstance(packed.net.classifier, PackedLinear)
    packed.load_state_dict(plain.state_dict())  # the same shapes, names and weights
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    kinds = assert_same(step_state(plain, x, y), step_state(packed, x, y), rtol=1e-5, atol=1e-6)
    assert kinds["weight gradients"] == sum(1 for p in plain.parameters() if p.numel()) - (kind == "structure_net")
    torch.testing.assert_close(prediction(packed, x, 1), prediction(plain, x, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["resnet18", "structure_net"])
def test_each_member_is_a_narrow_network_of_its_own_weights(kind):
    """α = M = 2, γ = 2: member m is the plain network (α·c / M = c channels) with γ = 2 subgroups,
    whose weights are the m-th block of every packed tensor (the cells' member-wise split and
    concatenation included); its output depends on no other weights."""
    torch.manual_seed(0)
    packed = pack(TINY[kind](), 2, 2, 2, min_channels_per_group=1)
    set_random_affine(packed)
    assert any(m.groups == 4 for m in packed.modules() if isinstance(m, nn.Conv2d))  # M·γ groups
    alpha, x = _structure(packed), torch.randn(6, 3, 32, 32)
    logits = packed(x, alpha).view(6, 2, 10)
    for m in range(2):
        narrow = pack(TINY[kind](), 1, 2, 1, min_channels_per_group=1)
        narrow.load_state_dict(_member(packed.state_dict(), m, 2))
        torch.testing.assert_close(narrow(x, alpha), logits[:, m], rtol=1e-5, atol=1e-5)

    logits[:, 1].sum().backward()  # member 1 alone: no gradient reaches member 0's weights
    for name, p in packed.named_parameters():
        other, own = p.grad.chunk(2)
        assert torch.count_nonzero(other) == 0, name
        assert torch.count_nonzero(own) > 0, name


def test_packed_resnet18_and_wrn28_10_have_the_authors_parameter_counts():
    """torch-uncertainty 0.13.0 builds packed_resnet(arch=18, style="cifar", alpha=2, gamma=2,
    num_estimators=4) with 8,175,784 parameters and packed_wideresnet28x10(style="cifar",
    conv_bias=False) with 19,352,008: γ = 2 only where a group keeps 64 input channels, never in
    a ResNet block's first convolution; the head 1024 -> 40 in 4 groups."""

    def count(net: nn.Module) -> int:
        return sum(p.numel() for p in net.parameters())

    assert count(pack(ResNet18(10), 1, 1, 1)) == 11_173_962  # the plain ResNet-18
    resnet = pack(ResNet18(10), 2, 2, 4)
    assert count(resnet) == 8_175_784
    subgrouped = {name for name, m in resnet.named_modules() if isinstance(m, nn.Conv2d) and m.groups == 8}
    assert subgrouped == {"layer3.0.conv2", "layer3.1.conv2", "layer4.0.conv2", "layer4.0.shortcut.0", "layer4.1.conv2"}
    assert (resnet.conv1.in_channels, resnet.conv1.out_channels, resnet.conv1.groups) == (3, 128, 1)
    assert (resnet.classifier.in_features, resnet.classifier.out_features, resnet.classifier.groups) == (1024, 40, 4)
    assert count(pack(WideResNet(10), 2, 2, 4)) == 19_352_008


def test_what_the_members_cannot_share_is_refused_in_one_line():
    cases = [
        (
            lambda: pack(ResNet18(10, width=4), 1, 1, 3),
            "conv1 has 4 channels, and alpha = 1 times that (4) is not a whole number divisible by the M = 3 members",
        ),
        (lambda: pack(ResNet18(10, width=4), 1.3, 1, 1), "alpha = 1.3 times that (5.2)"),
        (lambda: pack(nn.Sequential(nn.Conv2d(3, 4, 3)), 2, 1, 2), "needs the network's head `classifier`"),
        (lambda: pack(_WithGroupNorm(), 2, 1, 2), "norm of _WithGroupNorm is a GroupNorm"),
    ]
    for build, phrase in cases:
        with pytest.raises(ValueError) as refused:
            build()
        assert phrase in str(refused.value) and "\n" not in str(refused.value)


class _WithGroupNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.classifier = nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4, 10)


@pytest.fixture(scope="module")
def digits():
    """32 digits, normalised as the data module does."""
    return normalised_digits(32)


NETS = {  # widths that α = 2 and M = 4 divide; cells: num_nodes=4, cells_per_stage=1
    "structure_net": [
        "model/net=structure_net",
        "model.net.num_nodes=4",
        "model.net.cells_per_stage=1",
        "model.net.growth=4",
        "model.net.stem_channels=8",
        "model.net.compression=0.5",
    ],
    "resnet18": ["model/net=resnet18", "model.net.width=4"],
}


@pytest.mark.parametrize("net", list(NETS))
def test_trains_two_steps_and_predicts_its_members_on_digits(net, digits, tmp_path):
    cfg = compose_config(
        "train",
        ["data=digits", "trainer.accelerator=cpu", "model=packed_ensemble", *NETS[net], "model.dataset_size=32"],
        tmp_path,
    )
    validate_config(cfg)
    torch.manual_seed(0)
    method = build_model(cfg.model, num_classes=10)
    assert isinstance(method, PackedEnsemble) and (method.size, method.width_factor, method.subgroups) == (4, 2, 2)
    before = [p.detach().clone() for p in method.parameters()]

    x, y = digits
    method.train()
    logits = method.net(x[:8], method.prediction_structures(1)[:1])  # (b, M·C): member m's at columns m·C ...
    out = method.training_loss(x[:8], y[:8])  # rows i·M + m; the members' mean NLL
    members_nll = [F.cross_entropy(logits[:, 10 * m : 10 * (m + 1)], y[:8]) for m in range(4)]
    torch.testing.assert_close(out["nll"], torch.stack(members_nll).mean(), rtol=1e-5, atol=1e-6)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(method, DataLoader(TensorDataset(x, y), batch_size=16))
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, method.parameters()))

    members = prediction(method, x[:8], method.num_members)
    assert method.num_members == 4 and members.shape == (4, 8, 10) and torch.isfinite(members).all()
    with torch.inference_mode():
        logits = method.net(x[:8], method.prediction_structures(1)[:1]).view(8, 4, 10)
    torch.testing.assert_close(members, logits.log_softmax(-1).transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(members[0], members[1])
    torch.testing.assert_close(members.exp().sum(-1), torch.ones(4, 8))
