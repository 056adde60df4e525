"""The all-methods comparison runs end to end on any dataset and tabulates every method."""

from __future__ import annotations

import json
import math

import pytest

from dbsn.data import DatasetNotFoundError
from dbsn.methods.registry import method_config
from dbsn.runtime.config import validate_config
from dbsn.tools import compare
from dbsn.tools.compare import (
    compared_methods,
    epoch_size,
    main,
    method_overrides,
    run_comparison,
    shared_overrides,
    write_table,
)
from tests.support.configs import compose_config
from tests.support.fakedata import write_cifar10


def test_each_method_gets_its_schedule_compression_and_valid_overrides(tmp_path):
    for method in compared_methods():
        overrides = method_overrides(method, epochs=10, steps_per_epoch=21)
        has_tau = any(o.startswith("model.tau.decay=") for o in overrides)
        assert has_tau == (method in ("dbsn", "fbn", "vogn_fbn"))
        warmup = [o for o in overrides if o.startswith("model.vogn.kl_warmup_steps=")]
        assert warmup == (["model.vogn.kl_warmup_steps=21"] if method.startswith("vogn") else [])  # 10 % of 210
        validate_config(compose_config("train", [*overrides, *shared_overrides()], tmp_path))  # every key exists
    tau = next(o for o in method_overrides("dbsn", 10, 21) if o.startswith("model.tau.decay="))
    assert abs(3.0 * 2.718281828 ** (-float(tau.split("=")[1]) * 210) - 1.0) < 1e-3  # tau hits 1 at the end


@pytest.mark.parametrize("backbone", ["resnet18", "wrn28_10"])
def test_a_comparison_on_a_backbone_puts_every_method_but_the_cell_ones_on_it(backbone, tmp_path):
    from dbsn.tools.compare import BACKBONES

    target = {"resnet18": "dbsn.nets.ResNet18", "wrn28_10": "dbsn.nets.WideResNet"}[backbone]
    for method in (
        "dbsn",
        "map_fixed",
        "mc_dropout",
        "deep_ensemble",
        "batch_ensemble",
        "packed_ensemble",
        "mimo",
        "sngp",
    ):
        overrides = method_overrides(method, 10, 21, backbone=backbone)
        cfg = compose_config("train", [*overrides, *shared_overrides()], tmp_path)
        validate_config(cfg)
        net = (cfg.model.member if method == "deep_ensemble" else cfg.model).net
        assert net._target_ == ("dbsn.nets.StructureNet" if method == "dbsn" else target), method
        for setting in BACKBONES["structure_net" if method == "dbsn" else backbone]:  # the CPU size
            key, value = setting.split("=")
            assert str(net[key]) == value, (method, setting)
        optim = (cfg.model.member if method == "deep_ensemble" else cfg.model).optim  # the shared schedule's shape
        assert (optim.schedule, list(optim.milestones), optim.gamma) == ("multistep", [0.5, 0.75], 0.1), method
        shared = compose_config(
            "train",
            [*method_overrides(method, 10, 21, backbone=backbone, protocol="shared"), *shared_overrides()],
            tmp_path,
        )
        optim = (
            shared.model.member if method == "deep_ensemble" else shared.model
        ).optim  # one weight optimiser for all
        assert (optim.lr, optim.weight_decay, optim.nesterov, list(optim.milestones), optim.warmup_epochs) == (
            0.1,
            1e-4,
            False,
            [0.5, 0.75],
            0,
        ), method
        if method == "mc_dropout":  # no cells: a placement that exists on this network
            assert cfg.model.weights.placement == ("every_conv" if backbone == "resnet18" else "existing")


@pytest.mark.parametrize("batch_size", [32, 64, 128])
def test_tau_reaches_one_after_the_examples_of_the_whole_run(batch_size):
    """tau's progress is examples seen / 64: 10 epochs of 21 steps of `batch_size` images."""
    overrides = method_overrides("fbn", 10, 21, batch_size=batch_size)
    decay = float(next(o for o in overrides if o.startswith("model.tau.decay=")).split("=")[1])
    assert abs(3.0 * math.exp(-decay * 210 * batch_size / 64) - 1.0) < 1e-3
    assert "model.vogn.kl_warmup_steps=21" in method_overrides("vogn", 10, 21, batch_size=batch_size)  # steps


