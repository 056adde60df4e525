"""VOGN, VOGN-FBN and NEK-FAC as methods (dbsn.methods.natgrad): end-to-end train() / evaluate(),
the stored posterior (what evaluation samples from equals the optimiser's at the end of training,
and the weight draws have its spread), their own optimisers and the configs (resume:
tests/runtime/test_checkpoint.py; VGG16-BN: tests/nets/test_vgg.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dbsn.runtime.build
import dbsn.runtime.run
from dbsn.methods.natgrad import VOGNFBN, VOGNMAP, NEKFACMethod, VOGNMethod, posterior_health
from dbsn.natgrad import NEKFAC, VOGN
from dbsn.natgrad.nekfac import _as_matrix
from dbsn.nets import VGG16BN, StructureNet
from dbsn.runtime.config import validate_config
from dbsn.runtime.run import evaluate, train
from tests.support.configs import TINY, compose_config, configured_optimizers, small_model, tiny_for

TRAINER = [o for o in TINY if o.startswith("trainer.")]


@pytest.fixture(scope="module")
def cifar_root(cifar10_files):
    return cifar10_files(n_train=128, n_test=32, seed=1)


def _overrides(method: str, root: Path, epochs: int) -> list[str]:
    return [
        f"model={method}",
        "data=cifar10",
        f"data.root={root}",
        "data.batch_size=16",
        "data.num_workers=0",
        *tiny_for(method),
        f"trainer.max_epochs={epochs}",
    ]


def _train_keeping_model(overrides: list[str], run_dir: Path, monkeypatch) -> tuple[dict, object]:
    """train() through its own code path; also returns the method it built (optimiser attached)."""
    built = []
    original = dbsn.runtime.run.build_model
    monkeypatch.setattr(dbsn.runtime.run, "build_model", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    metrics = train(compose_config("train", overrides, run_dir), run_dir)
    return metrics, built[0]


# ---------------------------------------------------------------------- end to end
def _posterior_of(opt, method) -> dict[str, torch.Tensor]:
    """The live optimiser's posterior, in the layout of the method's `posterior` buffers."""
    if isinstance(opt, VOGN):
        stds = opt.posterior_std()
        return {"std": torch.cat([stds[name].flatten() for name, _ in method.net.named_parameters()])}
    out = {}
    for i, layer in enumerate(opt.layers):
        st = opt.layer_state(layer)
        out.update({f"U_A_{i}": st["U_A"], f"U_S_{i}": st["U_S"], f"sigma_{i}": opt.noise_std(layer)})
    return out


def _draw_statistics(method, draws: int = 100) -> torch.Tensor:
    """Standardised weight draws z (one row per draw): VOGN (w − μ)/σ over σ > 0; NEK-FAC the
    draws rotated into each layer's eigenbasis, U_Sᵀ (W̄ − M) U_A / Σ. Both N(0, 1) if the draws
    have the stored posterior's spread."""
    params = dict(method.net.named_parameters())
    rows = []
    for _ in range(draws):
        drawn = method.sample_parameters()
        if isinstance(method, NEKFACMethod):
            z, b = [], method.posterior
            layers = [
                (n, m) for n, m in method.net.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
            ]
            for i, (name, layer) in enumerate(layers):
                delta = _as_matrix(layer, drawn[f"{name}.weight"] - layer.weight, drawn[f"{name}.bias"] - layer.bias)
                u_a, u_s, sigma = getattr(b, f"U_A_{i}"), getattr(b, f"U_S_{i}"), getattr(b, f"sigma_{i}")
                z.append(((u_s.mT @ delta @ u_a) / sigma).flatten())
            rows.append(torch.cat(z))
        else:
            assert drawn.keys() == params.keys()
            std = method.posterior.std
            rows.append((torch.cat([(drawn[k] - p).flatten() for k, p in params.items()]) / std)[std > 0])
    return torch.stack(rows).detach()


