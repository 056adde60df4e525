"""Run folders (dbsn.evaluation.runs): a run's method read from its resolved config, without Hydra."""

from __future__ import annotations

import pytest

from dbsn.evaluation.runs import infer_method


def test_method_inference_without_hydra():
    assert (
        infer_method({"_target_": "dbsn.methods.DBSN", "weights": {"_target_": "dbsn.methods.GaussianWeights"}})
        == "fbn"
    )
    assert (
        infer_method({"_target_": "dbsn.methods.DBSN", "weights": {"_target_": "dbsn.methods.PointWeights"}}) == "dbsn"
    )
    assert infer_method({"_target_": "dbsn.methods.MAP", "learn_structure": True, "weights": None}) == "map"
    assert infer_method({"_target_": "dbsn.methods.MAP", "learn_structure": False}) == "map_fixed"
    assert (
        infer_method(
            {
                "_target_": "dbsn.methods.MAP",
                "learn_structure": False,
                "weights": {"_target_": "dbsn.methods.weights.MCDropoutWeights"},
            }
        )
        == "mc_dropout"
    )
    assert (
        infer_method({"_target_": "dbsn.methods.MAP", "weights": {"_target_": "dbsn.methods.GaussianWeights"}}) == "bbb"
    )
    assert infer_method({"_target_": "dbsn.methods.DeepEnsemble", "member": {}}) == "deep_ensemble"
    assert infer_method({"_target_": "dbsn.methods.natgrad.VOGNMethod", "structure": "map"}) == "vogn"
    assert infer_method({"_target_": "dbsn.methods.natgrad.VOGNMethod", "structure": "dbsn"}) == "vogn_fbn"
    assert infer_method({"_target_": "dbsn.methods.natgrad.NEKFACMethod"}) == "nekfac"
    assert infer_method({"_target_": "my.pkg.Laplace"}) == "Laplace"


def test_a_run_on_a_field_backbone_carries_it_in_its_name(tmp_path):
    from dbsn.evaluation.runs import method_and_dataset

    data = {"_target_": "dbsn.data.CIFAR10DataModule"}
    on = {"_target_": "dbsn.methods.MIMO", "net": {"_target_": "dbsn.nets.WideResNet"}}
    assert method_and_dataset(tmp_path, {"model": on, "data": data}) == ("mimo@wrn28_10", "cifar10")
    cells = {"_target_": "dbsn.methods.MIMO", "net": {"_target_": "dbsn.nets.StructureNet"}}
    assert method_and_dataset(tmp_path, {"model": cells, "data": data}) == ("mimo", "cifar10")
    ensemble = {
        "_target_": "dbsn.methods.DeepEnsemble",
        "member": {"_target_": "dbsn.methods.MAP", "net": {"_target_": "dbsn.nets.ResNet18"}},
    }
    assert method_and_dataset(tmp_path, {"model": ensemble, "data": data}) == ("deep_ensemble@resnet18", "cifar10")
    (tmp_path / ".hydra").mkdir()  # Hydra's choices win over the config
    (tmp_path / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices:\n      model: batch_ensemble\n      model/net: resnet18\n      data: cifar100\n"
    )
    assert method_and_dataset(tmp_path, {"model": on, "data": data}) == ("batch_ensemble@resnet18", "cifar100")
    for cls, name in {"BatchEnsemble": "batch_ensemble", "PackedEnsemble": "packed_ensemble", "SNGP": "sngp"}.items():
        assert infer_method({"_target_": f"dbsn.methods.{cls}"}) == name


def test_wandb_facts_name_the_network_and_a_single_pass_ensembles_members(tmp_path):
    from dbsn.runtime.wandb_run import run_facts

    data = {"_target_": "dbsn.data.CIFAR10DataModule"}
    mimo = run_facts(
        {
            "model": {"_target_": "dbsn.methods.MIMO", "size": 3, "net": {"_target_": "dbsn.nets.WideResNet"}},
            "data": data,
        },
        tmp_path,
    )
    assert (mimo["method"], mimo["network"], mimo["S"]) == ("mimo@wrn28_10", "wrn28_10", 3)
    dbsn = run_facts(
        {
            "model": {
                "_target_": "dbsn.methods.DBSN",
                "prediction": {"n_samples": 100},
                "net": {"_target_": "dbsn.nets.StructureNet"},
            },
            "data": data,
        },
        tmp_path,
    )
    assert (dbsn["method"], dbsn["network"], dbsn["S"]) == ("dbsn", "StructureNet", 100)
    ensemble = run_facts(
        {
            "model": {
                "_target_": "dbsn.methods.DeepEnsemble",
                "size": 4,
                "member": {"_target_": "dbsn.methods.MAP", "net": {"_target_": "dbsn.nets.ResNet18"}},
            },
            "data": data,
        },
        tmp_path,
    )
    assert (ensemble["method"], ensemble["network"], ensemble["S"]) == ("deep_ensemble@resnet18", "resnet18", 4)


