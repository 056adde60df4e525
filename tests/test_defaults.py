"""Each default S is written once in Python (a method's `prediction_defaults`, `Prediction`'s own, a
post-hoc posterior's `n_samples` default); the configs of conf/model/ and conf/posthoc/ state the
run's value too (Hydra's override paths need the key), and here, composed by Hydra, they must
state the same one.
"""

from __future__ import annotations

import inspect

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from dbsn.methods import Prediction
from dbsn.methods.registry import built_class
from tests.support.configs import CONF, compose_config

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
POSTERIORS = sorted(p.stem for p in (CONF / "posthoc").glob("*.yaml"))


def test_the_default_prediction_config_states_predictions_own_s():
    node = OmegaConf.load(CONF / "model" / "prediction" / "default.yaml")
    assert get_class(node._target_) is Prediction
    assert (node.n_samples, node.val_samples) == (Prediction().n_samples, Prediction().val_samples) == (1, 1)


@pytest.mark.parametrize("name", MODELS)
def test_a_methods_config_states_its_classs_default_s(tmp_path, name):
    """A class with a default S of its own (DBSN, VOGN, NEK-FAC) and its configs agree; the other
    configs choose their S (MC dropout's 100, the rank-1 BNN's K x M), which only they write."""
    model = OmegaConf.to_container(compose_config("train", [f"model={name}"], tmp_path).model, resolve=False)
    defaults = built_class(model).prediction_defaults
    if defaults:
        assert model["prediction"]["n_samples"] == defaults["n_samples"], name


@pytest.mark.parametrize("name", POSTERIORS)
def test_a_posteriors_config_states_its_classs_default_s(tmp_path, name):
    posthoc = compose_config("evaluate", ["ckpt_path=x.ckpt", f"posthoc={name}"], tmp_path).posthoc
    default = inspect.signature(get_class(posthoc._target_)).parameters["n_samples"].default
    assert posthoc.n_samples == default, name