@pytest.mark.parametrize("method", ["vogn", "vogn_fbn", "nekfac"])
def test_method_trains_and_evaluates_from_its_checkpoint(method, cifar_root, tmp_path, monkeypatch):
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    val_size = 16 if method == "vogn_fbn" else 0  # validation (S = val_samples) during training, once
    overrides = [
        *_overrides(method, cifar_root, epochs=2),
        f"data.val_size={val_size}",
        "model.prediction.val_samples=2",
    ]
    # N = 112 images would leave the posteriors near the prior (VOGN: σ² ≈ τ / (N γ)), and the paper's VOGN
    # lr 0.01 / (s + γ) moves weights with little curvature by O(1) per step: the network saturates (NLL in
    # the thousands, every member one-hot on one class, no disagreement left to measure). CIFAR's N, and
    # for VOGN a smaller lr, keep the methods in the regime they are run in.
    overrides.append("model.dataset_size=50000")
    if method != "nekfac":
        overrides.append("model.vogn.lr=1e-3")
    metrics, trained = _train_keeping_model(overrides, run_dir, monkeypatch)
    assert set(metrics) >= {"test/error", "test/nll", "test/brier", "test/ece"}
    assert isinstance(trained, {"vogn": VOGNMAP, "vogn_fbn": VOGNFBN, "nekfac": NEKFACMethod}[method])
    opt = trained.trainer.optimizers[0]
    assert isinstance(opt, NEKFAC if method == "nekfac" else VOGN)
    assert (opt.steps if method == "nekfac" else opt.steps_taken) == 2 * ((128 - val_size) // 16)
    logged = (run_dir / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/loss_epoch", "train/nll_epoch", "train/error_epoch"} <= set(logged)
    assert ("train/kl_epoch" in logged) == (method == "vogn_fbn")
    assert ("val/nll" in logged) == (val_size > 0)
    assert ("posterior/snr_median" in logged and "posterior/std_median" in logged) == (method != "nekfac")

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cfg = compose_config("evaluate", [f"ckpt_path={ckpt}", "n_samples=3", *TRAINER[:2]], eval_dir)
    again = evaluate(cfg, eval_dir)  # rebuilt from the checkpoint alone, S = 3
    assert json.loads((run_dir / "evaluation" / "metrics.json").read_text())["metrics"] == again
    assert json.loads((run_dir / "evaluation" / "metrics.json").read_text())["n_samples"] == 3
    assert set(again) >= {"test/error", "test/nll", "test/brier", "test/ece", "test/mutual_information"}
    assert again["test/nll"] != pytest.approx(metrics["test/nll"], rel=1e-7)  # other weight draws
    assert again["test/nll"] < 5  # not saturated (the NLL of chance is 2.3) ...
    assert again["test/mutual_information"] > 0  # ... so the members' disagreement shows

    # the posterior evaluation samples from is the optimiser's at the end of training
    loaded = dbsn.runtime.build.load_method(ckpt, num_classes=10)
    live = _posterior_of(opt, trained)
    assert set(live) == {k for k, _ in loaded.posterior.named_buffers()}
    for name, value in live.items():
        torch.testing.assert_close(getattr(loaded.posterior, name), value, rtol=0, atol=0, msg=name)
        assert value.abs().max() > 0, name
    # ... and its weight draws have that spread; the prediction is stochastic
    loaded.eval()
    z = _draw_statistics(loaded)  # (draws, coordinates), N(0, 1) entries if the spread is the stored one
    assert abs(z.var(0).mean().item() - 1) < 0.05, z.var(0).mean()
    assert abs(z.mean().item()) < 0.02 and z.mean(0).std() < 0.15  # centred on μ, independent draws
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        members = loaded.stochastic_forward(x, 3)
    assert members.shape == (3, 5, 10)
    assert not torch.allclose(members[0], members[1])
    x.requires_grad_(True)  # the adversarial attacks differentiate the ensemble w.r.t. its input
    (grad,) = torch.autograd.grad(loaded.predict_log_probs(x, 3)[:, 0].sum(), x)
    assert grad.abs().sum() > 0


def test_vogn_posterior_std_is_the_optimizers():
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = VOGNMethod(net, vogn={"init_precision": 0.5, "damping": 0.1}, dataset_size=50)
    opt = method._make_optimizer(50)
    assert isinstance(method, VOGNMAP) and opt.param_groups[1]["point_estimate"]
    assert all(p is not method.theta for g in opt.param_groups for p in g["params"])  # θ is Adam's
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(net.parameters()))
    for name, value in method._posterior_values(opt).items():
        getattr(method.posterior, name).copy_(value)
    stds, expected = method.posterior_std(), opt.posterior_std()
    assert stds.keys() == expected.keys()
    for k in stds:
        torch.testing.assert_close(stds[k], expected[k], rtol=0, atol=0)
    bn = [n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d) and m.affine]
    assert bn and all(stds[f"{n}.weight"].abs().max() == 0 for n in bn)  # BN: point estimates
    assert stds["classifier.weight"].min() > 0


