"""Config checks (dbsn.runtime.config): bad configuration fails before training starts, naming
what would be valid; values that would change or break the method, and precisions that would,
are refused at config time.
"""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dbsn.runtime.build import build_model
from dbsn.runtime.config import ConfigError, check_trainer, validate_config
from dbsn.runtime.run import train
from tests.support.configs import CONF, ROOT, TINY, compose_config
from tests.support.scripts import run_python


@pytest.mark.parametrize("experiment", [None, "quick", "cifar10_paper", "cifar100_paper"])
@pytest.mark.parametrize("data", ["cifar10", "cifar100", "svhn", "digits"])
def test_every_shipped_config_validates(tmp_path, experiment, data):
    overrides = [f"data={data}"] + ([f"experiment={experiment}"] if experiment else [])
    cfg = compose_config("train", overrides, tmp_path)
    validate_config(cfg)


def test_paper_experiments_pin_the_paper_settings(tmp_path):
    for name, classes in (("cifar10_paper", 10), ("cifar100_paper", 100)):
        cfg = compose_config("train", [f"experiment={name}"], tmp_path)
        assert cfg.model.net.num_nodes == 7 and cfg.model.net.cells_per_stage * cfg.model.net.num_stages == 12
        assert cfg.model.train_samples == 4 and cfg.model.prediction.n_samples == 100
        assert cfg.trainer.max_epochs == 100 and cfg.data.batch_size == 64
        model = build_model(cfg.model, num_classes=classes)
        n_params = sum(p.numel() for p in model.net.parameters())
        assert 0.9e6 < n_params < 1.2e6, n_params


def test_quick_preset_is_the_small_model(tmp_path):
    cfg = compose_config("train", ["experiment=quick"], tmp_path)
    model = build_model(cfg.model, num_classes=10)
    n_params = sum(p.numel() for p in model.net.parameters())
    assert 30e3 < n_params < 55e3, n_params
    assert instantiate(cfg.data).__class__.__name__ == "DigitsDataModule"


def test_misspelled_key_names_the_valid_one(tmp_path):
    cfg = compose_config("train", ["+model.net.num_node=3"], tmp_path)
    with pytest.raises(ConfigError, match=r"model\.net: unknown key 'num_node'.*Did you mean 'num_nodes'"):
        validate_config(cfg)
    cfg = compose_config("train", ["+model.optim.learning_rate=0.1"], tmp_path)
    with pytest.raises(ConfigError, match="Valid keys: .*lr"):
        train(cfg, tmp_path)  # fails in the check, before anything is built


def test_overriding_a_missing_key_is_refused(tmp_path):
    with pytest.raises(ConfigCompositionException, match="max_epoch"):
        compose_config("train", ["trainer.max_epoch=3"], tmp_path)


def test_unknown_choice_lists_valid_choices(tmp_path):
    result = run_python(
        ROOT / "train.py", "model=dbsnn", f"hydra.run.dir={tmp_path}", cwd=tmp_path, timeout=120, check=False
    )
    assert result.returncode != 0
    assert "Could not find 'model/dbsnn'" in result.stderr
    assert "Available options in 'model'" in result.stderr and "dbsn" in result.stderr


def test_every_config_group_file_is_reachable():
    for group in ("data", "model", "trainer", "logger", "callbacks", "experiment"):
        assert list((CONF / group).glob("*.yaml")), group


