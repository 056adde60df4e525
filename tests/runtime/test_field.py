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
TINY_NETS = {"resnet18": ["width=8"], "wrn28_10": ["depth=10", "widen_factor=1"],
             "structure_net": ["num_nodes=3", "cells_per_stage=1", "num_stages=2", "growth=8", "stem_channels=16"]}
CLASSES = {"map_fixed": "MAP", "mc_dropout": "MAP", "bbb": "MAP", "deep_ensemble": "DeepEnsemble", "dbsn": "DBSN",
           "batch_ensemble": "BatchEnsemble", "packed_ensemble": "PackedEnsemble", "mimo": "MIMO", "sngp": "SNGP",
           "rank1_bnn": "Rank1BNN", "csghmc": "CSGMCMC", "masksembles": "Masksembles", "ddu": "DDU"}
#: Masksembles' masks need 10 channels in a masked layer (the authors' limit): its tiny networks are a little wider.
TINY_NETS_OF = {"masksembles": {**TINY_NETS, "resnet18": ["width=10"],
                                "structure_net": ["num_nodes=3", "cells_per_stage=1", "num_stages=2", "growth=10",
                                                  "stem_channels=16"]}}
NETS = {"resnet18": "ResNet18", "wrn28_10": "WideResNet", "structure_net": "StructureNet"}


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
        assert {m for b, m in methods if b == backbone} == {"map_fixed", "mc_dropout", "bbb", "deep_ensemble",
                                                           "batch_ensemble", "rank1_bnn", "packed_ensemble", "mimo",
                                                           "sngp", "ddu", "csghmc", "masksembles"}
    assert {m for b, m in methods if b == "structure_net"} == {"dbsn", "map_fixed", "deep_ensemble", "batch_ensemble",
                                                              "rank1_bnn", "packed_ensemble", "mimo", "csghmc",
                                                              "masksembles"}
    for job in jobs:
        backbone, method = job.split("/")
        method = method.removesuffix("_cifar100")
        prefix = "model.member.net" if method == "deep_ensemble" else "model.net"
        tiny = TINY_NETS_OF.get(method, TINY_NETS)[backbone]
        job_cfg = compose_config("train", [f"experiment={dataset}_field", f"field={job}", "seed=1",
                                           *[f"{prefix}.{o}" for o in tiny]], tmp_path)  # tiny: to build
        validate_config(job_cfg)  # every key exists, every value has its type and range
        model = job_cfg.model.member if method == "deep_ensemble" else job_cfg.model
        assert job_cfg.model._target_.rsplit(".", 1)[-1] == CLASSES[method], job
        assert model.net._target_.rsplit(".", 1)[-1] == NETS[backbone], job
        lr = (model.sampler if method == "csghmc" else model.optim).lr  # cSGHMC's weights move by its sampler
        assert job_cfg.trainer.max_epochs >= 75 and lr > 0, job
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
    assert (r18.trainer.max_epochs, r18.data.batch_size, r18.model.optim.lr, r18.model.optim.weight_decay) == (75, 128, 0.05, 5e-4)
    assert (r18.model.size, r18.model.alpha, r18.model.gamma) == (4, 2, 2)
    dropout = job("wrn28_10/mc_dropout")
    assert (dropout.model.weights.p, dropout.model.weights.placement, dropout.model.prediction.n_samples) == (0.1, "existing", 30)
    assert job("wrn28_10/sngp_cifar100", "cifar100").model.gp.mean_field_factor == 12.5
    assert job("wrn28_10/sngp").model.gp.mean_field_factor != 12.5
    rank1 = job("wrn28_10/rank1_bnn")  # uncertainty-baselines rank1_bnn.py: 250 epochs, 128 new examples, lr 0.1, l2 1e-4
    assert (rank1.trainer.max_epochs, rank1.data.batch_size, rank1.model.optim.lr, rank1.model.optim.weight_decay) == (
        250, 128, 0.1, 2e-4)
    assert (rank1.model.size, rank1.model.prior, rank1.model.prior_stddev, rank1.model.kl_annealing) == (4, "normal", 0.1, 0.8)
    assert (rank1.model.random_sign_init, rank1.model.prediction.n_samples) == (0.5, 4)
    for backbone in ("resnet18", "wrn28_10"):  # DDU's train.py flags on both: 350 epochs, batch 128, x0.1 at 150, 250
        ddu = job(f"{backbone}/ddu")
        assert (ddu.trainer.max_epochs, ddu.data.batch_size, ddu.model.optim.lr, ddu.model.optim.weight_decay) == (
            350, 128, 0.1, 5e-4)
        assert [round(m * 350) for m in ddu.model.optim.milestones] == [150, 250] and not ddu.model.optim.nesterov
        assert (ddu.model.spectral_bound, ddu.model.leaky_relu_slope) == (3.0, 0.01)
    assert job("wrn28_10/ddu").model.net.dropout == 0.3  # their WideResNet's dropout_rate
    dbsn = job("structure_net/dbsn")  # the paper's run
    assert (dbsn.trainer.max_epochs, dbsn.data.batch_size, dbsn.model.train_samples, dbsn.model.net.cells_per_stage) == (100, 64, 4, 4)


def test_a_field_job_prints_its_config_on_the_command_line(tmp_path):
    result = run_python(ROOT / "train.py", "experiment=cifar10_field", "field=wrn28_10/batch_ensemble", "seed=2", "--cfg", "job",
                        cwd=tmp_path, timeout=120)
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
