"""Any calibrator as a post-hoc posterior (dbsn.posthoc.calibrators.posthoc.PosthocCalibration): a
calibrated method predicts (members too) through its calibrator; on top of Laplace; the checks;
temperature scaling as the run's own temperature would be; a calibrator of a user's package with
its own `conf/posthoc/<name>.yaml`; `evaluate.py posthoc=<calibrator>` end to end.
"""

from __future__ import annotations

import copy
import json
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dbsn.data.digits import DigitsDataModule
from dbsn.evaluation.runs import CONFIG_FILE
from dbsn.methods import MAP, DeepEnsemble
from dbsn.methods.tasks import Segmentation
from dbsn.metrics.uncertainty import uncertainty_decomposition
from dbsn.posthoc.base import PosthocError
from dbsn.posthoc.calibrators import DirichletCalibration, IsotonicCalibration, PosthocCalibration, TemperatureScaling
from dbsn.posthoc.calibrators.posthoc import validation_predictive
from dbsn.posthoc.laplace import LaplaceMethod, LastLayerLaplace
from dbsn.runtime.config import ConfigError
from dbsn.runtime.evaluation import build_posterior
from dbsn.runtime.run import train
from tests.posthoc.test_calibrators import C, miscalibrated
from tests.support.configs import compose_config, evaluate_quietly, tiny_for
from tests.support.netutil import tiny_structure_net


def test_a_calibrated_method_predicts_and_decomposes_through_its_calibrator():
    torch.manual_seed(0)
    method = DeepEnsemble([MAP(tiny_structure_net(C), learn_structure=False) for _ in range(3)]).eval()
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        plain, members = method.predict_log_probs(x), method.predict_members(x)
        method.calibrator = DirichletCalibration("full", reg_lambda=1e-3).fit(*miscalibrated(200))
        torch.testing.assert_close(method.predict_log_probs(x), method.calibrator(plain))
        scores = method.uncertainty_scores(x)
        expected = uncertainty_decomposition(method.calibrator(members))
        for key in expected:
            torch.testing.assert_close(scores[key], expected[key])
        method.temperature_scaling = True  # the run's temperature first, then the calibrator
        method.temperature.log_temperature.fill_(np.log(2.0))
        torch.testing.assert_close(method.predict_log_probs(x), method.calibrator(method.temperature(plain)))
    assert method.run_facts()["calibrator"] == "dirichlet"
    method.calibrator = None
    method.temperature_scaling = False
    with torch.no_grad():
        torch.testing.assert_close(method.predict_log_probs(x), plain)


def test_a_calibrator_on_top_of_laplace_calibrates_the_laplace_predictive(digits_map):
    method, dm = digits_map
    posterior = PosthocCalibration(
        IsotonicCalibration(), base=LastLayerLaplace(n_samples=8, hessian="diag", prior_precision=1.0)
    )
    assert posterior.name == "laplace+isotonic" and posterior.why_not(method, {}) is None
    assert posterior.n_samples == 8  # its base's S
    posterior.check(method, dm, {}, posterior.n_samples)
    laplace = posterior.fit(method, dm, {}, posterior.n_samples)
    assert laplace.num_members == 8
    assert isinstance(laplace, LaplaceMethod) and isinstance(laplace.calibrator, IsotonicCalibration)
    assert method.calibrator is None and posterior.calibrator.num_classes is None  # each fit has its own copy
    x = dm.preprocess(next(iter(dm.val_dataloader()))[0][:16])
    with torch.no_grad():
        calibrated = laplace.predict_log_probs(x)
        calibrator, laplace.calibrator = laplace.calibrator, None
        plain = laplace.predict_log_probs(x)
    torch.testing.assert_close(calibrated, calibrator(plain))
    assert laplace.run_facts()["posterior"] == "last-layer Laplace"
    laplace.calibrator = calibrator
    facts = laplace.run_facts()
    assert facts["posterior"] == "last-layer Laplace" and facts["calibrator"] == "isotonic"


