"""The field's sweeps (experiment=cifar10_field / cifar100_field, conf/field/): every job composes,
passes the config checks, names its method and backbone, builds, and carries its source's recipe."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from dbsn.runtime.build import build_model
from dbsn.runtime.config import validate_config
from tests.support.configs import CONF, ROOT, compose_config
from tests.support.scripts import run_python

#: Each backbone's network made tiny for building (the recipe is left as it is).
TINY_NETS = {
    "resnet18": ["width=8"],
    "wrn28_10": ["depth=10", "widen_factor=1"],
    "structure_net": ["num_nodes=3", "cells_per_stage=1", "num_stages=2", "growth=8", "stem_channels=16"],
}
CLASSES = {
    "map_fixed": "MAP",
    "mc_dropout": "MAP",
    "bbb": "MAP",
    "deep_ensemble": "DeepEnsemble",
    "dbsn": "DBSN",
    "batch_ensemble": "BatchEnsemble",
    "packed_ensemble": "PackedEnsemble",
    "mimo": "MIMO",
    "sngp": "SNGP",
    "rank1_bnn": "Rank1BNN",
    "csghmc": "CSGMCMC",
    "masksembles": "Masksembles",
    "ddu": "DDU",
}
#: Masksembles' masks need 10 channels in a masked layer (the authors' limit): its tiny networks are a little wider.
TINY_NETS_OF = {
    "masksembles": {
        **TINY_NETS,
        "resnet18": ["width=10"],
        "structure_net": ["num_nodes=3", "cells_per_stage=1", "num_stages=2", "growth=10", "stem_channels=16"],
    }
}
NETS = {"resnet18": "ResNet18", "wrn28_10": "WideResNet", "structure_net": "StructureNet"}

#: the authors' epochs of every job (conf/field/), the default budget (budget=authors)
AUTHORS_EPOCHS = {
    "structure_net": dict.fromkeys(
        (
            "dbsn",
            "map_fixed",
            "deep_ensemble",
            "batch_ensemble",
            "rank1_bnn",
            "packed_ensemble",
            "masksembles",
            "mimo",
            "csghmc",
        ),
        100,
    ),
    "resnet18": {
        **dict.fromkeys(
            (
                "map_fixed",
                "mc_dropout",
                "bbb",
                "deep_ensemble",
                "batch_ensemble",
                "rank1_bnn",
                "packed_ensemble",
                "masksembles",
                "mimo",
                "sngp",
            ),
            75,
        ),
        "ddu": 350,
        "csghmc": 200,
    },
    "wrn28_10": {
        **dict.fromkeys(
            ("map_fixed", "mc_dropout", "bbb", "deep_ensemble", "packed_ensemble", "masksembles", "csghmc"), 200
        ),
        **dict.fromkeys(("batch_ensemble", "rank1_bnn", "mimo", "sngp"), 250),
        "ddu": 350,
    },
}
SHARED_EPOCHS = {"structure_net": 100, "resnet18": 200, "wrn28_10": 200}


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(cfg, resolve=True)
    out["trainer"].pop("max_epochs")
    out.pop("budget")
    return out


def sweep_params(dataset: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={dataset}_field"], return_hydra_config=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    return cfg, cfg.hydra.sweeper.params


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_every_job_of_the_field_sweep_composes_checks_and_builds(dataset, tmp_path):
    cfg, params = sweep_params(dataset)
    assert cfg.data._target_.endswith("CIFAR10DataModule" if dataset == "cifar10" else "CIFAR100DataModule")
    jobs = params.field.split(",")
    assert params.seed.split(",") == ["1", "2", "3"] and len(jobs) == len(set(jobs)) == 33
    methods = {(job.split("/")[0], job.split("/")[1].removesuffix("_cifar100")) for job in jobs}
    for backbone in ("resnet18", "wrn28_10"):  # every rival and the paper's baselines on both backbones
        assert {m for b, m in methods if b == backbone} == {
            "map_fixed",
            "mc_dropout",
            "bbb",
            "deep_ensemble",
            "batch_ensemble",
            "rank1_bnn",
            "packed_ensemble",
            "mimo",
            "sngp",
            "ddu",
            "csghmc",
            "masksembles",
        }
    assert {m for b, m in methods if b == "structure_net"} == {
        "dbsn",
        "map_fixed",
        "deep_ensemble",
        "batch_ensemble",
        "rank1_bnn",
        "packed_ensemble",
        "mimo",
        "csghmc",
        "masksembles",
    }
    for job in jobs:
        backbone, method = job.split("/")
        method = method.removesuffix("_cifar100")
        prefix = "model.member.net" if method == "deep_ensemble" else "model.net"
        tiny = TINY_NETS_OF.get(method, TINY_NETS)[backbone]
        job_cfg = compose_config(
            "train",
            [f"experiment={dataset}_field", f"field={job}", "seed=1", *[f"{prefix}.{o}" for o in tiny]],
            tmp_path,
        )  # tiny: to build
        validate_config(job_cfg)  # every key exists, every value has its type and range
        model = job_cfg.model.member if method == "deep_ensemble" else job_cfg.model
        assert job_cfg.model._target_.rsplit(".", 1)[-1] == CLASSES[method], job
        assert model.net._target_.rsplit(".", 1)[-1] == NETS[backbone], job
        lr = (model.sampler if method == "csghmc" else model.optim).lr  # cSGHMC's weights move by its sampler
        assert job_cfg.trainer.max_epochs >= 75 and lr > 0, job
        authors = 200 if job.startswith("resnet18/") and job.endswith("_cifar100") else AUTHORS_EPOCHS[backbone][method]
        assert (job_cfg.budget.recipe, job_cfg.trainer.max_epochs) == ("authors", authors), job  # the default budget
        if dataset == "cifar10":  # the same classes and settings on CIFAR-100 (the checks above cover its keys)
            torch.manual_seed(0)
            assert type(build_model(job_cfg.model, num_classes=10)).__name__ == CLASSES[method], job


def test_the_field_recipes_follow_their_sources(tmp_path):
    """Spot checks of the published recipes (the files name the source of each setting)."""

    def job(name, dataset="cifar10"):
        return compose_config("train", [f"experiment={dataset}_field", f"field={name}"], tmp_path)

    det = job("wrn28_10/map_fixed")  # uncertainty-baselines deterministic.py: 200 epochs, batch 512, lr 0.1 x 4
    assert (det.trainer.max_epochs, det.data.batch_size, det.model.optim.lr) == (200, 512, 0.4)
    assert list(det.model.optim.milestones) == [0.3, 0.6, 0.8] and det.model.optim.gamma == 0.2
    assert det.model.optim.warmup_epochs == 1 and det.model.optim.nesterov and det.model.optim.grad_clip_norm is None
    ens = job("wrn28_10/deep_ensemble")
    assert ens.model.size == 4 and ens.model.member.optim == det.model.optim
    r18 = job("resnet18/packed_ensemble")  # torch-uncertainty resnet18/packed.yaml
    assert (r18.trainer.max_epochs, r18.data.batch_size, r18.model.optim.lr, r18.model.optim.weight_decay) == (
        75,
        128,
        0.05,
        5e-4,
    )
    assert (r18.model.size, r18.model.alpha, r18.model.gamma) == (4, 2, 2)
    dropout = job("wrn28_10/mc_dropout")
    assert (dropout.model.weights.p, dropout.model.weights.placement, dropout.model.prediction.n_samples) == (
        0.1,
        "existing",
        30,
    )
    assert job("wrn28_10/sngp_cifar100", "cifar100").model.gp.mean_field_factor == 12.5
    assert job("wrn28_10/sngp").model.gp.mean_field_factor != 12.5
    rank1 = job(
        "wrn28_10/rank1_bnn"
    )  # uncertainty-baselines rank1_bnn.py: 250 epochs, 128 new examples, lr 0.1, l2 1e-4
    assert (rank1.trainer.max_epochs, rank1.data.batch_size, rank1.model.optim.lr, rank1.model.optim.weight_decay) == (
        250,
        128,
        0.1,
        2e-4,
    )
    assert (rank1.model.size, rank1.model.prior, rank1.model.prior_stddev, rank1.model.kl_annealing) == (
        4,
        "normal",
        0.1,
        0.8,
    )
    assert (rank1.model.random_sign_init, rank1.model.prediction.n_samples) == (0.5, 4)
    for backbone in ("resnet18", "wrn28_10"):  # DDU's train.py flags on both: 350 epochs, batch 128, x0.1 at 150, 250
        ddu = job(f"{backbone}/ddu")
        assert (ddu.trainer.max_epochs, ddu.data.batch_size, ddu.model.optim.lr, ddu.model.optim.weight_decay) == (
            350,
            128,
            0.1,
            5e-4,
        )
        assert [round(m * 350) for m in ddu.model.optim.milestones] == [150, 250] and not ddu.model.optim.nesterov
        assert (ddu.model.spectral_bound, ddu.model.leaky_relu_slope) == (3.0, 0.01)
    assert job("wrn28_10/ddu").model.net.dropout == 0.3  # their WideResNet's dropout_rate
    dbsn = job("structure_net/dbsn")  # the paper's run
    assert (
        dbsn.trainer.max_epochs,
        dbsn.data.batch_size,
        dbsn.model.train_samples,
        dbsn.model.net.cells_per_stage,
    ) == (100, 64, 4, 4)


def test_a_field_job_prints_its_config_on_the_command_line(tmp_path):
    result = run_python(
        ROOT / "train.py",
        "experiment=cifar10_field",
        "field=wrn28_10/batch_ensemble",
        "seed=2",
        "--cfg",
        "job",
        cwd=tmp_path,
        timeout=120,
    )
    assert "_target_: dbsn.methods.BatchEnsemble" in result.stdout and "_target_: dbsn.nets.WideResNet" in result.stdout
    assert "max_epochs: 250" in result.stdout and "seed: 2" in result.stdout


def test_the_cell_network_jobs_follow_the_fair_protocol(tmp_path):
    """On DBSN's cell network every job shares the paper's epochs, batch and schedule shape, and the
    rivals keep their authors' relative settings (compare's fair protocol): MIMO sums its members' NLLs
    with ub's optimiser, Packed-Ensembles keeps tu's, BatchEnsemble ub's with its fast-weight settings."""

    def job(name):
        return compose_config("train", ["experiment=cifar10_field", f"field=structure_net/{name}"], tmp_path)

    for name in ("dbsn", "map_fixed", "deep_ensemble", "batch_ensemble", "rank1_bnn", "packed_ensemble", "mimo"):
        cfg = job(name)
        optim = cfg.model.member.optim if name == "deep_ensemble" else cfg.model.optim
        assert (cfg.trainer.max_epochs, cfg.data.batch_size) == (100, 64), name
        assert (list(optim.milestones), optim.gamma) == ([0.5, 0.75], 0.1), name
    for name in ("batch_ensemble", "rank1_bnn", "packed_ensemble", "mimo"):
        own = compose_config("train", [f"model={name}"], tmp_path).model
        cfg = job(name).model
        for key in ("lr", "momentum", "nesterov", "weight_decay", "grad_clip_norm", "warmup_epochs"):
            assert cfg.optim[key] == own.optim[key], (name, key)
    assert job("mimo").model.member_loss == "sum"
    assert job("batch_ensemble").model.fast_weight_lr_multiplier == 0.5
    for backbone in ("structure_net", "resnet18"):  # the initialisation measured (docs/field.md): the authors'
        cfg = compose_config("train", ["experiment=cifar10_field", f"field={backbone}/batch_ensemble"], tmp_path)
        assert cfg.model.random_sign_init == -0.5, backbone


