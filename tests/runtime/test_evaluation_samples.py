"""S, the members of the evaluated model's Bayes ensemble, resolved once per evaluation
(`dbsn.runtime.evaluation.evaluation_samples`) and given as it is: to the model
(`Method.use_samples`: a DBSN, every member of an ensemble) or to the post-hoc posterior (its
`check`, then `fit_posterior`). `evaluate.py n_samples=` wins, then the posterior's own, then the
trained method's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dbsn.data.digits import DigitsDataModule
from dbsn.methods import DBSN, MAP, DeepEnsemble, Prediction
from dbsn.methods.weights import MCDropoutWeights
from dbsn.posthoc.base import PosthocError
from dbsn.posthoc.swag import STATE_KEY, SWAGCollector
from dbsn.runtime.config import ConfigError
from dbsn.runtime.evaluation import build_posterior, check_prediction_overrides, evaluation_samples, fit_posterior
from tests.support.configs import compose_config
from tests.support.netutil import tiny_structure_net

CPU = torch.device("cpu")


def _resolved(tmp_path, *overrides):
    """S and the posterior of `evaluate.py ckpt_path=x.ckpt *overrides`, as the runtime resolves them."""
    cfg = compose_config("evaluate", ["ckpt_path=x.ckpt", *overrides], tmp_path)
    posterior = build_posterior(cfg)
    check_prediction_overrides(cfg)
    return evaluation_samples(cfg, posterior), posterior


def _dbsn(n_samples: int) -> DBSN:
    return DBSN(tiny_structure_net(), dataset_size=64, prediction=Prediction(n_samples=n_samples)).eval()


def _mc_dropout(n_samples: int) -> MAP:
    return MAP(tiny_structure_net(), weights=MCDropoutWeights(), prediction=Prediction(n_samples=n_samples)).eval()


def _map() -> MAP:
    torch.manual_seed(0)
    return MAP(tiny_structure_net(), learn_structure=False, dataset_size=64).eval()


def _swag_checkpoint(method: MAP) -> dict:
    """A checkpoint with three SWAG snapshots around the method's weights (left as they were)."""
    collector = SWAGCollector(start=0, max_rank=3)
    method = copy.deepcopy(method)
    for spread in (0.0, 0.05, -0.03):
        with torch.no_grad():
            for p in method.net.parameters():
                p.add_(spread)
        collector.collect_from(method)
    return {"callbacks": {STATE_KEY: collector.state_dict()}}


def _digits() -> DigitsDataModule:
    return DigitsDataModule(num_workers=0, train_subset=64, val_size=32, batch_size=32, eval_batch_size=64)


def test_n_samples_reaches_a_dbsn_and_every_member_of_an_ensemble(tmp_path):
    n_samples, posterior = _resolved(tmp_path, "n_samples=7")
    assert (n_samples, posterior) == (7, None)
    dbsn = _dbsn(3)
    ensemble = DeepEnsemble([_mc_dropout(3), _mc_dropout(5)]).eval()  # evaluate.py ckpt_path=[run1,run2]
    for model in (dbsn, ensemble):
        model.use_samples(n_samples)
    assert dbsn.num_members == 7 and [m.num_members for m in ensemble.members] == [7, 7]
    with torch.no_grad():
        assert dbsn.predict_members(torch.randn(2, 3, 32, 32)).shape == (7, 2, 10)

    with pytest.raises(
        ConfigError,
        match=r"^n_samples must be >= 1 \(or null: the posterior's or the run's own S\), "
        r"got 0.$",
    ):
        _resolved(tmp_path, "n_samples=0")

    own, _ = _resolved(tmp_path)  # no n_samples=: each keeps its own
    assert own is None
    ensemble = DeepEnsemble([_mc_dropout(3), _mc_dropout(5)])
    ensemble.use_samples(own)
    assert [m.num_members for m in ensemble.members] == [3, 5]


@pytest.mark.parametrize("overrides, expected", [(["n_samples=7"], 7), ([], 30)])  # 30: conf/posthoc/<name>.yaml
def test_swag_and_laplace_draw_n_samples_members_else_their_own(tmp_path, overrides, expected):
    method, dm = _map(), _digits()
    checkpoint = _swag_checkpoint(method)
    for name, settings in (("swag", []), ("laplace", ["posthoc.hessian=diag", "posthoc.prior_precision=1.0"])):
        n_samples, posterior = _resolved(tmp_path, f"posthoc={name}", *settings, *overrides)
        assert n_samples == expected
        posterior.check(method, dm, checkpoint, n_samples)
        fitted = fit_posterior(posterior, copy.deepcopy(method), dm, checkpoint, n_samples, CPU)
        assert fitted.n_samples == fitted.num_members == expected
    assert fitted.member_weights.shape[0] == expected  # Laplace's last layers: drawn for exactly S


def test_a_posterior_that_draws_members_refuses_no_s_in_its_check(tmp_path):
    method = _map()
    for name in ("swag", "laplace"):
        n_samples, posterior = _resolved(tmp_path, f"posthoc={name}", "posthoc.n_samples=null")
        assert n_samples is None
        with pytest.raises(
            PosthocError,
            match=rf"^posthoc={name} draws members of its own and needs their number S: "
            r"set posthoc.n_samples \(e.g. 30\) or evaluate.py n_samples=, not null.$",
        ):
            posterior.check(method, None, {}, n_samples)
        assert _resolved(tmp_path, f"posthoc={name}", "posthoc.n_samples=null", "n_samples=7")[0] == 7


def test_a_calibrator_keeps_the_methods_s_unless_n_samples_says_otherwise(tmp_path):
    dm = _digits()
    for overrides, expected in (([], 3), (["n_samples=7"], 7)):
        n_samples, posterior = _resolved(tmp_path, "posthoc=temperature", *overrides)
        method = _dbsn(3)
        posterior.check(method, dm, {}, n_samples)
        assert fit_posterior(posterior, method, dm, {}, n_samples, CPU).num_members == expected
    # on top of a posterior that draws members, its S is its base's
    assert (
        _resolved(tmp_path, "posthoc=temperature", "+posthoc@posthoc.base=laplace", "posthoc.base.n_samples=4")[0] == 4
    )