def test_tiny_overrides_compose(tmp_path):
    validate_config(compose_config("train", ["experiment=quick", *TINY], tmp_path))


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_sweep_experiment_holds_the_paper_classification_sweep(dataset, tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={dataset}_sweep"], return_hydra_config=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    params = cfg.hydra.sweeper.params
    assert params.model.split(",") == ["dbsn", "map", "map_fixed", "mc_dropout", "bbb", "fbn"]
    assert params.seed.split(",") == ["1", "2", "3"]
    assert cfg.data._target_.endswith("CIFAR10DataModule" if dataset == "cifar10" else "CIFAR100DataModule")
    for model in params.model.split(","):  # every job of the sweep composes and validates
        validate_config(compose_config("train", [f"data={dataset}", f"model={model}"], tmp_path))


@pytest.mark.parametrize(
    "model",
    [
        "dbsn",
        "fbn",
        "map",
        "map_fixed",
        "mc_dropout",
        "bbb",
        "deep_ensemble",
        "vogn",
        "vogn_fbn",
        "batch_ensemble",
        "packed_ensemble",
        "mimo",
        "sngp",
    ],
)
def test_every_method_config_builds(model, tmp_path):
    prefix = "model.member.net" if model == "deep_ensemble" else "model.net"
    net = [] if model in ("dbsn", "fbn", "vogn", "vogn_fbn", "deep_ensemble") else ["model/net=structure_net"]
    cfg = compose_config(
        "train",
        [f"model={model}", *net, f"{prefix}.num_nodes=3", f"{prefix}.cells_per_stage=1", f"{prefix}.compression=0.5"],
        tmp_path,
    )  # 0.5: channel counts the packed groups divide
    validate_config(cfg)
    method = build_model(cfg.model, num_classes=10)
    assert method.is_stochastic == (model not in ("map", "map_fixed", "sngp"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.train_samples=abc", r"model\.train_samples='abc': expected int, got str"),
        ("model.prediction.n_samples=2.5", r"model\.prediction\.n_samples=2\.5: expected int, got float"),
        ("trainer.max_epochs=ten", r"trainer\.max_epochs='ten': expected int"),
        ("data.batch_size=true", r"data\.batch_size=True: expected int, got bool"),
        ("model.parallel=model", r"model\.parallel='model': expected one of 'data', 'structure'"),
        ("seed=first", r"seed='first': expected int or null, got str"),
        ("resume=maybe", r"resume='maybe': expected bool, got str"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key_and_the_type(tmp_path, override, message):
    cfg = compose_config("train", ["experiment=quick", override], tmp_path)
    with pytest.raises(ConfigError, match=message):
        train(cfg, tmp_path)  # refused in the check, before data or model are built


def test_values_of_the_right_type_pass_the_type_check(tmp_path):
    cfg = compose_config(
        "train",
        [
            "experiment=quick",
            "model.tau.decay=1",
            "model.test_tau=2",
            "trainer.devices=auto",
            "trainer.precision=bf16-mixed",
            "seed=null",
        ],
        tmp_path,
    )
    validate_config(cfg)  # an int where a float is expected, Trainer's str-or-int unions, a null seed


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("model.tau.decay=nan", "model.tau.decay=nan: expected a finite number"),
        ("model.beta.decay_per_epoch=-0.1", "model.beta: BetaSchedule.decay_per_epoch must be >= 0"),
        ("model.tau.minimum=0", "model.tau: TauSchedule.minimum must be > 0"),
        ("model.optim.lr=inf", "model.optim.lr=inf: expected a finite number"),
        ("trainer.sync_batchnorm=true", "trainer.sync_batchnorm=true is refused: model.net (StructureNet)"),
    ],
)
def test_values_that_would_change_or_break_the_method_are_refused_at_config_time(override, message, tmp_path):
    """Out-of-range schedules fail before training (not as a NaN loss at step 0); the settings
    objects' own checks run at config time. SyncBatchNorm would pool the per-structure statistics."""
    from dbsn.runtime.config import validate_config
    from tests.support.configs import compose_config

    with pytest.raises(ConfigError) as error:
        validate_config(compose_config("train", ["experiment=quick", override], tmp_path))
    assert str(error.value).startswith(message)


# ---------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision", ["16-mixed", 16, "16", "bf16-true", "16-true", "half", "transformer-engine"])
def test_precisions_that_change_the_method_are_refused(precision):
    with pytest.raises(ConfigError, match="trainer.precision=.* is refused.*bf16-mixed"):
        check_trainer(OmegaConf.create({"precision": precision}))


@pytest.mark.parametrize("precision", ["32-true", 32, "bf16-mixed", "bf16", "64-true", None])
def test_supported_precisions_pass(precision):
    check_trainer(OmegaConf.create({"precision": precision}))


def test_the_fast_preset_turns_on_bf16_not_compile_and_leaves_the_layout_to_auto(tmp_path, monkeypatch):
    import dbsn.runtime.config as config
    from dbsn.runtime.config import resolve_channels_last, validate_config
    from tests.support.configs import compose_config

    cfg = compose_config("train", ["experiment=cifar10_paper", "trainer=gpu", "speed=fast"], tmp_path)
    assert cfg.trainer.precision == "bf16-mixed" and not cfg.model.execution.compile.enabled
    assert (cfg.model.execution.conv_1x1, cfg.model.execution.depthwise) == ("auto", "conv")  # measured fastest
    assert cfg.model.execution.channels_last == "auto"
    assert cfg.model.net.num_nodes == 7 and cfg.trainer.accelerator == "gpu"  # the experiment is kept
    resolve_channels_last(cfg)
    assert cfg.model.execution.channels_last is False  # contiguous on a GPU
    plain = compose_config("train", ["experiment=quick"], tmp_path)
    resolve_channels_last(plain)
    assert plain.model.execution.channels_last is False  # eager on a CPU: contiguous (measured faster)
    compiled = compose_config("train", ["experiment=quick", "model.execution.compile.enabled=true"], tmp_path)
    resolve_channels_last(compiled)
    assert compiled.model.execution.channels_last is True  # compiled on a CPU: channels-last
    monkeypatch.setattr(config, "cpu_bf16_channels_last_is_wrong", lambda: True)
    cpu = compose_config("train", ["experiment=quick", "speed=fast", "model.execution.compile.enabled=true"], tmp_path)
    resolve_channels_last(cpu)
    assert cpu.model.execution.channels_last is False  # auto avoids the wrong gradients
    forced = compose_config("train", ["experiment=quick", "speed=fast", "model.execution.channels_last=true"], tmp_path)
    with pytest.raises(ConfigError, match="refused on this CPU"):
        validate_config(forced)


def test_a_cuda_graph_is_refused_before_training_where_it_cannot_run(tmp_path):
    """`model.execution.cuda_graph=true` on the CPU: one line, before anything is built; `auto` (what
    speed=fast sets) trains eagerly there, and on an ensemble `auto` is dropped, not refused as an
    unknown key."""
    from dbsn.runtime.config import ConfigError

    cfg = compose_config("train", ["data=digits", "trainer=cpu", "model.execution.cuda_graph=true"], tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"model.execution.cuda_graph=true captures the training step on a CUDA "
        r"device, and this run trains on the CPU",
    ):
        validate_config(cfg)
    validate_config(compose_config("train", ["data=digits", "trainer=cpu", "speed=fast"], tmp_path))
    ensemble = compose_config("train", ["data=digits", "trainer=cpu", "model=deep_ensemble", "speed=fast"], tmp_path)
    validate_config(ensemble)
    assert "execution" not in ensemble.model


def test_the_package_config_tree_is_found_as_pkg_dbsn_conf(tmp_path):
    """Hydra finds dbsn's configs through the package (`pkg://dbsn.conf`), as an installed wheel's user would;
    they are the same files as `dbsn.CONF_DIR`'s."""
    from hydra import compose, initialize_config_module

    overrides = ["experiment=quick", f"paths.output_dir={tmp_path}"]
    with initialize_config_module(config_module="dbsn.conf", version_base="1.3"):
        from_package = compose(config_name="train", overrides=overrides)
    assert from_package.model._target_ == "dbsn.methods.DBSN"
    assert from_package == compose_config("train", ["experiment=quick"], tmp_path)
