"""Whether a run had converged (dbsn.evaluation.convergence): the rule on crafted curves, the curve a
fit records, and the report's mark in every table."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dbsn.evaluation.convergence import TrainingCurve, convergence
from dbsn.evaluation.report.format import UNCONVERGED_MARK, mark_unconverged


def test_a_curve_still_falling_at_its_end_has_not_converged():
    flat = [2.0, 1.0, 0.6, 0.5, 0.45, 0.42, 0.41, 0.405, 0.40, 0.40]
    assert convergence(flat)["converged"] is True
    falling = [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6, 0.5, 0.4]  # last two: 0.5, 0.4
    found = convergence(falling)
    assert found["converged"] is False and found["window_epochs"] == 2
    assert found["last_tenth_drop"] == pytest.approx(0.1 / 0.4)  # the line's fall over one epoch, over the final loss
    assert convergence([1.0, 0.5])["converged"] is None  # too short to say
    assert convergence([1.0, float("nan"), 0.5])["converged"] is None
    long = [1.0] * 40 + [1.0 - 0.03 * i for i in range(1, 6)]  # the last tenth of 45 epochs: 6 points
    found = convergence(long)
    assert found["window_epochs"] == 6 and found["converged"] is False
    assert found["last_tenth_drop"] == pytest.approx(0.03 * 4.5 / 0.85)  # the line's fall across 4.5 epochs
    # a short run's drop at its last lr decay (epoch 7 of 9) is not its last tenth: flat after it, converged
    decayed = [2.18, 1.53, 0.82, 0.51, 0.27, 0.22, 0.181, 0.1543, 0.1529]
    assert convergence(decayed)["converged"] is True
    assert convergence(decayed[:-1] + [0.13])["converged"] is False  # still falling in its last epoch


def test_the_report_judges_every_run_by_the_rule_of_its_version(tmp_path):
    """A run's verdict is recomputed from its recorded curve, so runs written under an older rule
    are judged like new ones."""
    import json

    from dbsn.evaluation.report.collect import load_run
    from tests.support.fakeruns import MODELS, write_run

    folder = write_run(tmp_path / "run", MODELS["map"], "dbsn.data.CIFAR10DataModule", 1, 0.1)
    record = json.loads((folder / "metrics.json").read_text())
    curve = [2.18, 1.53, 0.82, 0.51, 0.27, 0.22, 0.181, 0.1543, 0.1529]
    record["convergence"] = {"epoch_losses": curve, "converged": False, "last_tenth_drop": 0.18, "window_epochs": 3}
    (folder / "metrics.json").write_text(json.dumps(record))
    run = load_run(folder)
    assert run.convergence == convergence(curve) and run.convergence["converged"] is True


def test_the_curve_is_the_mean_training_loss_of_every_epoch():
    class Constant(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen = []

        def training_step(self, batch, batch_idx):
            loss = batch[0].sum() + 0 * self.w
            self.seen.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    data = DataLoader(TensorDataset(torch.arange(12.0).view(12, 1)), batch_size=4)
    curve, module = TrainingCurve(), Constant()
    pl.Trainer(
        max_epochs=2,
        callbacks=[curve],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    ).fit(module, data)
    assert curve.epoch_losses == pytest.approx([sum(module.seen[:3]) / 3, sum(module.seen[3:]) / 3])
    restored = TrainingCurve()
    restored.load_state_dict(curve.state_dict())
    assert restored.epoch_losses == curve.epoch_losses


def test_the_report_marks_an_unconverged_method_in_every_table_row():
    table = "| method | error |\n|---|---|\n| mimo | 0.1 |\n| mimo_x | 0.2 |\n| dbsn | 0.3 |\n"
    marked = mark_unconverged({"mimo"}, table)
    assert (
        f"| mimo {UNCONVERGED_MARK} | 0.1 |" in marked and "| mimo_x | 0.2 |" in marked and "| dbsn | 0.3 |" in marked
    )
    assert mark_unconverged(set(), table) == table