def test_temperature_scaling_predicts_as_the_runs_own_temperature_would(digits_map):
    """posthoc=temperature equals the method fitting its own temperature (`Method.fit_temperature`,
    what `model.prediction.temperature_scaling=true` does), bit for bit."""
    method, dm = digits_map
    x = dm.preprocess(next(iter(dm.val_dataloader()))[0][:32])
    own = copy.deepcopy(method)
    own.temperature_scaling = True
    temperature = own.fit_temperature(dm)
    calibrated = PosthocCalibration(TemperatureScaling()).fit(copy.deepcopy(method), dm, {})
    assert calibrated.calibrator.scaler.temperature == temperature
    with torch.no_grad():
        assert torch.equal(calibrated.predict_log_probs(x), own.predict_log_probs(x))
        assert torch.equal(
            calibrated.uncertainty_scores(x)["mutual_information"], own.uncertainty_scores(x)["mutual_information"]
        )
    # stacked on the run's own temperature: a second temperature refits the product, T₁ · T₂ ≈ T₁
    stacked = PosthocCalibration(TemperatureScaling()).fit(copy.deepcopy(own), dm, {})
    assert stacked.calibrator.scaler.temperature == pytest.approx(1.0, abs=1e-3)


def test_the_posterior_checks_its_inputs_in_one_line():
    posterior = PosthocCalibration(IsotonicCalibration())
    segmentation = SimpleNamespace(task=Segmentation())
    assert "segmentation model" in posterior.why_not(segmentation, {})
    no_val = DigitsDataModule(num_workers=0, val_size=0)
    with pytest.raises(PosthocError, match="validation split.*data.val_size=0"):
        posterior.check(MAP(tiny_structure_net(), learn_structure=False), no_val, {})
    with pytest.raises(
        PosthocError,
        match=r"posthoc.calibrator: floor must lie in \(0, 1/C\) = \(0, 0.1\) for 10 "
        r"classes, got 0.2 \(posthoc=isotonic\)",
    ):
        PosthocCalibration(IsotonicCalibration(floor=0.2)).check(
            MAP(tiny_structure_net(10), learn_structure=False), DigitsDataModule(num_workers=0, val_size=50), {}
        )
    with pytest.raises(PosthocError, match="posthoc.calibrator must be a dbsn.posthoc.calibrators.Calibrator"):
        PosthocCalibration(torch.nn.Identity())
    with pytest.raises(PosthocError, match="posthoc.base must be a post-hoc posterior"):
        PosthocCalibration(IsotonicCalibration(), base=IsotonicCalibration())
    nameless = type("Nameless", (IsotonicCalibration,), {"name": ""})()
    for name in (None, "mine"):  # runs record the calibrator by its own name
        with pytest.raises(PosthocError, match="Nameless needs a name"):
            PosthocCalibration(nameless, name=name)
    assert PosthocCalibration(IsotonicCalibration(), name="mine").name == "mine"


def test_the_shipped_configs_build_their_calibrators(tmp_path):
    for name, kind in (
        ("temperature", TemperatureScaling),
        ("histogram_binning", None),
        ("isotonic", IsotonicCalibration),
        ("dirichlet", DirichletCalibration),
    ):
        posterior = build_posterior(compose_config("evaluate", ["ckpt_path=x.ckpt", f"posthoc={name}"], tmp_path))
        assert isinstance(posterior, PosthocCalibration) and posterior.name == name == posterior.calibrator.name
        assert kind is None or isinstance(posterior.calibrator, kind)
    with pytest.raises(ConfigError, match="posthoc: bins must be >= 1, got 0"):
        build_posterior(
            compose_config(
                "evaluate", ["ckpt_path=x.ckpt", "posthoc=histogram_binning", "posthoc.calibrator.bins=0"], tmp_path
            )
        )
    with pytest.raises(ConfigError, match="posthoc.calibrator: unknown key 'binz'.*Did you mean 'bins'"):
        build_posterior(
            compose_config(
                "evaluate", ["ckpt_path=x.ckpt", "posthoc=histogram_binning", "+posthoc.calibrator.binz=3"], tmp_path
            )
        )


#: a calibrator of a user's own package and its config, nothing of it in dbsn
USER_CALIBRATOR = '''
"""q = (1 − ε) p + ε / C, ε the validation error rate: a prediction hedged by how often it is wrong."""

import torch

from dbsn.posthoc.calibrators import Calibrator


class UniformMixing(Calibrator):
    name = "uniform_mixing"

    def __init__(self, at_most: float = 1.0) -> None:
        super().__init__()
        if not 0 < at_most <= 1:
            raise ValueError(f"at_most must lie in (0, 1], got {at_most}")
        self.at_most = at_most
        self.register_buffer("epsilon", torch.zeros((), dtype=torch.float64))

    def fit_map(self, log_probs, targets):
        self.epsilon = (log_probs.argmax(-1) != targets).double().mean().clamp_max(self.at_most)

    def transform(self, log_probs):
        return torch.log((1 - self.epsilon) * log_probs.exp() + self.epsilon / log_probs.shape[-1])
'''
USER_CONFIG = """\
_target_: dbsn.posthoc.calibrators.PosthocCalibration
calibrator:
  _target_: usercal.mixing.UniformMixing
  at_most: 0.5
n_samples: null
base: null
"""