def compose_data(overrides: list[str], tmp_path):
    return compose_config("train", overrides, tmp_path).data


@pytest.mark.parametrize(
    "subset, drop_last, steps", [(640, True, 10), (650, True, 10), (650, False, 11), (None, True, 21)]
)
def test_steps_per_epoch_come_from_the_data_modules_training_images(tmp_path, subset, drop_last, steps):
    data = compose_data([*shared_overrides("digits", 64, subset), f"data.drop_last={drop_last}"], tmp_path)
    assert epoch_size(data) == (subset or 1347, steps)


def test_steps_per_epoch_on_cifar_format_files_after_the_validation_split(tmp_path):
    write_cifar10(tmp_path / "cifar", n_train=200, n_test=20)
    root = f"data.root={tmp_path / 'cifar'}"
    assert epoch_size(compose_data([*shared_overrides("cifar10", 16), root], tmp_path)) == (200, 12)
    assert epoch_size(compose_data([*shared_overrides("cifar10", 16), root, "data.val_size=40"], tmp_path)) == (160, 10)
    assert epoch_size(compose_data([*shared_overrides("cifar10", 16, 0.5), root], tmp_path)) == (100, 6)


def test_missing_dataset_or_bad_subset_fails_before_any_training(tmp_path, monkeypatch):
    monkeypatch.setattr("dbsn.runtime.run.train", lambda *args: pytest.fail("trained before checking the data"))
    with pytest.raises(DatasetNotFoundError, match="data_batch_1"):
        run_comparison(["dbsn", "map"], output_dir=tmp_path, data="cifar10", extra=[f"data.root={tmp_path / 'absent'}"])
    with pytest.raises(ValueError, match="data.train_subset=2000.*1347 training images"):
        run_comparison(["map"], output_dir=tmp_path, subset=2000)


def test_cli_passes_dataset_subset_and_overrides(monkeypatch):
    calls = []
    monkeypatch.setattr(compare, "run_comparison", lambda *args, **kwargs: calls.append((args, kwargs)))
    main(
        ["--data", "cifar10", "--subset", "5000", "--epochs", "3", "--samples", "10", "data.root=/data", "trainer=gpu"]
    )
    main(["--subset", "0.1"])
    ((_, epochs, _, overrides), kwargs), (_, fraction) = calls
    assert (epochs, overrides) == (3, ["data.root=/data", "trainer=gpu"])
    assert (kwargs["data"], kwargs["subset"], kwargs["n_samples"]) == ("cifar10", 5000, 10)
    assert (fraction["data"], fraction["subset"], fraction["n_samples"]) == ("digits", 0.1, 100)
    assert shared_overrides("cifar10", 64, 5000) == [
        "trainer=cpu",
        "data=cifar10",
        "data.batch_size=64",
        "data.train_subset=5000",
    ]  # the config's num_workers


def test_an_extra_trainer_override_replaces_the_cpu_default(tmp_path):
    assert compose_config("train", shared_overrides("digits"), tmp_path).trainer.accelerator == "cpu"
    assert compose_config("train", [*shared_overrides("digits"), "trainer=gpu"], tmp_path).trainer.accelerator == "gpu"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "cifar11"], "unknown dataset 'cifar11'; choose from cifar10, cifar100, digits, svhn"),
        (["--data", "camvid"], "unknown dataset 'camvid'"),
        (["data=cifar10"], "--data"),
    ],
)
def test_unknown_or_overridden_dataset_is_refused_with_the_choices(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_table_title_and_json_carry_the_dataset_and_subset(tmp_path, capsys):
    results = {"map": {"test/error": 0.1, "test/nll": 0.3, "test/brier": 0.2, "test/ece": 0.05, "train_seconds": 60.0}}
    write_table(results, tmp_path, epochs=10, batch_size=64, data="cifar10", train_subset=5000)
    assert "cifar10, a 5000-image training subset" in " ".join(capsys.readouterr().out.split())
    written = json.loads((tmp_path / "comparison.json").read_text())
    assert (written["data"], written["train_subset"], written["results"]) == ("cifar10", 5000, results)
    write_table(results, tmp_path, epochs=10)
    assert "digits, 10 epochs" in capsys.readouterr().out
    assert json.loads((tmp_path / "comparison.json").read_text())["train_subset"] is None


def test_the_table_says_where_an_estimate_lies_outside_its_interval(tmp_path):
    results = {
        "map": {
            "test/error": 0.1,
            "test/ce2": 0.004,
            "train_seconds": 60.0,
            "intervals": {"test/error": [0.05, 0.15], "test/ce2": [0.005, 0.009]},
        }
    }
    table = write_table(results, tmp_path, epochs=10)
    assert "10.00 [5.00, 15.00] |" in table  # inside: the interval alone
    assert "0.00400 [0.00500, 0.00900] (the estimate lies outside its interval" in table


def test_the_paired_reference_is_named_as_the_report_names_it():
    """On a residual network the report names a run `<method>@<backbone>`: without the suffix the
    reference matched no run and the paired section was left out."""
    assert compare.reference_name(["map_fixed", "mimo"], "resnet18") == "map_fixed@resnet18"
    assert compare.reference_name(["mimo", "dbsn"], "resnet18") == "dbsn"  # DBSN trains its cells on any backbone
    assert compare.reference_name(["map_fixed", "mimo"], "structure_net") == "map_fixed"


def test_unknown_method_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["--methods", "dbsn,vgon"])
    assert "unknown method(s) ['vgon']" in capsys.readouterr().err


