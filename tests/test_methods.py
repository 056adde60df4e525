"""Every method trains through train()'s code path and evaluates through evaluate()'s."""

from __future__ import annotations

import json

import pytest
import torch
from configs import compose_config, tiny_for
from fakedata import write_cifar10

from dbsn.methods import MAP, MCDropoutWeights, Prediction
from dbsn.nets import StructureNet
from dbsn.runtime.run import evaluate, train

METHODS = ["dbsn", "fbn", "map", "map_fixed", "mc_dropout", "bbb"]


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    write_cifar10(root, n_train=128, n_test=32, seed=1)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_trains_and_evaluates(method, cifar_root, tmp_path):
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    overrides = [f"model={method}", "data=cifar10", f"data.root={cifar_root}", "data.batch_size=32",
                 "data.num_workers=0", *tiny_for(method), "trainer.max_epochs=2"]
    metrics = train(compose_config("train", overrides, run_dir), run_dir)
    assert set(metrics) >= {"test/error", "test/nll", "test/brier", "test/ece"}

    cfg = compose_config("evaluate", [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
                                      "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"], eval_dir)
    again = evaluate(cfg, eval_dir)  # rebuilt from the checkpoint alone
    record = json.loads((run_dir / "evaluation" / "metrics.json").read_text())  # next to the run
    assert record["metrics"] == again
    if method in ("map", "map_fixed"):  # deterministic: the same numbers again
        assert again["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-5)
    else:  # stochastic at test time (dropout stays on through Lightning's eval hooks, too)
        assert again["test/nll"] != pytest.approx(metrics["test/nll"], rel=1e-7)


def _dropout_net(p=0.2, test_time=True, placement="node_outputs"):
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    return MAP(net, weights=MCDropoutWeights(p=p, test_time=test_time, placement=placement), learn_structure=False,
               prediction=Prediction(n_samples=5, samples_per_forward=5), dataset_size=10)


def test_mc_dropout_inserts_dropout_after_every_convolution():
    method = _dropout_net(placement="every_conv")
    convs = [m for m in method.net.modules() if isinstance(m, torch.nn.Conv2d)]
    dropouts = [m for m in method.net.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(convs) == len(dropouts) > 10
    for m in method.net.modules():
        if isinstance(m, torch.nn.Sequential) and len(m) == 2 and isinstance(m[0], torch.nn.Conv2d):
            assert isinstance(m[1], torch.nn.Dropout) and m[1].p == 0.2


def test_mc_dropout_is_stochastic_at_test_and_deterministic_without_it():
    x = torch.randn(3, 3, 16, 16)
    method = _dropout_net()
    method.eval()
    method.weights.enable_test_noise(method.net)  # what on_test_model_eval adds to eval()
    with torch.no_grad():
        members = method.stochastic_forward(x, 5)
        assert not torch.allclose(members[0], members[1])  # each member its own masks
        assert not torch.allclose(method.predict_log_probs(x), method.predict_log_probs(x))

    method = _dropout_net(test_time=False)
    assert not method.is_stochastic
    method.eval()
    method.weights.enable_test_noise(method.net)
    with torch.no_grad():
        first, second = method.predict_log_probs(x), method.predict_log_probs(x)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_deterministic_methods_predict_with_one_pass():
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = MAP(net, learn_structure=True, prediction=Prediction(n_samples=100), dataset_size=10).eval()
    calls = []
    original = method.stochastic_forward
    method.stochastic_forward = lambda x, n, first=0: calls.append(n) or original(x, n, first)
    with torch.no_grad():
        method.predict_log_probs(torch.randn(2, 3, 16, 16))
    assert calls == [1]


def test_map_fixed_alpha_is_uniform_and_not_trained():
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = MAP(net, learn_structure=False, dataset_size=10)
    assert torch.allclose(method.alpha(), torch.full((3, 4), 0.25))
    assert method.structure_parameters() == []
    assert not hasattr(method, "theta") and len(list(method.parameters())) == len(list(net.parameters()))


def _digits_overrides(*extra):
    return ["model=map_fixed", "data=digits", "data.batch_size=128", *tiny_for("map_fixed"), "trainer.max_epochs=1",
            "model.prediction.temperature_scaling=true", *extra]


def test_temperature_scaling_refuses_without_a_validation_split(tmp_path):
    from dbsn.methods.temperature import NoValidationSplitError

    cfg = compose_config("train", _digits_overrides("data.val_size=0"), tmp_path)
    with pytest.raises(NoValidationSplitError, match="val_size"):
        train(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # refused before any training


@pytest.mark.slow
def test_temperature_scaling_fits_on_validation_and_is_reloaded(tmp_path, monkeypatch):
    from dbsn.data import DigitsDataModule

    test_batches = []
    original = DigitsDataModule.test_dataloader
    monkeypatch.setattr(DigitsDataModule, "test_dataloader", lambda self: test_batches.append(1) or original(self))
    cfg = compose_config("train", _digits_overrides("data.val_size=200"), tmp_path)
    metrics = train(cfg, tmp_path)
    assert len(test_batches) == 1  # the test split was only touched by the final test
    state = torch.load(tmp_path / "checkpoints" / "calibrated.ckpt", weights_only=False)["state_dict"]
    temperature = float(state["temperature.log_temperature"].exp())
    assert temperature != pytest.approx(1.0, abs=1e-3)

    eval_dir = tmp_path / "eval"
    cfg = compose_config("evaluate", [f"ckpt_path={tmp_path / 'checkpoints' / 'calibrated.ckpt'}",
                                      "trainer.accelerator=cpu"], eval_dir)
    assert evaluate(cfg, eval_dir)["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-5)


def test_mc_dropout_existing_placement_reuses_the_networks_dropout_layers():
    from torch import nn

    from dbsn.methods import MCDropoutWeights

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5), nn.Conv2d(4, 4, 3))
    prepared = MCDropoutWeights(p=0.2, placement="existing").prepare(net)
    dropouts = [m for m in prepared.modules() if isinstance(m, nn.Dropout)]
    assert len(dropouts) == 1 and dropouts[0].p == 0.2  # none inserted, the rate set
    with pytest.raises(ValueError, match="no dropout layers"):
        MCDropoutWeights(placement="existing").prepare(nn.Sequential(nn.Conv2d(3, 4, 3)))
    with pytest.raises(ValueError, match="placement"):
        MCDropoutWeights(placement="nodes")


def test_mc_dropout_node_outputs_placement_puts_dropout_on_every_cell():
    from torch import nn

    from dbsn.methods import MCDropoutWeights
    from dbsn.nets import Cell, StructureNet

    torch.manual_seed(0)
    net = StructureNet(5, num_nodes=3, cells_per_stage=2, growth=4, stem_channels=8)
    weights = MCDropoutWeights(p=0.3, placement="node_outputs")
    weights.prepare(net)
    cells = [m for m in net.modules() if isinstance(m, Cell)]
    dropouts = [m for m in net.modules() if isinstance(m, nn.Dropout)]
    assert len(cells) == 6 and all(isinstance(c.node_output, nn.Dropout) and c.node_output.p == 0.3 for c in cells)
    assert len(dropouts) == 6  # nothing after the convolutions
    x, alpha = torch.randn(4, 3, 16, 16), torch.full((1, net.num_edges, net.num_ops), 1 / net.num_ops)
    net.eval()
    with torch.no_grad():
        deterministic = net(x, alpha)
        weights.enable_test_noise(net)  # MC dropout: kept on at test time
        assert not torch.allclose(net(x, alpha), deterministic)
    with pytest.raises(ValueError, match="no cells"):
        MCDropoutWeights(placement="node_outputs").prepare(nn.Sequential(nn.Conv2d(3, 4, 3)))


def _small(model: str, *extra: str) -> list[str]:
    """`model=...` on a small network: 3 nodes and 3 cells (NEK-FAC: VGG16-BN at width 0.25)."""
    if model == "nekfac":
        return [f"model={model}", "model.net.width=0.25", *extra]
    prefix = "model.member.net" if model == "deep_ensemble" else "model.net"
    return [f"model={model}", f"{prefix}.num_nodes=3", f"{prefix}.cells_per_stage=1", *extra]


def _configured_optimizers(model_cfg):
    """The method and what its configure_optimizers returns, under a stand-in trainer."""
    from types import SimpleNamespace

    from dbsn.runtime.build import build_model

    method = build_model(model_cfg, num_classes=10)
    method.dataset_size = 100  # read from the data module in on_fit_start (natgrad: in configure_optimizers)
    method._trainer = SimpleNamespace(max_epochs=4, world_size=1, precision="32-true", datamodule=None)
    optimizers, schedules = method.configure_optimizers()
    return method, optimizers, schedules


@pytest.mark.parametrize("model, extra", [
    ("bbb", []), ("fbn", []), ("map", []), ("mc_dropout", []),
    ("deep_ensemble", ["model/member=bbb", "model.size=2"]),
])
def test_sgd_decays_every_weight_but_the_gaussian_scales(model, extra, tmp_path):
    """Weight decay on ρ (1e-4) would outweigh the KL's gradient ~25,000-fold and set σ: ρ is
    in a group without decay; μ and point weights keep the configured decay; one group each."""
    cfg = compose_config("train", _small(model, *extra), tmp_path)
    decay = (cfg.model.member if model == "deep_ensemble" else cfg.model).optim.weight_decay
    method, optimizers, schedules = _configured_optimizers(cfg.model)
    assert len(schedules) == (2 if model == "deep_ensemble" else 1)  # one SGD per network, as before
    group_of = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                assert id(p) not in group_of, "a parameter in two param groups"
                group_of[id(p)] = group
    named = [(n, p) for n, p in method.named_parameters() if p.requires_grad]
    assert {id(p) for _, p in named} == set(group_of)
    rho = [n for n, _ in named if n.endswith("_rho")]
    assert bool(rho) == (model in ("bbb", "fbn", "deep_ensemble"))
    assert bool(rho) == any(n.endswith("_mu") for n, _ in named)
    for name, p in named:
        if name.endswith("_rho"):
            assert group_of[id(p)]["weight_decay"] == 0, name
        elif not name.endswith("theta"):  # θ: Adam, without decay
            assert group_of[id(p)]["weight_decay"] == decay, name
    for opt in optimizers[: len(schedules)]:  # clipping and the lr schedule act per optimiser
        assert isinstance(opt, torch.optim.SGD) and len(opt.param_groups) == (2 if rho else 1)


@pytest.mark.parametrize("model", ["vogn", "nekfac"])
def test_natural_gradient_methods_keep_their_own_optimiser(model, tmp_path):
    from dbsn.natgrad import NEKFAC, VOGN

    method, optimizers, schedules = _configured_optimizers(compose_config("train", _small(model), tmp_path).model)
    assert method.no_decay_parameters() == []
    assert isinstance(optimizers[0], VOGN if model == "vogn" else NEKFAC) and len(schedules) == 1
    assert not any(isinstance(opt, torch.optim.SGD) for opt in optimizers)
    held = [id(p) for g in optimizers[0].param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in method.net.parameters())


def _dropout_calls(method, x):
    """Dropout modules of the network and how often each ran in one forward of x."""
    calls = {}
    dropouts = [m for m in method.net.modules() if isinstance(m, torch.nn.Dropout)]
    hooks = [m.register_forward_hook(lambda m, i, o: calls.__setitem__(m, calls.get(m, 0) + 1)) for m in dropouts]
    with torch.no_grad():
        method.net(x, method.prediction_structures(1))
    for h in hooks:
        h.remove()
    return dropouts, calls


def test_mc_dropout_default_is_map_with_dropout_on_every_node_output(tmp_path):
    """The research code's baseline, which produced the paper's numbers: learned θ, dropout on
    each node's output (once per node and cell), none inside the ops."""
    from dbsn.nets import Cell
    from dbsn.runtime.build import build_model

    cfg = compose_config("train", _small("mc_dropout"), tmp_path)
    method = build_model(cfg.model, num_classes=10)
    assert method.learn_structure and method.structure_parameters() == [method.theta] and method.is_stochastic
    cells = [m for m in method.net.modules() if isinstance(m, Cell)]
    dropouts, calls = _dropout_calls(method, torch.randn(2, 3, 16, 16))
    assert len(cells) == 3 and {id(d) for d in dropouts} == {id(c.node_output) for c in cells}
    assert all(d.p == 0.2 for d in dropouts)
    assert [calls[c.node_output] for c in cells] == [c.num_nodes for c in cells] == [3, 3, 3]

    # the paper's text: after every convolution, four times inside each separable op
    method = build_model(compose_config("train", _small("mc_dropout", "model.weights.placement=every_conv"),
                                        tmp_path).model, num_classes=10)
    convs = [m for m in method.net.modules() if isinstance(m, torch.nn.Conv2d)]
    dropouts = [m for m in method.net.modules() if isinstance(m, torch.nn.Dropout)]
    wrapped = [m for m in method.net.modules() if isinstance(m, torch.nn.Sequential) and len(m) == 2
               and isinstance(m[0], torch.nn.Conv2d) and isinstance(m[1], torch.nn.Dropout)]
    assert len(convs) == len(dropouts) == len(wrapped) > 10 and method.learn_structure
    assert all(isinstance(c.node_output, torch.nn.Identity) for c in method.net.modules() if isinstance(c, Cell))
    # the segmentation baseline keeps the FC-DenseNet's own dropout layers
    assert compose_config("train", ["model=fcdensenet67_mc_dropout"], tmp_path).model.weights.placement == "existing"
