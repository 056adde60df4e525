"""Deep ensembles: probability averaging, independent members, gathering finished runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dbsn.evaluation.ablation import CALIBRATED_NLL_FILE
from dbsn.methods import DBSN, MAP, DeepEnsemble
from dbsn.nets import StructureNet
from dbsn.runtime.build import build_model
from dbsn.runtime.run import evaluate, train
from tests.support.configs import TINY, compose_config, tiny_for


def _member(seed: int) -> MAP:
    torch.manual_seed(seed)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    return MAP(net, learn_structure=False, dataset_size=10)


def test_prediction_averages_member_probabilities():
    members = [_member(s).eval() for s in range(3)]
    ensemble = DeepEnsemble(members).eval()
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        probs = torch.stack([m.predict_log_probs(x).exp() for m in members]).mean(0)
        got = ensemble.predict_log_probs(x).exp()
    torch.testing.assert_close(got, probs, rtol=1e-5, atol=1e-6)


def test_members_have_separate_optimisers_and_no_shared_parameters():
    ensemble = DeepEnsemble([_member(s) for s in range(3)])
    groups = ensemble.weight_parameter_groups()
    assert len(groups) == 3
    ids = [{id(p) for p in g} for g in groups]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2])
    assert sum(len(g) for g in groups) == len(list(ensemble.parameters()))


def test_members_are_initialised_from_different_seeds(tmp_path):
    cfg = compose_config("train", ["model=deep_ensemble", "model.size=3"], tmp_path)
    torch.manual_seed(0)
    ensemble = build_model(cfg.model, num_classes=10)
    torch.manual_seed(0)
    again = build_model(cfg.model, num_classes=10)
    first = [m.net.stem.weight for m in ensemble.members]
    assert not torch.equal(first[0], first[1])
    assert all(torch.equal(a.net.stem.weight, b.net.stem.weight) for a, b in zip(ensemble.members, again.members))


def test_rejects_structure_sampling_members():
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    with pytest.raises(ValueError, match="point-structure"):
        DeepEnsemble([DBSN(net, dataset_size=10)])


@pytest.mark.slow
def test_trains_in_one_job_and_gathers_finished_runs(tmp_path):
    tiny_member = [
        o.replace("model.", "model.member.", 1)
        for o in TINY
        if o.startswith("model.")
        and not o.startswith(
            ("model.train_samples", "model.prediction.n_samples", "model.prediction.samples_per_forward")
        )
    ]
    common = [
        "data=digits",
        "data.batch_size=128",
        "trainer.max_epochs=1",
        *[o for o in TINY if not o.startswith("model.")],
    ]
    job = tmp_path / "ensemble"
    metrics = train(compose_config("train", ["model=deep_ensemble", "model.size=2", *tiny_member, *common], job), job)
    assert set(metrics) >= {"test/error", "test/nll", "test/brier", "test/ece"}
    rows = json.loads((job / "ablation" / "results.json").read_text())  # the deep-ensemble equivalent's curve
    assert [r["n_samples"] for r in rows] == [1, 2] and all(math.isfinite(r["calibrated_nll"]) for r in rows)
    with np.load(job / CALIBRATED_NLL_FILE) as saved:  # example by example, for the equivalent's interval
        assert saved["sizes"].tolist() == [1, 2]
        assert saved["nll"].mean(1) == pytest.approx([r["calibrated_nll"] for r in rows], rel=1e-5)
    record = json.loads((job / "metrics.json").read_text())
    assert record["cost"]["n_samples"] == 2 and rows[-1]["calibrated_nll"] == pytest.approx(
        record["metrics"]["test/calibrated/nll"], abs=0.05
    )  # the same ensemble, calibrated on the other halves

    runs = []
    for seed in (1, 2):
        run = tmp_path / f"run{seed}"
        train(compose_config("train", ["model=map_fixed", *tiny_for("map_fixed"), *common, f"seed={seed}"], run), run)
        runs.append(run / "checkpoints" / "last.ckpt")
    eval_dir = tmp_path / "gathered"
    cfg = compose_config(
        "evaluate",
        [f"ckpt_path=[{runs[0]},{runs[1]}]", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"],
        eval_dir,
    )
    gathered = evaluate(cfg, eval_dir)
    singles = [json.loads((r.parents[1] / "metrics.json").read_text())["metrics"]["test/nll"] for r in runs]
    record = json.loads((eval_dir / "metrics.json").read_text())
    assert record["checkpoints"] == [str(r) for r in runs]
    # averaging probabilities can only help the NLL (Jensen): never worse than the worse member
    assert gathered["test/nll"] <= max(singles) + 1e-6
    assert math.isfinite(gathered["test/ece"])


def test_a_step_member_by_member_has_the_gradients_of_the_summed_loss():
    """One device: each member's backward before the next member's forward (one network's
    activations at a time), the same gradients as the members' summed loss in one backward."""
    import copy

    ensemble = DeepEnsemble([_member(s) for s in range(3)])
    joint = copy.deepcopy(ensemble)
    torch.manual_seed(5)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 4, (6,))
    parts = list(ensemble.training_losses(x, y))
    assert [last for _, last, _ in parts] == [False, False, True] and len(parts) == 3
    for _, _, out in parts:
        out["loss"].backward()
    joint.training_loss(x, y)["loss"].backward()
    for (name, p), q in zip(ensemble.named_parameters(), joint.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    logs = DeepEnsemble([_member(s) for s in range(3)]).accumulate_gradients(x, y, lambda loss, last: loss.backward())
    torch.testing.assert_close(logs["loss"], joint.training_loss(x, y)["loss"].detach())  # the sum over members
    torch.testing.assert_close(logs["nll"], joint.training_loss(x, y)["nll"].detach())  # the mean member NLL