@pytest.mark.slow
def test_comparison_runs_every_method(tmp_path):
    """Every method but the cyclical samplers, which keep samples in each of 4 cycles, more steps than these runs
    have (their own comparison is in tests/methods/test_csgmcmc.py), on cells 4 channels wide; Masksembles, whose
    masked layers need MIN_CHANNELS (the authors' 10), in a second comparison on cells that wide (all methods on
    them took 40 % longer)."""
    from dbsn.methods import Masksembles
    from dbsn.nets.masksembles import MIN_CHANNELS

    methods = [m for m in compared_methods() if "sampler" not in method_config(m).config]
    masked = [m for m in methods if issubclass(method_config(m).cls, Masksembles)]
    assert masked == ["masksembles"]
    settings = dict(
        epochs=1,
        n_samples=3,
        extra=[
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "trainer.limit_train_batches=2",
            "trainer.limit_test_batches=1",
        ],
    )
    for group, width, out in (
        ([m for m in methods if m not in masked], (4, 8), tmp_path),
        (masked, (MIN_CHANNELS, MIN_CHANNELS), tmp_path / "masked"),
    ):
        results = run_comparison(
            group,
            output_dir=out,
            **settings,
            net_overrides=["num_nodes=3", f"growth={width[0]}", f"stem_channels={width[1]}"],
        )
        assert list(results) == group
        table = (out / "comparison.md").read_text()
        for method in group:
            assert f"| {method} |" in table
            assert {"test/error", "test/nll", "test/ece"} <= set(results[method])
            assert results[method]["train_seconds"] > 0
        assert json.loads((out / "comparison.json").read_text())["results"] == results


