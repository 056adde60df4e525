"""The field suite of the bench (dbsn.tools.bench.field): every method on one backbone, built from its
config, timed beside one network, end to end on the CPU at a tiny width."""

from __future__ import annotations

import pytest

from dbsn.tools import bench


@pytest.mark.parametrize(
    "backbone, methods",
    [
        (
            "resnet18",
            (
                "map_fixed",
                "mc_dropout",
                "deep_ensemble",
                "batch_ensemble",
                "rank1_bnn",
                "packed_ensemble",
                "mimo",
                "sngp",
                "ddu",
                "masksembles",
                "snapshot_ensemble",
                "csghmc",
            ),
        ),
        ("structure_net", ("map_fixed", "dbsn", "mimo", "masksembles", "csghmc_structure")),
    ],
)
def test_field_suite_times_every_method_against_one_network(backbone, methods, tmp_path, monkeypatch):
    import json

    from dbsn.tools.bench import field

    monkeypatch.setattr(field, "FIELD_METHODS", tuple(m for m in methods if m not in field.CELL_METHODS))
    out = tmp_path / "field.json"
    result = bench.main(
        [
            "--suite",
            "field",
            "--backbone",
            backbone,
            "--size",
            "tiny",
            "--batch",
            "4",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert set(result["parameters"]) == set(methods)
    for name in methods:
        assert result["seconds"][f"{name} train"] > 0 and result["seconds"][f"{name} predict"] > 0
        if name != "map_fixed":
            assert result["ratios"][f"{name} predict / map_fixed predict"] == pytest.approx(
                result["seconds"][f"{name} predict"] / result["seconds"]["map_fixed predict"]
            )
    params, members = result["parameters"], result["members"]
    if "deep_ensemble" in params:  # four networks: four times the parameters, four members
        assert params["deep_ensemble"] == 4 * params["map_fixed"] and members["deep_ensemble"] == 4
        # the field sweep's ResNet-18 jobs: M = 4 everywhere (torch-uncertainty), S = 30 for MC dropout
        assert members["batch_ensemble"] == members["packed_ensemble"] == members["mimo"] == members["rank1_bnn"] == 4
        assert members["mc_dropout"] == 30 and members["sngp"] == members["ddu"] == members["map_fixed"] == 1
        assert params["ddu"] == params["map_fixed"]  # spectral normalisation and leaky ReLUs add no parameter
        # Masksembles: buffers for masks, no parameter; a snapshot ensemble: M = 5 networks (conf/callbacks/)
        assert params["masksembles"] == params["map_fixed"] and members["masksembles"] == 4
        assert params["snapshot_ensemble"] == 5 * params["map_fixed"] and members["snapshot_ensemble"] == 5
        # cSGHMC: one network trained, the 12 samples its run keeps (4 cycles x 3) at prediction, one forward each
        assert params["csghmc"] == params["map_fixed"] and members["csghmc"] == 12
    if "dbsn" in params:
        assert members["dbsn"] == 100 and members["mimo"] == 3
        assert members["csghmc_structure"] == 48  # 4 chains x 4 cycles x 3 samples


def test_a_training_step_after_a_prediction_trains_in_training_mode():
    """The suite interleaves each method's step and prediction on one object: the step must put it back in
    training mode (BatchNorm on the batch's statistics), which the prediction left in eval mode."""
    import torch

    from dbsn.tools.bench import field

    method = field.build_method("map_fixed", "resnet18", "tiny")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    step, predict = field.training_step(method, x, y), field.prediction(method, x)
    modes = []
    method.net.bn1.register_forward_hook(lambda module, args, out: modes.append(module.training))
    predict()
    step()
    assert modes == [False, True]