def test_the_shared_budget_gives_every_method_on_a_backbone_the_same_epochs(tmp_path):
    """budget=shared: one length per backbone for every job of both sweeps (CIFAR-100's: the jobs
    whose files differ from CIFAR-10's), and nothing else of a recipe changes (a job of each kind of
    schedule against its authors' recipe); the authors' epochs are checked for every job in
    `test_every_job_of_the_field_sweep_composes_checks_and_builds`."""
    seen = set()
    for dataset in ("cifar10", "cifar100"):
        _, params = sweep_params(dataset)
        jobs = [job for job in params.field.split(",") if job not in seen]
        assert len(jobs) == (33 if dataset == "cifar10" else 11)  # CIFAR-100: ResNet-18's recipes and SNGP's
        epochs = {}
        for job in jobs:
            backbone = job.split("/")[0]
            shared = compose_config("train", [f"experiment={dataset}_field", f"field={job}", "budget=shared"], tmp_path)
            assert (shared.budget.recipe, shared.budget.backbone) == ("shared", backbone), job
            epochs.setdefault(backbone, set()).add(shared.trainer.max_epochs)
        assert epochs == {b: {SHARED_EPOCHS[b]} for b in epochs}, (dataset, epochs)
        seen |= set(jobs)
    for job in (
        "structure_net/dbsn",
        "resnet18/csghmc",
        "resnet18/rank1_bnn",
        "wrn28_10/deep_ensemble",
        "wrn28_10/ddu",
        "wrn28_10/mimo",
    ):  # warm-up, cycles, KL annealing, milestones: fractions of the run, unchanged
        authors = compose_config("train", ["experiment=cifar10_field", f"field={job}", "budget=authors"], tmp_path)
        shared = compose_config("train", ["experiment=cifar10_field", f"field={job}", "budget=shared"], tmp_path)
        assert authors.budget.recipe == "authors" and _plain(shared) == _plain(authors), job
    validate_config(shared)


