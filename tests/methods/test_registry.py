"""The method registry (dbsn.methods.registry): every config of conf/model/ with what its class
declares, in the report's order; a new config and class appear in compare and the report alone."""

from __future__ import annotations

import shutil

import pytest

import dbsn
from dbsn.methods import MAP
from dbsn.methods.registry import (
    METHOD_ORDER,
    REPORT_ORDER,
    field_backbones,
    method_config,
    method_configs,
    method_name,
    method_order,
)

# What each method is, as the hand-kept lists the registry replaced said it (compare's METHODS,
# STRUCTURE_SAMPLING, FIXED_MEMBERS, VOGN_METHODS' learning-rate key, the deep ensemble's members):
# (compared, samples structure, S fixed by the network, networks, where the weights' optimiser is)
EXPECTED = {
    "dbsn": (True, True, False, "cells", "optim"),
    "fbn": (True, True, False, "cells", "optim"),
    "map": (True, False, True, "any", "optim"),
    "map_fixed": (True, False, True, "any", "optim"),
    "mc_dropout": (True, False, False, "any", "optim"),
    "bbb": (True, False, False, "any", "optim"),
    "deep_ensemble": (True, False, True, "any", "member.optim"),
    "batch_ensemble": (True, False, True, "any", "optim"),
    "packed_ensemble": (True, False, True, "any", "optim"),
    "masksembles": (True, False, True, "any", "optim"),
    "mimo": (True, False, True, "any", "optim"),
    "sngp": (True, False, True, "any", "optim"),
    "ddu": (True, False, True, "any", "optim"),
    "rank1_bnn": (True, False, False, "any", "optim"),  # S draws of its factors
    "vogn": (True, False, False, "any", "vogn"),
    "vogn_fbn": (True, True, False, "cells", "vogn"),
    "nekfac": (False, False, False, "own", "nekfac"),  # defined on its own VGG16-BN
    "csghmc": (True, False, True, "any", "sampler"),  # S = the samples its chain kept
    "csgld": (True, False, True, "any", "sampler"),
    "csghmc_structure": (True, False, True, "cells", "optim"),  # the weights' SGD; its chains' sampler is its own
    "dbsn_seg": (False, True, False, "cells", "optim"),  # segmentation
    "fcdensenet67": (False, False, True, "any", "optim"),
    "fcdensenet67_mc_dropout": (False, False, False, "any", "optim"),
}


def test_every_config_of_conf_model_is_a_method_in_the_reports_order():
    names = sorted(path.stem for path in (dbsn.CONF_DIR / "model").glob("*.yaml"))
    assert set(REPORT_ORDER) <= set(names)  # the order names no config that is not there
    assert method_order() == (*REPORT_ORDER, *sorted(set(names) - set(REPORT_ORDER)))
    assert list(METHOD_ORDER) == list(method_order()) and METHOD_ORDER.index("fbn") == 1 and "sngp" in METHOD_ORDER
    assert len(METHOD_ORDER) == len(names) and METHOD_ORDER[-1] == method_order()[-1]


def test_each_method_is_what_its_class_and_config_declare():
    from dbsn.tools.compare import compared_methods

    assert {m.name for m in method_configs()} == set(EXPECTED)
    for m in method_configs():
        compared, structure, fixed, networks, optimizer = EXPECTED[m.name]
        assert (m.name in compared_methods(), m.samples_structure, m.fixed_members, m.networks, m.optimizer_key) == (
            compared,
            structure,
            fixed,
            networks,
            optimizer,
        ), m.name
        assert m.sgd == (optimizer not in ("vogn", "nekfac", "sampler")), m.name
    assert method_config("deep_ensemble").member.name == "map_fixed"  # its members' method
    assert method_config("vogn_fbn").cls.__name__ == "VOGNFBN" and method_config("vogn").cls.__name__ == "VOGNMAP"
    with pytest.raises(ValueError, match="unknown method 'mapp': conf/model/ has dbsn, fbn, map"):
        method_config("mapp")


def test_a_runs_model_node_is_named_by_the_config_that_builds_it():
    for m in method_configs():
        assert method_name(m.config) == m.name  # every config's own node
    on_fixed_alpha = {**method_config("mc_dropout").config, "learn_structure": False}
    assert method_name(on_fixed_alpha) == "mc_dropout"  # mc_dropout's documented variant, not map_fixed
    assert method_name({**method_config("map").config, "weights": {"_target_": "dbsn.methods.PointWeights"}}) == "map"
    assert method_name({**method_config("mimo").config, "learn_structure": False}) == "mimo"
    assert method_name({"_target_": "my.pkg.Laplace"}) == "Laplace" and method_name({}) == "?"


def test_the_field_backbones_are_the_backbone_networks_not_a_methods_own():
    assert field_backbones() == {"resnet18": "ResNet18", "wrn28_10": "WideResNet"}  # not NEK-FAC's VGG16-BN


class Mine(MAP):
    """A method added by a user: a MAP that draws weights of its own (declared, not implemented)."""

    samples_weights = True


def test_a_new_config_and_class_appear_in_compare_and_the_report_without_other_edits(tmp_path, monkeypatch, capsys):
    from dbsn.evaluation.report import build_report
    from dbsn.tools import compare
    from tests.support.fakeruns import write_run

    conf = tmp_path / "conf"
    shutil.copytree(dbsn.CONF_DIR, conf)
    (conf / "model" / "mine.yaml").write_text(f"defaults:\n  - map\n  - _self_\n\n_target_: {__name__}.Mine\n")
    assert method_order(conf)[len(REPORT_ORDER) :] == ("dbsn_seg", "fcdensenet67", "fcdensenet67_mc_dropout", "mine")
    mine = method_config("mine", conf)
    assert (mine.cls, mine.fixed_members, mine.networks) == (Mine, False, "any")  # its class's declarations

    monkeypatch.setattr(dbsn, "CONF_DIR", conf)  # the registry's conf/ (the configs compose from the real one)
    monkeypatch.setattr(dbsn.extensions, "DBSN_CONF_DIR", conf)  # where `config_dirs` finds dbsn's own
    assert compare.compared_methods()[-1] == "mine"
    calls = []
    monkeypatch.setattr(compare, "run_comparison", lambda methods, *args, **kwargs: calls.append(methods))
    compare.main(["--methods", "dbsn,mine"])
    assert calls == [["dbsn", "mine"]]
    with pytest.raises(SystemExit):
        compare.main(["--methods", "mien"])
    assert capsys.readouterr().err.strip().endswith(", vogn, vogn_fbn, mine")  # the choices
    assert "model.prediction.n_samples=7" in compare.method_overrides("mine", 10, 21, n_samples=7)  # S applies

    runs = tmp_path / "runs"
    for folder, model, error in (
        ("a", {"_target_": f"{__name__}.Mine", "learn_structure": True, "weights": None}, 0.05),
        ("b", {"_target_": "my.pkg.Zed"}, 0.07),
        ("c", {"_target_": "dbsn.methods.DBSN"}, 0.06),
    ):
        write_run(runs / folder, model, "dbsn.data.CIFAR10DataModule", 1, error)
    build_report([runs], tmp_path / "report")
    table = (tmp_path / "report" / "table1_error.md").read_text().splitlines()[4:]
    assert [line.split("|")[1].strip() for line in table] == ["dbsn", "mine", "Zed"]  # named by its config, in order