def test_posterior_health_is_the_median_over_noisy_parameters():
    net = torch.nn.Linear(2, 2)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 4.0]]))
        net.bias.copy_(torch.tensor([3.0, -7.0]))
    stds = {"weight": torch.tensor([[1.0, 1.0], [0.25, 2.0]]), "bias": torch.zeros(2)}  # bias: point estimate
    health = posterior_health(net, stds)
    # σ over the four noisy weights: 0.25, 1, 1, 2 (torch's median: the lower middle value); |μ| / σ: 1, 2, 2, 2
    assert health == {"std_median": 1.0, "snr_median": 2.0}


def test_settings_are_checked_when_the_method_is_built():
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    with pytest.raises(ValueError, match="unknown VOGN settings.*'lrr'"):
        VOGNMethod(net, vogn={"lrr": 0.1})
    with pytest.raises(ValueError, match="unknown VOGN settings.*'dataset_size'"):
        VOGNMethod(net, vogn={"dataset_size": 10})
    with pytest.raises(ValueError, match="structure"):
        VOGNMethod(net, structure="bbb")
    with pytest.raises(ValueError, match="unknown NEKFAC settings.*'damp'"):
        NEKFACMethod(VGG16BN(10, width=0.25), nekfac={"damp": 1.0})


# ---------------------------------------------------------------------- configs
def test_experiment_configs_compose_and_validate(tmp_path):
    from hydra import compose, initialize_config_dir

    from tests.support.configs import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=table5_vogn"], return_hydra_config=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    models = cfg.hydra.sweeper.params.model.split(",")
    assert models == ["vogn", "vogn_fbn", "dbsn"]
    for model in models:  # every job: the small network (~41K parameters), batch 32
        cfg = compose_config("train", ["experiment=table5_vogn", f"model={model}"], tmp_path)
        validate_config(cfg)
        assert cfg.data.batch_size == 32 and cfg.data._target_.endswith("CIFAR10DataModule")
        method = dbsn.runtime.build.build_model(cfg.model, num_classes=10)
        assert dbsn.runtime.build.count_parameters(method) == pytest.approx(41_000, rel=0.05)
        if model != "dbsn":
            assert method.vogn == {
                "lr": 0.01,
                "prior_variance": 1.0,
                "init_precision": 0.008,
                "kl_warmup_start": 0.01,
                "kl_warmup_steps": 1000,
                "tau": 1.0,
                "augmentation_factor": 1.0,
                "damping": 0.001,
                "momentum": 0.9,
                "beta2": 0.999,
                "draws_per_step": 1,
            }
            assert method.n_samples == 100

    for data, classes in (("cifar10", 10), ("cifar100", 100)):
        cfg = compose_config("train", [f"experiment=nekfac_{data}"], tmp_path)
        validate_config(cfg)
        assert (cfg.data.batch_size, cfg.trainer.max_epochs, cfg.model.prediction.n_samples) == (128, 150, 30)
        assert dict(cfg.model.nekfac) == {
            "lr": 0.01,
            "kl_weight": 0.1,
            "prior_var": 1.0,
            "damping": 0.001,
            "kl_clip": 0.001,
            "momentum": 0.9,
            "cov_update_every": 10,
            "eigen_update_every": 200,
            "stat_decay": 0.99,
        }
        assert list(cfg.model.lr_milestones) == [0.5, 0.75] and cfg.model.lr_gamma == 0.1
        assert cfg.data._target_.endswith("CIFAR10DataModule" if data == "cifar10" else "CIFAR100DataModule")
        assert cfg.model.net._target_ == "dbsn.nets.VGG16BN" and cfg.model.net.width == 1.0


@pytest.mark.parametrize("model", ["vogn", "nekfac"])
def test_natural_gradient_methods_keep_their_own_optimiser(model, tmp_path):
    from dbsn.natgrad import NEKFAC, VOGN

    method, optimizers, schedules = configured_optimizers(compose_config("train", small_model(model), tmp_path).model)
    assert method.no_decay_parameters() == []
    assert isinstance(optimizers[0], VOGN if model == "vogn" else NEKFAC) and len(schedules) == 1
    assert not any(isinstance(opt, torch.optim.SGD) for opt in optimizers)
    held = [id(p) for g in optimizers[0].param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in method.net.parameters())
