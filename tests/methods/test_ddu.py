"""DDU (dbsn.methods.ddu): every hidden layer of the network spectrally normalised with the coefficient and the
backbone's ReLUs leaky, the head left linear; two training steps and one deterministic softmax pass on digits;
train.py then evaluate.py on digits with the GDA density among the OOD scores (and the whole evaluation suite,
slow); the registry, compare and the field know it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dbsn.methods import DDU, MAP
from dbsn.nets import ResNet18, WideResNet
from dbsn.nets.spectral import spectrally_normalized_layers
from tests.support.configs import ROOT, compose_config, evaluate_quietly, evaluate_the_whole_suite
from tests.support.netutil import tiny_structure_net
from tests.support.scripts import run_python

NETS = {"resnet18": lambda: ResNet18(10, width=8), "wrn": lambda: WideResNet(10, depth=10, widen_factor=1)}


def _digits(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    from dbsn.data.digits import DigitsDataModule, digits_splits

    (images, labels), _ = digits_splits()
    mean, std = torch.tensor(DigitsDataModule.mean), torch.tensor(DigitsDataModule.std)
    return (images[:n].float() / 255 - mean[:, None, None]) / std[:, None, None], labels[:n]


@pytest.mark.parametrize("net", NETS)
def test_the_network_is_spectrally_normalised_with_leaky_relus_and_a_linear_head(net):
    plain = NETS[net]()
    relus = sum(type(m) is nn.ReLU for m in plain.modules())
    torch.manual_seed(0)
    method = DDU(NETS[net](), spectral_bound=3.0, dataset_size=64)
    layers = spectrally_normalized_layers(method.net)
    assert sorted(layers) == sorted(
        name for name, m in method.net.named_modules() if isinstance(m, nn.Conv2d)
    )  # every convolution, not the head
    assert {layer.parametrizations.weight[0].bound for layer in layers.values()} == {3.0}
    assert type(method.net.classifier) is nn.Linear and method.member_heads(1) is not None
    leaky = [m for m in method.net.modules() if isinstance(m, nn.LeakyReLU)]
    assert relus > 0 and len(leaky) == relus and {m.negative_slope for m in leaky} == {0.01}
    assert not any(type(m) is nn.ReLU for m in method.net.modules())
    x, _ = _digits(8)
    with torch.no_grad():
        _, features = method.eval().member_outputs(x, 1)
    assert (features < 0).any()  # a leaky ReLU lets negative features through (a ReLU network's are >= 0)
    kept = DDU(NETS[net](), leaky_relu_slope=None, dataset_size=64)
    assert sum(type(m) is nn.ReLU for m in kept.net.modules()) == relus


def test_the_cell_network_keeps_its_relus_and_a_non_linear_head_is_refused():
    """The fused cells apply their ReLUs inside their kernels: swapping the modules would change the stem
    only, so the cell network keeps them (and is spectrally normalised all the same)."""
    plain = tiny_structure_net()
    relus = sum(type(m) is nn.ReLU for m in plain.modules())
    method = DDU(tiny_structure_net(), dataset_size=64)
    assert sum(type(m) is nn.ReLU for m in method.net.modules()) == relus and spectrally_normalized_layers(method.net)
    net = ResNet18(10, width=8)
    net.classifier = nn.Sequential(nn.Linear(64, 10))
    with pytest.raises(
        ValueError, match="DDU reads the features at the network's last layer 'classifier', an nn.Linear"
    ):
        DDU(net)
    with pytest.raises(ValueError, match="leaky_relu_slope must be >= 0"):
        DDU(ResNet18(10, width=8), leaky_relu_slope=-0.1)


def test_two_steps_then_one_deterministic_softmax_pass():
    torch.manual_seed(0)
    method = DDU(ResNet18(10, width=8), dataset_size=64)
    assert isinstance(method, MAP) and not method.is_stochastic and method.num_members == 1
    x, y = _digits()
    sgd, _ = method.optim.build(method.weight_parameters(), 10, method.no_decay_parameters())
    before = [p.detach().clone() for p in method.parameters()]
    method.train()
    for _ in range(2):
        sgd.zero_grad()
        method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
        sgd.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, method.parameters()))
    method.eval()
    with torch.no_grad():
        members = method.predict_members(x[:8])
        logits = method.net(x[:8], method.alpha().unsqueeze(0))
    assert members.shape == (1, 8, 10)
    torch.testing.assert_close(members[0], torch.log_softmax(logits, -1))  # the softmax of one pass
    with torch.no_grad():
        torch.testing.assert_close(method.predict_members(x[:8]), members)  # deterministic


COMMON = [
    "model=ddu",
    "model/net=resnet18",
    "model.net.width=8",
    "data=digits",
    "data.batch_size=32",
    "data.num_workers=0",
    "data.train_subset=200",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=3",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "statistics.resamples=100",
]


def test_train_then_evaluate_with_its_density_among_the_ood_scores(tmp_path):
    """train.py for three steps, evaluate.py on the checkpoint: the test pass predicts what the run's did,
    and the OOD evaluation's default scores include the GDA density, fitted on the training split."""
    from dbsn.runtime.run import train

    run = tmp_path / "run"
    metrics = train(compose_config("train", COMMON, run), run)
    results = evaluate_quietly(
        run / "checkpoints" / "last.ckpt",
        tmp_path / "eval",
        ["statistics.resamples=100", "evaluations=[ood]", "ood=noise", "ood.noise.size=32", "ablation.sizes=[]"],
    )
    assert results["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-6)
    for score in ("entropy", "gda", "mahalanobis"):
        assert 0 <= results[f"ood/noise/{score}/auroc"] <= 1, score
    assert results["test/mutual_information"] == 0  # one network: no epistemic part in the softmax


@pytest.mark.slow
def test_the_evaluation_suite_runs_on_it(tmp_path):
    """evaluate.py's OOD detection with every score, its GDA density among them, dataset shift on generated
    corruptions, conformal sets and the adversarial attacks."""
    from dbsn.runtime.run import train

    run = tmp_path / "run"
    train(compose_config("train", COMMON, run), run)
    results = evaluate_the_whole_suite(run / "checkpoints" / "last.ckpt", tmp_path / "eval", tmp_path)
    for ood in ("photos", "noise"):  # the density DDU is about, on both sets
        assert 0 <= results[f"ood/{ood}/gda/auroc"] <= 1 + 1e-6, ood


def test_the_registry_compare_and_the_field_know_it(tmp_path):
    from dbsn.methods.registry import REPORT_ORDER, method_config
    from dbsn.runtime.config import validate_config
    from dbsn.tools.compare import compared_methods, method_overrides, shared_overrides

    entry = method_config("ddu")
    assert entry.cls is DDU and entry.fixed_members and entry.networks == "any" and entry.sgd
    assert REPORT_ORDER.index("ddu") == REPORT_ORDER.index("sngp") + 1
    assert "ddu" in compared_methods()
    own = compose_config("train", ["model=ddu"], tmp_path).model
    for backbone in ("structure_net", "resnet18"):
        cfg = compose_config(
            "train", [*method_overrides("ddu", 10, 21, backbone=backbone), *shared_overrides()], tmp_path
        )
        validate_config(cfg)
        assert list(cfg.model.optim.milestones) == [0.5, 0.75]  # the fair protocol's schedule shape
        for key in ("lr", "momentum", "nesterov", "weight_decay", "grad_clip_norm"):
            assert cfg.model.optim[key] == own.optim[key], key  # and the authors' relative settings
        assert (cfg.model.spectral_bound, cfg.model.leaky_relu_slope) == (3.0, 0.01)
        torch.manual_seed(0)
        from dbsn.runtime.build import build_model

        assert type(build_model(cfg.model, num_classes=10)) is DDU
    result = run_python(
        ROOT / "train.py",
        "experiment=cifar10_field",
        "field=resnet18/ddu",
        "seed=1",
        "--cfg",
        "job",
        cwd=tmp_path,
        timeout=120,
    )
    assert "_target_: dbsn.methods.DDU" in result.stdout and "_target_: dbsn.nets.ResNet18" in result.stdout
    assert "max_epochs: 350" in result.stdout and "seed: 1" in result.stdout and "spectral_bound: 3.0" in result.stdout
