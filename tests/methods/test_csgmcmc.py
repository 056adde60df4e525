"""cSG-MCMC as methods (dbsn.methods.csgmcmc): model=csghmc / csgld keep their samples (with their
BatchNorm statistics) at the schedule's steps and predict with the average of the samples' softmaxes;
model=csghmc_structure keeps T chains' structures and predicts with them; both through train.py and
evaluate.py on digits, the samples in the checkpoint; a run resumed mid-cycle equals the
uninterrupted one; the chains' prior is DBSN's; bad settings are refused in one line; compare and the
field sweeps take them."""

from __future__ import annotations

import copy
import json
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException

import dbsn.runtime.run
from dbsn.methods.csgmcmc import CSGMCMC, gumbel_energy
from dbsn.methods.registry import method_config, method_name
from dbsn.runtime.build import build_model, load_method
from dbsn.runtime.checkpoint import load_checkpoint
from dbsn.runtime.config import validate_config
from dbsn.runtime.run import train
from dbsn.sampling import CyclicalSchedule, CyclicalSGMCMC
from tests.support.configs import compose_config, evaluate_quietly, evaluate_the_whole_suite
from tests.support.fakedata import normalised_digits

# 128 digits in batches of 32: 4 steps an epoch, 8 in two epochs
RUN = [
    "data=digits",
    "data.batch_size=32",
    "data.train_subset=128",
    "trainer.max_epochs=2",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.log_every_n_steps=1",
    "seed=3",
    "statistics.resamples=100",
]
TINY = {
    "csghmc": ["model.net.width=8"],
    "csgld": ["model.net.width=8"],
    "csghmc_structure": [
        "model.net.num_nodes=3",
        "model.net.cells_per_stage=1",
        "model.net.growth=4",
        "model.net.stem_channels=8",
        "model.train_samples=2",
    ],
}
# two cycles of 4 steps, noise from each cycle's second step, samples after its second and fourth steps
SCHEDULE = [
    "model.sampler.schedule.cycles=2",
    "model.sampler.schedule.exploration=0.25",
    "model.sampler.schedule.samples_per_cycle=2",
    "model.sampler.schedule.sample_spacing=0.5",
]


def _overrides(model: str, *extra: str) -> list[str]:
    return [f"model={model}", *RUN, *TINY[model], *SCHEDULE, *extra]


def _by_hand(method, x: torch.Tensor) -> torch.Tensor:
    """The mean of the members' softmaxes, each member a network of its own in eval mode: a copy of
    the network with sample s's state dict (cSGHMC), or the network under kept structure s."""
    probs = []
    if isinstance(method, CSGMCMC):
        alpha = method.prediction_structures(1)
        for s in range(method.samples.count):
            net = copy.deepcopy(method.net)
            net.load_state_dict(method.samples[s], strict=True)  # parameters and BatchNorm statistics
            probs.append(torch.softmax(net.eval()(x, alpha, replicate=True), -1))
    else:
        for s in range(method.samples.count):
            alpha = torch.softmax(method.samples[s]["logits"] / method.structure_tau, -1)
            probs.append(torch.softmax(method.net.eval()(x, alpha[None], replicate=True), -1))
    return torch.stack(probs).mean(0)


