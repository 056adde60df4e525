"""The tasks (dbsn.methods.tasks): the training loss in float32 under autocast, and segmentation end
to end: every CamVid model trains through train.py's code on a generated CamVid tree, reports
mIoU / global accuracy / pixel ECE / per-class IoU, draws uncertainty maps, and is re-evaluated
from its checkpoint alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dbsn.evaluation.base import EvaluationError
from dbsn.methods.tasks import Classification
from dbsn.runtime.run import evaluate, train
from tests.support.autocast import bf16_autocast
from tests.support.configs import compose_config
from tests.support.fakedata import write_camvid


def test_training_loss_is_float32_under_autocast():
    torch.manual_seed(0)
    logits, targets = (3 * torch.randn(16, 10)).bfloat16(), torch.randint(0, 10, (16,))
    with bf16_autocast():
        loss = Classification().loss(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), targets), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- segmentation end to end

QUIET = [
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "~callbacks.progress_bar",
]
SMALL_NET = {
    "fcdensenet67": [
        "model.net.first_channels=8",
        "model.net.growth=4",
        "model.net.layers_per_block=2",
        "model.net.num_down=2",
    ],
    "dbsn_seg": ["model.net.first_channels=8", "model.net.growth=4", "model.net.num_nodes=3", "model.net.num_down=2"],
}
SMALL_NET["fcdensenet67_mc_dropout"] = SMALL_NET["fcdensenet67"]


@pytest.fixture(scope="module")
def camvid_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("camvid")
    write_camvid(root, n_train=4, n_val=2, n_test=2, size=(36, 50), seed=0)  # 50: not a multiple of 4
    return root


def _overrides(model, root):
    stochastic = model != "fcdensenet67"
    return [
        f"model={model}",
        "data=camvid",
        f"data.root={root}",
        "data.crop_size=32",
        "data.batch_size=2",
        "data.num_workers=0",
        "data.eval_batch_size=2",
        *SMALL_NET[model],
        "trainer.max_epochs=2",
        *(
            ["model.prediction.n_samples=3", "model.prediction.val_samples=2", "model.prediction.samples_per_forward=2"]
            if stochastic
            else []
        ),
        *QUIET,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fcdensenet67", "fcdensenet67_mc_dropout", "dbsn_seg"])
def test_segmentation_model_trains_reports_and_reevaluates(model, camvid_root, tmp_path):
    run_dir = tmp_path / "run"
    metrics = train(compose_config("train", _overrides(model, camvid_root), run_dir), run_dir)
    names = {
        "test/miou",
        "test/global_acc",
        "test/ece",
        "test/nll",
        "test/iou/sky",
        "test/iou/bicyclist",
        "test/predictive_entropy",
        "test/mutual_information",
    }
    assert names <= set(metrics)
    assert 0 <= metrics["test/miou"] <= 1 and 0 <= metrics["test/global_acc"] <= 1
    if model == "fcdensenet67":  # one deterministic pass: nothing epistemic to measure
        assert metrics["test/mutual_information"] == 0
    else:
        assert metrics["test/mutual_information"] > 0
    assert (run_dir / "uncertainty_maps.png").stat().st_size > 5000
    record = json.loads((run_dir / "metrics.json").read_text())
    assert record["metrics"]["test/miou"] == pytest.approx(metrics["test/miou"])
    for key in ("test/miou", "test/global_acc", "test/ece", "test/nll"):  # resampling the test images
        low, high = record["intervals"][key]
        assert low - 1e-6 <= record["metrics"][key] <= high + 1e-6, key
    assert record["statistics"]["interval"] == "percentile bootstrap over the test images"
    if model == "dbsn_seg":  # two structures, 3 edges each (B = 3), written out and watched
        summary = json.loads((run_dir / "structure" / "final.json").read_text())
        assert len(summary["probabilities"]) == 6

    cfg = compose_config("evaluate", [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", *QUIET], tmp_path / "eval")
    again = evaluate(cfg, tmp_path / "eval")
    assert (run_dir / "evaluation" / "uncertainty_maps.png").exists()
    if model == "fcdensenet67":
        assert again["test/miou"] == pytest.approx(metrics["test/miou"], rel=1e-6)
    with pytest.raises(EvaluationError, match="classifiers"):  # before the test pass
        evaluate(
            compose_config(
                "evaluate",
                [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", "evaluations=[ood]", *QUIET],
                tmp_path / "eval",
            ),
            tmp_path / "eval",
        )