def test_a_cell_network_run_is_named_without_composing_every_methods_config(tmp_path, monkeypatch):
    """A run on the cell network (DBSN's, the common case) is named from Hydra's choices alone:
    composing conf/model/ for the field's backbones took 1.4 s of every train.py on a CPU. A
    residual network, a factory or an unknown network still asks the registry."""
    import functools
    import inspect

    from hydra.utils import get_object

    from dbsn.evaluation.runs import method_and_dataset
    from dbsn.methods import registry

    assert registry.builds_backbone("dbsn.nets.ResNet18") is True
    assert registry.builds_backbone("dbsn.nets.StructureNet") is False
    assert registry.builds_backbone("no.such.Network") is None
    factory = f"{__name__}.network_factory"
    assert inspect.isfunction(get_object(factory)) and registry.builds_backbone(factory) is None  # not known

    def composed(*args, **kwargs):
        raise AssertionError("composed every method's config")

    # fresh caches of the registry for this test alone (the suite's own stay as they are)
    monkeypatch.setattr(registry, "_registry", functools.cache(registry._registry.__wrapped__))
    monkeypatch.setattr(registry, "_backbones", functools.cache(registry._backbones.__wrapped__))
    monkeypatch.setattr(registry, "_model_configs", composed)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices:\n      model: dbsn\n      model/net: structure_net\n      data: digits\n"
    )
    cells = {"_target_": "dbsn.methods.DBSN", "net": {"_target_": "dbsn.nets.StructureNet"}}
    assert method_and_dataset(tmp_path, {"model": cells, "data": {}}) == ("dbsn", "digits")
    residual = {"_target_": "dbsn.methods.MAP", "net": {"_target_": "dbsn.nets.ResNet18"}}
    with pytest.raises(AssertionError, match="composed every method's config"):
        method_and_dataset(tmp_path, {"model": residual, "data": {}})


def test_every_methods_config_names_the_backbone_its_network_is():
    """For each method of conf/model/ on its own network and on each network of conf/model/net/:
    `backbone_of` (with its shortcut for networks with structure) gives the field backbone whose
    class the network is, and None for a network with structure or a method's own network."""
    from omegaconf import OmegaConf

    import dbsn
    from dbsn.evaluation.runs import backbone_of
    from dbsn.methods.registry import field_backbones, method_configs

    backbones = field_backbones()
    nets = {
        path.stem: OmegaConf.to_container(OmegaConf.load(path))
        for path in sorted((dbsn.CONF_DIR / "model" / "net").glob("*.yaml"))
    }
    assert {"resnet18", "wrn28_10"} <= set(backbones) and "structure_net" in nets
    checked = 0
    for method in method_configs():
        key = "member" if method.config.get("member") is not None else None
        node = method.config[key] if key else method.config
        if not isinstance(node.get("net"), dict):
            continue
        for net_name, net in [(None, node["net"]), *nets.items()]:
            model_node = {**node, "net": net}
            model = {**method.config, key: model_node} if key else model_node
            cls = net["_target_"].rsplit(".", 1)[-1]
            expected = next((name for name, c in backbones.items() if c == cls), None)
            assert backbone_of(model) == expected, (method.name, net_name)
            if net_name is not None:
                choice = "model/net@model.member.net" if key else "model/net"
                assert backbone_of(model, {choice: net_name}) == expected, (method.name, net_name)
            checked += 1
    assert checked > 50


def network_factory(num_classes: int = 10):
    """A network's `_target_` that is a function, not a class."""
    from dbsn.nets import ResNet18

    return ResNet18(num_classes=num_classes)
