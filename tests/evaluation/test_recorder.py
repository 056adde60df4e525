"""The test pass's recorder (`dbsn.evaluation.recorder`): a method keeps nothing for an evaluation,
before or after its test pass; what the pass predicted is the recorder's and equals the method's
own prediction; the MC-sample ablation's full ensemble is the logged one; a segmentation model's
pass keeps its first maps and its per-image rows, whose unit-weight metrics are the logged ones.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dbsn.evaluation.recorder import EXAMPLE_SIZE, PredictionRecorder, sample_ablation
from dbsn.evaluation.test_pass import run_test_pass
from dbsn.methods import DBSN, MAP, Prediction
from dbsn.methods.tasks import Segmentation
from dbsn.nets import FCDenseNet, StructureNet

#: what evaluations set on a method or read of it before the recorder kept the test pass
FORMER_ATTRIBUTES = (
    "test_predictions",
    "test_scores",
    "test_example",
    "test_image_rows",
    "test_maps",
    "sample_ablation",
    "ablation_rows",
    "_test_outputs",
)


class Tensors(pl.LightningDataModule):
    """A test split of fixed tensors, in batches of 5."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__()
        self.x, self.y = x, y

    def test_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=5)


def _trainer() -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _net() -> StructureNet:
    return StructureNet(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)


def _data(n: int = 12) -> Tensors:
    torch.manual_seed(0)
    return Tensors(torch.randn(n, 3, 16, 16), torch.randint(0, 5, (n,)))


def test_a_method_keeps_nothing_an_evaluation_reads_before_or_after_its_test_pass():
    torch.manual_seed(1)
    method = DBSN(_net(), prediction=Prediction(n_samples=3), dataset_size=100)
    assert [name for name in FORMER_ATTRIBUTES if hasattr(method, name)] == []
    trainer = _trainer()
    _, recorded = run_test_pass(trainer, method, _data())
    assert recorded not in trainer.callbacks  # attached for the pass only
    kept = {*FORMER_ATTRIBUTES, *vars(PredictionRecorder())}  # and everything a recorder keeps
    assert {"log_probs", "targets", "scores", "example", "maps", "ablation", "ablation_rows"} <= kept
    assert [name for name in kept if hasattr(method, name)] == []


def test_what_the_recorder_keeps_is_the_method_s_prediction_of_the_test_set():
    torch.manual_seed(1)
    method = MAP(_net(), learn_structure=False, dataset_size=100)  # deterministic: predicting again gives the same
    data = _data()
    metrics, recorded = run_test_pass(_trainer(), method, data)
    method.eval()
    with torch.no_grad():
        expected = method.predict_log_probs(data.x)
        scores = method.uncertainty_scores(data.x)
    torch.testing.assert_close(recorded.log_probs, expected)
    assert torch.equal(recorded.targets, data.y)
    assert recorded.scores.keys() == scores.keys()
    for name in scores:
        torch.testing.assert_close(recorded.scores[name], scores[name].float(), msg=name)
    assert torch.equal(recorded.example[0], data.x[:EXAMPLE_SIZE])
    assert torch.equal(recorded.example[1], data.y[:EXAMPLE_SIZE])
    error = (recorded.log_probs.argmax(-1) != recorded.targets).float().mean()
    assert metrics["test/error"] == pytest.approx(float(error), abs=1e-6)
    assert recorded.ablation is None and recorded.ablation_rows is None  # one member: nothing to ablate
    assert recorded.maps == [] and recorded.image_metrics is None


def test_the_ablation_s_full_ensemble_is_the_logged_one():
    torch.manual_seed(1)
    method = DBSN(_net(), prediction=Prediction(n_samples=3), dataset_size=100)
    metrics, recorded = run_test_pass(_trainer(), method, _data(), ablation_sizes=[1, 3, 7])
    assert [row["n_samples"] for row in recorded.ablation_rows] == [1, 3]  # 7 > S left out
    full = recorded.ablation_rows[-1]
    for key in ("error", "nll", "brier", "ece"):
        assert full[key] == pytest.approx(metrics[f"test/{key}"], rel=1e-5, abs=1e-6), key
    nll = -recorded.log_probs.gather(1, recorded.targets[:, None]).mean()
    assert float(nll) == pytest.approx(metrics["test/nll"], rel=1e-5)


def test_the_sample_ablation_is_made_where_there_is_something_to_ablate():
    stochastic = DBSN(_net(), prediction=Prediction(n_samples=4), dataset_size=100)
    assert sample_ablation(stochastic).sizes == [1, 2, 3, 4]
    assert sample_ablation(stochastic, [2, 9]).sizes == [2]
    assert sample_ablation(stochastic, [9]).sizes == [4]  # every size above S: S itself
    assert sample_ablation(stochastic, []) is None
    assert sample_ablation(MAP(_net(), learn_structure=False, dataset_size=100)) is None


def test_a_segmentation_pass_keeps_its_first_maps_and_each_image_s_rows():
    torch.manual_seed(1)
    net = FCDenseNet(num_classes=5, first_channels=8, growth=4, layers_per_block=2, num_down=2)
    method = MAP(net, learn_structure=False, dataset_size=20, task=Segmentation(ignore_index=4, num_maps=3))
    x, y = torch.randn(8, 3, 20, 24), torch.randint(0, 5, (8, 20, 24))
    metrics, recorded = run_test_pass(_trainer(), method, Tensors(x, y), ablation_sizes=None)
    assert recorded.log_probs is None and recorded.scores is None and recorded.ablation is None
    assert len(recorded.maps) == 3  # the first three of the first batch's five
    for i, found in enumerate(recorded.maps):
        assert torch.equal(found["image"], x[i]) and torch.equal(found["target"], y[i])
        assert found["prediction"].shape == found["entropy"].shape == found["mutual_information"].shape == (20, 24)
    rows = recorded.image_metrics.per_image()
    assert rows.shape[0] == 8
    unit = recorded.image_metrics.resampled(torch.ones(1, 8), rows)
    for key in ("miou", "global_acc", "ece", "nll"):
        assert float(unit[key][0]) == pytest.approx(metrics[f"test/{key}"], rel=1e-5, abs=1e-6), key
    # a second pass starts its metrics afresh, and the first pass's copy keeps its own rows
    _, again = run_test_pass(_trainer(), method, Tensors(x[:5], y[:5]), ablation_sizes=None)
    assert again.image_metrics.per_image().shape[0] == 5 and recorded.image_metrics.per_image().shape[0] == 8
    assert again.image_metrics is not method.test_metrics
