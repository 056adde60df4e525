"""The training step captured in a CUDA graph (dbsn.methods.step.GraphedStep) equals the eager step:
directly, and through Lightning's loop with `execution.cuda_graph`. GPU only: skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from dbsn.methods import DBSN, MAP, Execution
from dbsn.methods.step import GraphedStep
from dbsn.nets import StructureNet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA device")


def _method(kind: str, cuda_graph: bool, weight_copies: bool = False):
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    execution = Execution(cuda_graph=cuda_graph, weight_copies=weight_copies)
    if kind == "dbsn":
        return DBSN(net, train_samples=4, dataset_size=100, execution=execution).cuda()
    return MAP(net, learn_structure=False, dataset_size=100, execution=execution).cuda()


def _steps(
    kind: str, graph: bool, steps: int = 8, precision: str = "fp32", weight_copies: bool = False
) -> dict[str, torch.Tensor]:
    method = _method(kind, graph, weight_copies)
    weights = [method.optim.build(method.weight_parameters(), 10, capturable=graph)[0]]
    opts = weights + (
        [method.structure_optimizer().build(method.structure_parameters(), capturable=graph)]
        if method.structure_parameters()
        else []
    )
    method.attach_guard(opts)
    method.train()

    def zero():
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    def body(x, y):
        return method.step_body(x, y, opts, weights, lambda loss, last: loss.backward())

    run = GraphedStep(body, zero) if graph else None
    generator = torch.Generator(device="cuda").manual_seed(1)
    torch.manual_seed(2)
    losses = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")
    for _ in range(steps):
        x = torch.randn(6, 3, 16, 16, device="cuda", generator=generator)
        y = torch.randint(0, 5, (6,), device="cuda", generator=generator)
        with autocast:
            if run is None:
                zero()
                logs = body(x, y)
            else:
                logs = run(x, y)
        losses.append(logs["loss"].float())
        method.on_after_optimizer_step(6)
    state = {k: v.detach().float().clone() for k, v in method.state_dict().items()}
    state["losses"] = torch.stack(losses)
    return state


@pytest.mark.parametrize("kind", ["map_fixed", "dbsn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphed_step_equals_the_eager_step(kind, precision):
    """Eight steps (three eager warm-up steps, the capture, four replays): losses, weights, θ,
    running statistics and counters as the eager steps leave them; DBSN's structure draws come
    from the default CUDA generator, which a graph replays as the eager steps draw."""
    eager, graphed = _steps(kind, False, precision=precision), _steps(kind, True, precision=precision)
    assert eager.keys() == graphed.keys()
    tolerance = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    for key in eager:
        torch.testing.assert_close(graphed[key], eager[key], msg=key, **tolerance)


def test_graphed_step_with_weight_copies_equals_the_eager_step():
    """`execution.weight_copies` inside the capture (the copies made in the captured step, the
    convolutions' weights shadowed while it is captured): DBSN's bf16 steps as the eager ones
    without the copies leave them, within bf16's tolerance as above."""
    eager = _steps("dbsn", False, precision="bf16")
    graphed = _steps("dbsn", True, precision="bf16", weight_copies=True)
    assert eager.keys() == graphed.keys()
    for key in eager:
        torch.testing.assert_close(graphed[key], eager[key], msg=key, rtol=2e-2, atol=2e-3)


def test_a_graphed_fit_through_lightning_equals_the_eager_fit(tmp_path):
    """`execution.cuda_graph=true` under Lightning's loop: the same weights and running statistics
    after 10 steps, the same global step (Lightning counts the replayed optimiser steps), and the
    same logged loss."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(60, 3, 16, 16, generator=generator), torch.randint(0, 5, (60,), generator=generator)
    )
    results = {}
    for graph in (False, True):
        method = _method("dbsn", graph)
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        torch.manual_seed(3)
        trainer.fit(method, DataLoader(data, batch_size=12))
        results[graph] = (
            {k: v.detach().float().cpu() for k, v in method.state_dict().items()},
            trainer.global_step,
            float(trainer.callback_metrics["train/loss_epoch"]),
        )
    (eager, eager_steps, eager_loss), (graphed, graphed_steps, graphed_loss) = results[False], results[True]
    assert graphed_steps == eager_steps == 2 * 5 * 2  # two optimisers, five batches, two epochs
    assert graphed_loss == pytest.approx(eager_loss, rel=1e-3)
    for key in eager:
        torch.testing.assert_close(graphed[key], eager[key], rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.parametrize("kind", ["map_fixed", "dbsn"])
def test_graphed_prediction_equals_the_eager_prediction(kind):
    """`execution.cuda_graph_prediction`: the S members' forwards replayed from graphs (one per input
    shape: a full batch and a last, shorter one) give the eager members, under inference mode."""
    eager = _method(kind, False)
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    execution = Execution(cuda_graph_prediction=True)
    graphed = (
        DBSN(net, train_samples=4, dataset_size=100, execution=execution)
        if kind == "dbsn"
        else MAP(net, learn_structure=False, dataset_size=100, execution=execution)
    ).cuda()
    graphed.load_state_dict(eager.state_dict())
    for method in (eager, graphed):
        method.eval()
        method.n_samples, method.samples_per_forward = 6, 3
    generator = torch.Generator(device="cuda").manual_seed(4)
    batches = [torch.randn(b, 3, 16, 16, device="cuda", generator=generator) for b in (8, 8, 5)]
    outputs = {}
    for name, method in (("eager", eager), ("graphed", graphed)):
        torch.manual_seed(9)
        with torch.inference_mode():
            outputs[name] = [method.predict_members(x) for x in batches]
    assert len(graphed._graphed_network.graphs) == 2  # the two batch shapes
    for a, b in zip(outputs["eager"], outputs["graphed"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