def test_a_calibrator_of_ones_own_package_is_one_class_and_one_yaml(tmp_path, monkeypatch, digits_map):
    package = tmp_path / "usercal"
    (package / "conf" / "posthoc").mkdir(parents=True)
    (package / "__init__.py").touch()
    (package / "mixing.py").write_text(textwrap.dedent(USER_CALIBRATOR))
    (package / "conf" / "posthoc" / "uniform_mixing.yaml").write_text(USER_CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))
    search = f"hydra.searchpath=[file://{package / 'conf'}]"
    cfg = compose_config("evaluate", ["ckpt_path=x.ckpt", search, "posthoc=uniform_mixing"], tmp_path / "hydra")
    posterior = build_posterior(cfg)
    assert posterior.name == "uniform_mixing" and posterior.calibrator.at_most == 0.5
    method, dm = digits_map
    posterior.check(method, dm, {})
    log_probs, targets = validation_predictive(method, dm)
    epsilon = min((log_probs.argmax(-1) != targets).double().mean().item(), 0.5)
    calibrated = posterior.fit(copy.deepcopy(method), dm, {})
    x = dm.preprocess(next(iter(dm.val_dataloader()))[0][:16])
    with torch.no_grad():
        p = method.predict_log_probs(x).double().exp()
        expected = torch.log((1 - epsilon) * p + epsilon / p.shape[-1]).float()
        torch.testing.assert_close(calibrated.predict_log_probs(x), expected, rtol=0, atol=1e-6)
    assert calibrated.run_facts()["calibrator"] == "uniform_mixing"
    assert calibrated.run_facts()["calibrator_nll_after"] < calibrated.run_facts()["calibrator_nll_before"]
    with pytest.raises(ConfigError, match="posthoc: at_most must lie in"):
        build_posterior(
            compose_config(
                "evaluate",
                ["ckpt_path=x.ckpt", search, "posthoc=uniform_mixing", "posthoc.calibrator.at_most=2"],
                tmp_path / "hydra",
            )
        )


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A finished map_fixed run on 300 digits with a 100-image validation split."""
    root = tmp_path_factory.mktemp("calibrated")
    overrides = [
        "data=digits",
        "data.num_workers=0",
        "data.val_size=100",
        "data.train_subset=300",
        "model=map_fixed",
        *tiny_for("map_fixed"),
        "trainer.max_epochs=1",
        "logger=csv",
    ]
    train(compose_config("train", overrides, root), root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("isotonic", ["posthoc=isotonic"]),
        ("dirichlet", ["posthoc=dirichlet", "posthoc.calibrator.reg_lambda=0.01"]),
        ("temperature", ["posthoc=temperature"]),
        (
            "laplace+histogram_binning",
            [
                "posthoc=histogram_binning",
                "+posthoc@posthoc.base=laplace",
                "posthoc.base.n_samples=4",
                "posthoc.base.hessian=diag",
            ],
        ),
    ],
)
def test_evaluate_with_a_calibrator_writes_its_posthoc_run(digits_run, tmp_path, name, overrides):
    evaluate_quietly(digits_run / "checkpoints" / "last.ckpt", tmp_path, overrides)
    folder = digits_run / "posthoc" / name
    record = json.loads((folder / "metrics.json").read_text())
    assert record["posthoc"] == name and record["calibrator"] == name.split("+")[-1]
    assert np.isfinite(record["metrics"]["test/nll"]) and 0 <= record["metrics"]["test/error"] <= 1
    assert record["calibrator_nll_after"] < record["calibrator_nll_before"]
    assert name == "temperature" or 0 <= record["calibrator_argmax_changed"] <= 1
    assert OmegaConf.load(folder / CONFIG_FILE).posthoc == name  # the report reads it as method map_fixed+<name>
    assert (folder / "evaluation").is_dir()