def test_the_cifar100_recipes_follow_torch_uncertainty_and_keep_the_methods_settings(tmp_path):
    """ResNet-18 on CIFAR-100: every job of torch-uncertainty's recipe trains 200 epochs at lr 0.1, x 0.2 at
    epochs 60, 120, 160 (their cifar100/configs/resnet18/*.yaml), with the CIFAR-10 job's method settings."""
    _, params = sweep_params("cifar100")
    jobs = [job for job in params.field.split(",") if job.startswith("resnet18/") and job.endswith("_cifar100")]
    assert len(jobs) == 10
    for job in jobs:
        c100 = compose_config("train", ["experiment=cifar100_field", f"field={job}"], tmp_path)
        c10 = compose_config("train", ["experiment=cifar10_field", f"field={job.removesuffix('_cifar100')}"], tmp_path)
        model, model10 = (c.model.member if "deep_ensemble" in job else c.model for c in (c100, c10))
        optim = model.optim
        assert (c100.trainer.max_epochs, c100.data.batch_size, optim.lr, optim.momentum, optim.weight_decay) == (
            200,
            128,
            0.1,
            0.9,
            5e-4,
        ), job
        assert optim.nesterov and optim.gamma == 0.2 and optim.warmup_epochs == 0 and optim.grad_clip_norm is None
        assert [round(m * c100.trainer.max_epochs) for m in optim.milestones] == [60, 120, 160], job
        settings = {k: v for k, v in model.items() if k not in ("optim", "gp")}
        assert settings == {k: v for k, v in model10.items() if k not in ("optim", "gp")}, job
    assert (
        compose_config(
            "train", ["experiment=cifar100_field", "field=resnet18/sngp_cifar100"], tmp_path
        ).model.gp.mean_field_factor
        == 12.5
    )