def test_evaluation_passes_reuse_the_trainer_and_route_evaluate_overrides(tmp_path):
    from dbsn.tools.compare import evaluation_passes

    train = [*shared_overrides("digits"), "trainer=gpu", "statistics.resamples=50", "seed=3", "model.x=1"]
    passes = evaluation_passes(
        ["ood", "shift", "conformal"],
        ["temperature", "dirichlet"],
        ["photos", "noise"],
        "digits",
        tmp_path,
        train,
        ["ood.noise.size=32", "n_samples=3", "posthoc.calibrator.map=diagonal"],
    )
    assert list(passes) == ["evaluations", "posthoc=temperature", "posthoc=dirichlet"]
    assert passes["evaluations"] == [
        "trainer=cpu",
        "trainer=gpu",
        "statistics.resamples=50",
        "evaluations=[ood,shift,conformal]",
        "ood=[photos,noise]",
        "evaluations.shift.generate=true",
        f"evaluations.shift.root={tmp_path.resolve() / 'digits-C'}",
        "ood.noise.size=32",
        "n_samples=3",
    ]
    assert passes["posthoc=dirichlet"] == [
        "trainer=cpu",
        "trainer=gpu",
        "statistics.resamples=50",
        "posthoc=dirichlet",
        "n_samples=3",
        "posthoc.calibrator.map=diagonal",
    ]
    cifar = evaluation_passes(["shift"], data="cifar10", output_dir=tmp_path)["evaluations"]
    assert cifar == ["evaluations=[shift]"]  # the published CIFAR-10-C under the data root
    assert evaluation_passes() == {}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "cifar10", "--evaluations", "ood"], "--evaluations ood on cifar10 needs --ood"),
        (["--ood", "noise"], "--ood noise chooses the sets of the ood evaluation, which is not chosen"),
        (["--evaluations", "ood,drift"], "unknown --evaluations ['drift']"),
        (["--posthoc", "platt"], "unknown --posthoc ['platt']"),
        (["--evaluations", "ood", "--ood", "svhm"], "unknown --ood ['svhm']"),
    ],
)
def test_evaluation_choices_are_refused_before_anything_trains(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(compare, "run_comparison", lambda *args, **kwargs: pytest.fail("trained before refusing"))
    with pytest.raises(SystemExit):
        main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the usage, then one line
    assert "error:" in last and message in last


def test_a_bad_evaluate_override_or_no_validation_split_fails_before_any_training(tmp_path, monkeypatch):
    from dbsn.runtime.config import ConfigError

    monkeypatch.setattr("dbsn.runtime.run.train", lambda *args: pytest.fail("trained before checking the evaluations"))
    with pytest.raises(ConfigError, match="evaluate.py's config"):
        run_comparison(["map"], output_dir=tmp_path, evaluations=["ood"], evaluate_extra=["ood.nosie.size=3"])
    with pytest.raises(ConfigError, match="data.val_size=0 leaves none"):
        run_comparison(["map"], output_dir=tmp_path, posthoc=["temperature"], extra=["data.val_size=0"])


@pytest.mark.slow
def test_one_command_trains_evaluates_and_calibrates_every_method_into_the_report(tmp_path, capsys):
    """Two cheap methods on a tiny network, 1 epoch on 128 images, S = 2; the evaluations made
    small through the evaluate overrides; SWAG does not apply (no moments collected): skipped."""
    cheap = [
        "ood.photos.size=32",
        "ood.noise.size=32",
        "evaluations.ood.scores=[max_logit]",
        "evaluations.ood.fit_images=64",
        "evaluations.shift.corruptions=[contrast]",
        "evaluations.shift.severities=[1]",
        "ablation.sizes=[]",
    ]
    run_comparison(
        ["map", "mc_dropout"],
        epochs=1,
        output_dir=tmp_path,
        subset=128,
        n_samples=2,
        net_overrides=["num_nodes=3", "growth=4", "stem_channels=8"],
        extra=["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "statistics.resamples=20"],
        evaluations=["ood", "shift", "conformal"],
        posthoc=["temperature", "swag"],
        evaluate_extra=cheap,
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "every method trains with data.val_size=0.15" in out
    assert out.count("posthoc=swag skipped for") == 2
    for method in ("map", "mc_dropout"):
        run = tmp_path / method
        for evaluation in ("ood", "shift", "conformal"):
            assert (run / "evaluation" / evaluation).is_dir(), (method, evaluation)
        record = json.loads((run / "evaluation" / "metrics.json").read_text())
        assert record["n_samples"] == (2 if method == "mc_dropout" else 1)  # the run's own S
        assert (run / "posthoc" / "temperature" / "metrics.json").is_file() and not (run / "posthoc" / "swag").exists()
    assert json.loads((tmp_path / "digits-C" / "GENERATED.json").read_text())  # generated once, beside the runs
    report = (tmp_path / "report" / "report.md").read_text()
    for section in ("## Conformal prediction sets", "## OOD detection by score and method", "## Post-hoc calibrators"):
        assert section in report, section


def test_cli_passes_the_evaluations_posthoc_and_evaluate_overrides(monkeypatch):
    calls = []
    monkeypatch.setattr(compare, "run_comparison", lambda *args, **kwargs: calls.append(kwargs))
    main(
        [
            "--evaluations",
            "ood,shift,conformal",
            "--posthoc",
            "temperature,isotonic",
            "--evaluate-overrides",
            "ood.noise.size=32 evaluations.ood.scores=[energy,knn]",
            "--evaluate-overrides",
            "n_samples=3",
            "trainer=gpu",
        ]
    )
    main(["--data", "cifar10", "--evaluations", "ood", "--ood", "svhn,cifar100"])
    first, second = calls
    assert (first["evaluations"], first["posthoc"], first["ood"]) == (
        ["ood", "shift", "conformal"],
        ["temperature", "isotonic"],
        None,
    )
    assert first["evaluate_extra"] == ["ood.noise.size=32", "evaluations.ood.scores=[energy,knn]", "n_samples=3"]
    assert (second["ood"], second["posthoc"], second["evaluate_extra"]) == (["svhn", "cifar100"], [], [])


# ---------------------------------------------------------------------- the fair protocol and the lr search
def test_the_fair_protocol_keeps_each_methods_own_settings_and_shares_the_schedule(tmp_path):
    """Fair: MIMO sums its members' NLLs and Packed-Ensembles, BatchEnsemble and SNGP keep their own
    optimiser settings (the authors'), every method the schedule's shape; a tuned lr reaches each
    method's own optimiser. Shared: the paper's recipe for all, MIMO's mean."""
    from hydra.utils import get_class

    def model(method, **kwargs):
        backbone = "structure_net" if method.startswith("vogn") else "resnet18"  # VOGN: the cell network's
        cfg = compose_config(
            "train", [*method_overrides(method, 10, 21, backbone=backbone, **kwargs), *shared_overrides()], tmp_path
        )
        validate_config(cfg)
        return cfg.model

    own = {
        m: compose_config("train", [f"model={m}", "model/net=resnet18", *shared_overrides()], tmp_path).model.optim
        for m in ("packed_ensemble", "batch_ensemble", "sngp")
    }
    for method, recipe in own.items():
        fair = model(method).optim
        assert (fair.lr, fair.weight_decay, fair.nesterov, fair.momentum) == (
            recipe.lr,
            recipe.weight_decay,
            recipe.nesterov,
            recipe.momentum,
        ), method
    assert model("mimo").member_loss == "sum" and model("mimo", protocol="shared").member_loss == "mean"
    assert model("packed_ensemble", lr=0.4).optim.lr == 0.4 and model("mimo", lr=0.025).optim.lr == 0.025
    assert model("deep_ensemble", lr=0.2).member.optim.lr == 0.2
    assert compare.lr_key("vogn") == "model.vogn.lr" and model("vogn", lr=0.02).vogn.lr == 0.02
    assert get_class(model("sngp")._target_).__name__ == "SNGP"


def test_the_search_picks_the_lowest_validation_nll():
    assert compare.choose({0.05: 0.9, 0.1: 0.7, 0.2: 0.8}) == 0.1
    assert compare.choose({0.05: 0.9, 0.1: math.inf, 0.2: 0.9}) == 0.05  # a tie: the smaller rate; divergence skipped
    with pytest.raises(compare.ConfigError, match="diverged or never validated"):
        compare.choose({0.1: math.inf})


def test_the_search_trains_every_rate_validates_and_never_reads_the_test_set(tmp_path, monkeypatch):
    """`tune` on digits: one run per rate, validated on the held-out split, none tested (the data
    module's test loader, poisoned, is never asked for); the choice is the lowest of the NLLs
    the runs' logs hold."""
    from dbsn.data.digits import DigitsDataModule

    def poisoned(self):
        raise AssertionError("the learning-rate search read the test set")

    monkeypatch.setattr(DigitsDataModule, "test_dataloader", poisoned)
    shared = [
        *shared_overrides("digits", 64, 200),
        "data.val_size=0.25",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
    ]
    record = compare.tune(
        "map_fixed",
        [0.02, 0.3],
        lambda lr: method_overrides(
            "map_fixed", 2, 3, net_overrides=["num_nodes=3", "growth=4", "stem_channels=8"], lr=lr
        ),
        shared,
        tmp_path,
        2,
    )
    nlls = {lr: compare.last_validation_nll(tmp_path / "tune" / "map_fixed" / f"lr_{lr:g}") for lr in (0.02, 0.3)}
    assert record["validation_nll"] == {"0.02": nlls[0.02], "0.3": nlls[0.3]} and all(
        math.isfinite(v) for v in nlls.values()
    )
    assert record["chosen"] == min(nlls, key=nlls.get)
    assert not list(tmp_path.rglob("metrics.json"))  # no run was tested


def test_a_second_seed_reuses_the_first_seeds_search(tmp_path):
    """`--tuned-from DIR`: each method's tuning.json of DIR, marked as reused (the report lists it
    once); a method without one, a second search or the shared protocol is refused in one line."""
    record = {"grid": [0.1, 0.4], "validation_nll": {"0.1": 0.5, "0.4": 0.3}, "chosen": 0.4, "key": "model.optim.lr"}
    (tmp_path / "mimo").mkdir()
    (tmp_path / "mimo" / compare.TUNING_FILE).write_text(json.dumps(record))
    reused = compare.reused_tuning(tmp_path, ["mimo"], "fair")
    assert reused == {"mimo": {**record, "reused_from": str(tmp_path)}}
    with pytest.raises(compare.ConfigError, match="no tuning.json for map_fixed"):
        compare.reused_tuning(tmp_path, ["mimo", "map_fixed"], "fair")
    with pytest.raises(compare.ConfigError, match="drop --protocol shared"):
        compare.reused_tuning(tmp_path, ["mimo"], "shared")
    with pytest.raises(compare.ConfigError, match="give one of them"):
        compare.run_comparison(["mimo"], 1, tmp_path / "out", lr_grid=[0.1], tuned_from=tmp_path)


@pytest.mark.slow
def test_tune_end_to_end_the_deep_ensemble_takes_its_members_search(tmp_path, caplog):
    """`--tune` through run_comparison: map_fixed searches the grid (its tuning runs beside, never
    tested), trains with the choice and writes tuning.json; the deep ensemble after it takes that
    search (its members are map_fixed networks) without one of its own; the report tables it once."""
    import logging

    caplog.set_level(logging.INFO)
    logging.getLogger("lightning.pytorch").propagate = True  # to caplog's handler
    run_comparison(
        ["map_fixed", "deep_ensemble"],
        epochs=1,
        output_dir=tmp_path,
        subset=128,
        n_samples=2,
        net_overrides=["num_nodes=3", "growth=4", "stem_channels=8"],
        lr_grid=[0.05, 0.2],
        extra=["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "statistics.resamples=20"],
    )
    search = json.loads((tmp_path / "map_fixed" / compare.TUNING_FILE).read_text())
    assert search["grid"] == [0.05, 0.2] and search["chosen"] in (0.05, 0.2) and search["key"] == "model.optim.lr"
    assert sorted(p.name for p in (tmp_path / "tune" / "map_fixed").iterdir()) == ["lr_0.05", "lr_0.2"]
    assert not (tmp_path / "tune" / "deep_ensemble").exists()
    ensemble = json.loads((tmp_path / "deep_ensemble" / compare.TUNING_FILE).read_text())
    assert ensemble["chosen"] == search["chosen"] and ensemble["shared_with"] == "map_fixed"
    assert ensemble["key"] == "model.member.optim.lr"
    config = (tmp_path / "deep_ensemble" / "resolved_config.yaml").read_text()
    assert f"lr: {search['chosen']}" in config
    text = (tmp_path / "report" / "tuning.md").read_text()
    assert "| map_fixed | digits |" in text and "deep_ensemble seed 0" in text
    assert not [r for r in caplog.records if "Tip" in str(r.msg)]  # five trainings in one process, no product tip


def test_a_method_whose_file_sizes_its_cell_network_composes_on_a_residual_backbone(tmp_path):
    """VOGN's file sets the small cell network's B = 4 and one cell per stage; on ResNet-18 those
    keys are removed (train.py refuses them there and says so), on the cell network they stay."""
    assert compare.own_net_keys("vogn") == ["num_nodes", "cells_per_stage"] and compare.own_net_keys("map") == []
    overrides = compare.method_overrides("vogn", epochs=1, steps_per_epoch=1, backbone="resnet18")
    assert "~model.net.num_nodes" in overrides and "~model.net.cells_per_stage" in overrides
    cfg = compose_config("train", overrides, tmp_path)
    validate_config(cfg)
    assert cfg.model.net._target_ == "dbsn.nets.ResNet18" and "num_nodes" not in cfg.model.net
    cells = compose_config("train", compare.method_overrides("vogn", 1, 1, backbone="structure_net"), tmp_path)
    assert cells.model.net.num_nodes == 4 and cells.model.net.cells_per_stage == 1