@pytest.mark.parametrize("model", ["csghmc", "csghmc_structure"])
def test_trains_keeps_its_samples_and_evaluates_from_the_checkpoint_on_digits(model, tmp_path):
    run_dir = tmp_path / "run"
    metrics = train(compose_config("train", _overrides(model), run_dir), run_dir)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    method = load_method(ckpt, num_classes=10).eval()
    chains = 2 if model == "csghmc_structure" else 1
    assert method.samples.steps == [s for s in (1, 3, 5, 7) for _ in range(chains)]  # two per cycle, each chain's
    assert method.n_samples == method.num_members == 4 * chains
    facts = json.loads((run_dir / "metrics.json").read_text())
    assert facts["samples_kept"] == 4 * chains and facts["n_samples"] == 4 * chains
    if model == "csghmc":  # the last sample is the network after the last step, BatchNorm statistics included
        assert facts["sampler_temperature"] == pytest.approx(1 / 128)
        # the largest noise a step added: each cycle's second step, at α₀ (cos(π / 4) + 1) / 2, T = 1 / N, N = 128
        peak = math.sqrt(2 * 0.5 * (math.cos(math.pi / 4) + 1) / 2 * 0.9 / 128**2)
        assert facts["sampler_noise_std_max"] == pytest.approx(peak, rel=1e-9)
        assert facts["budget"] == {"steps": 8, "images": 256, "train_images": 128, "batch_size": 32}
        for name, tensor in method.net.state_dict().items():
            assert torch.equal(method.samples[3][name], tensor), name
        assert not torch.equal(method.samples[0]["conv1.weight"], method.samples[1]["conv1.weight"])
        assert not torch.equal(method.samples[0]["bn1.running_mean"], method.samples[3]["bn1.running_mean"])
    else:  # each member a structure softmax(u / tau) of a kept chain state
        alphas = method.prediction_structures(method.n_samples)
        assert alphas.shape == (8, method.net.num_edges, method.net.num_ops)
        assert not torch.allclose(alphas[0], alphas[1]) and not torch.allclose(alphas[0], alphas[2])

    x, _ = normalised_digits(8)
    with torch.no_grad():
        torch.testing.assert_close(method.predict_log_probs(x).exp(), _by_hand(method, x), rtol=1e-5, atol=1e-6)
        assert method.predict_members(x).shape == (4 * chains, 8, 10)
        if model == "csghmc":  # the detection scores read each member's own head and features
            logits, features = method.member_outputs(x, 4)
            torch.testing.assert_close(logits, method.stochastic_forward(x, 4))
            for s, (weight, bias) in enumerate(method.member_heads(4)):
                assert torch.equal(weight, method.samples[s]["classifier.weight"])
                torch.testing.assert_close(features[s] @ weight.T + bias, logits[s], rtol=1e-5, atol=1e-5)
    again = evaluate_quietly(
        ckpt, tmp_path / "eval", ["statistics.resamples=100", "ablation.sizes=[]"]
    )  # the checkpoint alone
    assert again["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-6)
    assert again["test/mutual_information"] > 0  # the members disagree
    with pytest.raises(ValueError, match=f"predicts with the S = {4 * chains} samples its chain kept"):
        method.n_samples = 100


class _StopAfterFirstEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def test_a_run_resumed_mid_cycle_keeps_its_samples_and_continues_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """One cycle over both epochs (8 steps), noise from its third step, samples after steps 3, 5 and 7:
    the run stopped after its first epoch holds sample 3 and is half way through the cycle; resumed,
    its final checkpoint equals the uninterrupted run's in every tensor (the samples, the sampler's
    velocities, step count and noise generator included)."""
    common = [
        "model=csgld",
        *RUN,
        *TINY["csgld"],
        "test=false",
        "model.sampler.schedule.cycles=1",
        "model.sampler.schedule.exploration=0.25",
        "model.sampler.schedule.samples_per_cycle=3",
        "model.sampler.schedule.sample_spacing=0.25",
        "model.sampler.temperature=1",
    ]
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(compose_config("train", common, straight), straight)
    build_trainer = dbsn.runtime.run.build_trainer
    with monkeypatch.context() as patch:
        patch.setattr(
            dbsn.runtime.run,
            "build_trainer",
            lambda cfg, out, callbacks=(), loggers=(): build_trainer(
                cfg, out, [*callbacks, _StopAfterFirstEpoch()], loggers
            ),
        )
        train(compose_config("train", common, first), first)
    halfway = load_checkpoint(first / "checkpoints" / "last.ckpt")
    assert halfway["epoch"] == 0 and halfway["state_dict"]["samples.steps"].tolist() == [3]
    assert halfway["optimizer_states"][0]["steps"] == 4
    train(compose_config("train", [*common, f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"], resumed), resumed)
    a, b = (load_checkpoint(run / "checkpoints" / "last.ckpt") for run in (straight, resumed))
    assert a["state_dict"]["samples.steps"].tolist() == b["state_dict"]["samples.steps"].tolist() == [3, 5, 7]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])] == []
    opt_a, opt_b = a["optimizer_states"][0], b["optimizer_states"][0]
    assert opt_a["steps"] == opt_b["steps"] == 8 and torch.equal(opt_a["generator"], opt_b["generator"])
    assert all(torch.equal(opt_a["state"][i]["velocity"], opt_b["state"][i]["velocity"]) for i in opt_a["state"])


def test_the_chains_prior_is_dbsns_gumbel_logits():
    """cSGLD on the prior energy alone, Σ u + e^(−u), samples u ~ Gumbel(0, 1): mean Euler's γ,
    variance π² / 6, within 4 Monte Carlo standard errors (16,000 draws; the standard error of a
    variance from the Gumbel's kurtosis, 5.4)."""
    u = torch.nn.Parameter(torch.zeros(4000, 1, 2, dtype=torch.float64))
    schedule, total = CyclicalSchedule(cycles=2, exploration=0.5, samples_per_cycle=1), 2 * 600
    opt = CyclicalSGMCMC([u], lr=0.15, schedule=schedule, total_steps=total, dataset_size=1, friction=1.0, seed=0)
    kept = []
    for _ in range(total):
        opt.zero_grad()
        gumbel_energy(u).sum().backward()  # the chains are independent: each its own energy's gradient
        opt.step()
        if opt.keeps():
            kept.append(u.detach().flatten().clone())
    draws = torch.cat(kept).numpy()
    n, var = draws.size, math.pi**2 / 6
    assert abs(draws.mean() - np.euler_gamma) < 4 * math.sqrt(var / n), draws.mean()
    assert abs(draws.var() - var) < 4 * var * math.sqrt(4.4 / n), draws.var()


def test_a_chain_moves_on_its_own_energy():
    """T chains: chain t's gradient is that of N · NLL_t − log p(u_t) over N, not 1/T of it (the
    weights' loss averages the T structures, as DBSN's)."""
    cfg = compose_config("train", _overrides("csghmc_structure"), "/tmp/unused")
    torch.manual_seed(0)
    method = build_model(cfg.model, num_classes=10)
    method.dataset_size = 128
    x, y = normalised_digits(8)
    method.train()
    method.training_loss(x, y)["loss"].backward()
    together = method.chains.grad.clone()
    for t in range(2):  # each chain alone: its structure's NLL and its prior over N
        method.zero_grad()
        alpha = torch.softmax(method.chains[t] / method.structure_tau, -1)[None]
        nll = torch.nn.functional.cross_entropy(method.network(x, alpha), y)
        (nll + gumbel_energy(method.chains[t : t + 1]).sum() / 128).backward()
        torch.testing.assert_close(together[t], method.chains.grad[t], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "model, override, message",
    [
        ("csghmc", "+model.learn_structure=true", "model.learn_structure=false"),
        ("csghmc", "+model.optim.lr=0.1", "not model.optim"),
        ("csghmc", "model.prediction.n_samples=10", "leave prediction.n_samples at 1"),
        ("csghmc", "+model.weights._target_=dbsn.methods.MCDropoutWeights", "point-estimate weights"),
        ("csghmc_structure", "model/net=resnet18", "use model/net=structure_net, or model=csghmc"),
        ("csghmc_structure", "model.sampler.weight_decay=5e-4", "model.sampler.weight_decay=0"),
    ],
)
def test_bad_settings_are_refused_in_one_line(model, override, message, tmp_path):
    overrides = [f"model={model}", override]
    with pytest.raises(InstantiationException, match=message):  # the method's ValueError, through Hydra
        build_model(compose_config("train", overrides, tmp_path).model, num_classes=10)


def test_a_deep_ensemble_of_chains_is_refused(tmp_path):
    """A deep ensemble trains its members without their step hooks, which keep the samples."""
    from dbsn.methods import DeepEnsemble

    member = build_model(compose_config("train", ["model=csgld", "model.net.width=8"], tmp_path).model, num_classes=10)
    with pytest.raises(ValueError, match="train the members as separate runs"):
        DeepEnsemble([member])


def test_compare_and_the_registry_take_the_samplers_with_their_own_schedule(tmp_path):
    """compare's fair protocol: the sampler keeps its own settings (its cycles, not the shared ×0.1
    steps), its base lr is model.sampler.lr (the one --tune chooses); S is the samples kept. The
    structure sampler's weights take the shared schedule (DBSN's SGD)."""
    from dbsn.tools import compare

    assert {"csghmc", "csgld", "csghmc_structure"} <= set(compare.compared_methods())
    assert compare.lr_key("csghmc") == "model.sampler.lr" and compare.lr_key("csghmc_structure") == "model.optim.lr"
    for model in ("csghmc", "csgld"):
        overrides = compare.method_overrides(model, 10, 21, backbone="resnet18", lr=0.2)
        assert not any("n_samples" in o or "milestones" in o for o in overrides)
        cfg = compose_config("train", [*overrides, *compare.shared_overrides()], tmp_path)
        validate_config(cfg)
        assert cfg.model.sampler.lr == 0.2 and cfg.model.sampler.schedule.cycles == 4 and cfg.model.net.width == 16
        assert cfg.model.sampler.friction == (1.0 if model == "csgld" else 0.9)
        assert method_name(cfg.model) == model  # csgld and csghmc are one class, told apart by the friction
    cfg = compose_config(
        "train",
        [*compare.method_overrides("csghmc_structure", 10, 21, backbone="resnet18"), *compare.shared_overrides()],
        tmp_path,
    )
    validate_config(cfg)
    assert cfg.model.net._target_ == "dbsn.nets.StructureNet" and list(cfg.model.optim.milestones) == [0.5, 0.75]
    assert method_config("csghmc").fixed_members and method_config("csghmc_structure").fixed_members


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_the_field_jobs_are_the_authors_recipe(dataset, tmp_path):
    """resnet18/csghmc: cifar_csghmc.py's (cifar100_csghmc.py's) 200 epochs, batch 64, lr_0 0.5, alpha
    0.9, weight decay 5e-4, temperature 1/N, M = 4 cycles, 3 samples each; the other networks the same
    sampler, the cell network under the fair protocol's 100 epochs with its structure fixed."""

    def job(name):
        cfg = compose_config("train", [f"experiment={dataset}_field", f"field={name}", "seed=1"], tmp_path)
        validate_config(cfg)
        return cfg

    for backbone, epochs, net in (
        ("resnet18", 200, "ResNet18"),
        ("wrn28_10", 200, "WideResNet"),
        ("structure_net", 100, "StructureNet"),
    ):
        cfg = job(f"{backbone}/csghmc")
        sampler = cfg.model.sampler
        assert cfg.model._target_.endswith("CSGMCMC") and cfg.model.net._target_.endswith(net)
        assert (cfg.trainer.max_epochs, cfg.data.batch_size) == (epochs, 64)
        assert (sampler.lr, sampler.friction, sampler.weight_decay, sampler.temperature) == (0.5, 0.9, 5e-4, None)
        assert (sampler.schedule.cycles, sampler.schedule.exploration, sampler.schedule.samples_per_cycle) == (
            4,
            0.9,
            3,
        )
        assert not cfg.model.get("learn_structure", False)


@pytest.mark.slow
def test_compare_trains_and_tests_the_samplers(tmp_path):
    """`dbsn-compare --methods csghmc,csgld,csghmc_structure` on 96 digits in batches of 8 for 1 epoch (12
    steps: 4 cycles of 3 steps, each cycle's 3 samples a step apart), on a tiny cell network (cSGHMC with its
    structure fixed): each trains with its own schedule and tests with the samples it kept."""
    from dbsn.tools.compare import run_comparison

    methods = ["csghmc", "csgld", "csghmc_structure"]
    results = run_comparison(
        methods,
        epochs=1,
        output_dir=tmp_path,
        subset=96,
        batch_size=8,
        extra=[
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "trainer.limit_test_batches=1",
            "statistics.resamples=20",
        ],
        net_overrides=["num_nodes=3", "growth=4", "stem_channels=8"],
    )
    assert list(results) == methods
    for method, kept in zip(methods, (12, 12, 48)):  # the structure sampler: 4 chains' states
        assert {"test/error", "test/nll"} <= set(results[method]) and results[method]["train_seconds"] > 0
        facts = json.loads((tmp_path / method / "metrics.json").read_text())
        assert facts["samples_kept"] == facts["n_samples"] == kept, method


@pytest.mark.slow
def test_the_evaluation_suite_runs_on_it(tmp_path):
    """evaluate.py's OOD detection with every score (each sample's features and head), dataset shift on
    generated corruptions, conformal sets and the adversarial attacks (gradients through the samples), on
    cSGHMC: its members are networks of their own (the samples' state dicts). The structure sampler's members
    are kept structures under one network: only `prediction_structures` is its own (checked by hand and through
    evaluate.py's test pass above), the rest is DBSN's evaluation path (tests/evaluation/test_pipeline.py)."""
    run = tmp_path / "run"
    train(compose_config("train", [*_overrides("csghmc"), "test=false"], run), run)
    evaluate_the_whole_suite(run / "checkpoints" / "last.ckpt", tmp_path / "eval", tmp_path)