def test_ddu_holds_out_its_authors_validation_split(tmp_path):
    """DDU's authors train on 45,000 of CIFAR's 50,000 training images (val_size=0.1); the same held-out
    set for every seed, so that its seeds pool into one row; no validation pass while training."""
    for backbone in ("resnet18", "wrn28_10"):
        cfg = compose_config("train", ["experiment=cifar10_field", f"field={backbone}/ddu", "seed=2"], tmp_path)
        assert (cfg.data.val_size, cfg.data.split_seed, cfg.trainer.limit_val_batches) == (5000, 0, 0)
    assert compose_config("train", ["model=ddu"], tmp_path).data.val_size == 0  # plain model=ddu: every image


def test_a_budget_outside_the_field_or_unknown_is_refused_in_one_line(tmp_path):
    from dbsn.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="budget=shared .* names no backbone: it is for the field's jobs"):
        validate_config(compose_config("train", ["budget=shared"], tmp_path))
    with pytest.raises(ConfigError, match="budget.recipe=longest: expected authors or shared"):
        validate_config(
            compose_config(
                "train", ["experiment=cifar10_field", "field=resnet18/mimo", "budget.recipe=longest"], tmp_path
            )
        )
    with pytest.raises(ConfigError, match="no epochs for the backbone resnet18: add budget.epochs.resnet18"):
        validate_config(
            compose_config(
                "train",
                ["experiment=cifar10_field", "field=resnet18/mimo", "budget=shared", "~budget.epochs.resnet18"],
                tmp_path,
            )
        )
