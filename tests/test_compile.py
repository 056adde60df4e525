"""model.execution.compile.enabled=true: the compiled network gives the eager numbers, and a run under way
does not recompile.

Equality: one training step (loss, every weight gradient, θ's gradient, the BatchNorm running
statistics) of DBSN with T = 4 grouped and in chunks, MAP-fixed α and BBB, and the members of
the S-member Bayes ensemble. Inductor (the backend that generates kernels, the one users run)
compiles the grouped DBSN case; the chunked step, MAP-fixed α and BBB go through the same graph
capture (dynamo, AOT autograd, functionalised BatchNorm updates) with the aot_eager backend,
which skips only code generation: inductor's C++ compile costs about a minute per graph on a
2-core machine.
Random numbers drawn inside a compiled graph (BBB's weight noise) come from inductor's own
generator unless `fallback_random` is set, so the BBB case sets it.

Recompiles: dynamo's counters after step 3 and after step 20 of a Lightning run whose τ (per
example) and β (per epoch) decay are the same. α is the graph's tensor input; τ and β only
shape α, outside the network.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from steputil import assert_same, prediction, step_state
from torch.utils.data import DataLoader, TensorDataset

from dbsn.methods import DBSN, MAP, Compilation, Execution, GaussianWeights, Prediction
from dbsn.nets import StructureNet
from dbsn.runtime.config import cpp_compiler
from dbsn.structure.schedules import BetaSchedule, TauSchedule

pytestmark = pytest.mark.skipif(cpp_compiler() is None, reason="inductor on a CPU needs a C++ compiler; none found")

TINY_NET = dict(num_classes=5, num_nodes=3, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8)


def _dbsn(compile, chunk=None):
    return DBSN(StructureNet(**TINY_NET), train_samples=4, prediction=Prediction(n_samples=6, samples_per_forward=3), dataset_size=40,
                theta_init_std=1.0, train_samples_per_forward=chunk, execution=Execution(compile=compile))


CASES = {  # name: (constructor, backend)
    "dbsn_t4_grouped": (lambda c: _dbsn(c), "inductor"),
    "dbsn_t4_chunked": (lambda c: _dbsn(c, chunk=2), "aot_eager"),
    "map_fixed": (lambda c: MAP(StructureNet(**TINY_NET), learn_structure=False, dataset_size=40,
                                execution=Execution(compile=c)),
                  "aot_eager"),
    "bbb": (lambda c: MAP(StructureNet(**TINY_NET), learn_structure=True, theta_init_std=1.0, dataset_size=40,
                          weights=GaussianWeights(init_rho=-3.0), prediction=Prediction(n_samples=3),
                          execution=Execution(compile=c)), "aot_eager"),
}


def _pair(name):
    make, backend = CASES[name]
    torch.manual_seed(3)
    eager = make(None)
    torch.manual_seed(3)
    compiled = make(Compilation(enabled=True, backend=backend))
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_step_and_prediction_equal_eager(name):
    torch._dynamo.reset()
    eager, compiled = _pair(name)
    torch.manual_seed(0)
    # 32 x 32: a size at which a chunk's compiled backward has donated buffers (no retain_graph)
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    with torch._inductor.config.patch(fallback_random=True):
        for step in range(2):  # the second step runs the cached graphs, from moved running statistics
            kinds = assert_same(step_state(eager, x, y, seed=step), step_state(compiled, x, y, seed=step),
                                rtol=1e-4, atol=1e-5)
        assert kinds["weight gradients"] > 20 and kinds["running statistics"] > 10
        assert kinds["theta gradient"] == (0 if name == "map_fixed" else 1)
        if name in ("dbsn_t4_grouped", "bbb"):  # S members in chunks, in eval mode under inference_mode
            torch.testing.assert_close(prediction(compiled, x, eager.n_samples), prediction(eager, x, eager.n_samples),
                                       rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile


class _CompileCounts(pl.Callback):
    """dynamo's counters after each training step, and τ, β there."""

    def __init__(self) -> None:
        self.after_step: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        counters = torch._dynamo.utils.counters
        self.after_step.append({"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
                                "recompiles": sum(counters["recompiles"].values()),
                                "tau": module.tau, "beta": float(module.beta)})


@pytest.mark.slow
def test_no_recompilation_while_tau_and_beta_decay():
    torch._dynamo.reset()
    torch.manual_seed(0)
    method = DBSN(StructureNet(**TINY_NET), train_samples=2, dataset_size=32, tau=TauSchedule(decay=0.05),
                  beta=BetaSchedule(decay_per_epoch=0.1),
                  execution=Execution(compile=Compilation(enabled=True, backend="aot_eager")))
    data = TensorDataset(torch.randn(32, 3, 16, 16), torch.randint(0, 5, (32,)))
    counts = _CompileCounts()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[counts])
    trainer.fit(method, DataLoader(data, batch_size=8, shuffle=True, drop_last=True))
    assert len(counts.after_step) == 20
    third, last = counts.after_step[2], counts.after_step[-1]
    assert third["graphs"] > 0
    assert {k: third[k] for k in ("graphs", "frames", "recompiles")} == {k: last[k] for k in ("graphs", "frames", "recompiles")}
    assert last["tau"] < third["tau"] and last["beta"] < third["beta"]  # the schedules did move


def _networks(segmentation: bool):
    from dbsn.nets import DBSNSegNet

    nets = {"StructureNet": (StructureNet(**TINY_NET), (2, 3, 16, 16), 3)}
    if segmentation:
        nets["DBSNSegNet"] = (DBSNSegNet(num_classes=5, first_channels=8, growth=4, num_down=2, num_nodes=3),
                              (1, 3, 16, 16), 2)
    return nets


@pytest.mark.parametrize("channels_last, autocast", [(False, True), (True, False), (True, True)],
                         ids=["bf16_autocast", "channels_last", "channels_last_bf16_autocast"])
def test_the_networks_compile_to_one_graph(channels_last, autocast):
    """No graph break in training or prediction, in either layout, with or without autocast: a
    break splits the compiled forward and recompiles per module (the float32 islands of
    `dbsn.precision` once broke every channels-last BatchNorm). dynamo's trace only, no code
    generation; the segmentation network (same cells and BatchNorm) in the last setting only."""
    for name, (net, shape, groups) in _networks(channels_last and autocast).items():
        if channels_last:
            net = net.to(memory_format=torch.channels_last)
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        for training in (True, False):
            net.train(training)
            alpha = torch.softmax(torch.randn(groups, net.num_edges, net.num_ops), -1)
            with torch.inference_mode(not training), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                explained = torch._dynamo.explain(net)(x, alpha, replicate=True)
            assert explained.graph_break_count == 0, (name, training, [str(b.reason)[:200] for b in explained.break_reasons])
            assert explained.graph_count == 1
