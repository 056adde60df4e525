"""`execution.weight_copies` (`dbsn.methods.weight_copies`): the convolution weights cast to bf16 once
per step in one operation. A DBSN step on the fused-cell network under bf16 autocast, in every
convolution form, equals the step without copies bit for bit (logs, every gradient, the parameters
after the optimisers' step) with the casts counted in the test: two per copied weight (one forward,
one back) replaced by two for all of them; a weight that a step does not use keeps no gradient, so
momentum and weight decay leave it where it was; the layers copied are the ones whose forward hands
their weight parameter to the convolution as it is."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dbsn.bayes import BayesConv2d
from dbsn.methods import DBSN, Compilation, Execution, Prediction
from dbsn.methods.weight_copies import WeightCopies, copied_layers
from dbsn.nets import StructureNet
from dbsn.nets.conv_forms import StackedConv2d
from dbsn.tools.bench.common import NETS

#: (conv_1x1, depthwise, T per forward, channels-last): each form of each kind, grouped T and one
#: structure a forward, both layouts
SETTINGS = [
    ("conv", "conv", None, False),
    ("bmm", "stencil", None, False),
    ("mulsum", "conv", None, False),
    ("mulsum", "stencil", 1, False),
    ("conv", "stencil", None, True),
]


class Casts(TorchDispatchMode):
    """The number of dtype-changing `aten._to_copy`s (autocast's casts and `Tensor.to`'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].dtype != out.dtype:
            self.count += 1
        return out


def _method(chunk: int | None = None, **execution) -> DBSN:
    torch.manual_seed(0)
    return DBSN(
        StructureNet(num_classes=10, **NETS["tiny"]),
        train_samples=2,
        dataset_size=1000,
        train_samples_per_forward=chunk,
        prediction=Prediction(n_samples=2, samples_per_forward=2),
        execution=Execution(**execution),
    )


def _step(method: DBSN, seed: int = 1, opts: list | None = None, count: bool = True):
    """One training step of `method` under CPU bf16 autocast with its cast cache off, as in a
    CUDA-graph capture (`opts`: the optimisers, built if None): the casts (with `count`: dynamo
    does not compile under a dispatch mode), logs, gradients and updated parameters, and the
    optimisers."""
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 16, 16, generator=generator), torch.randint(0, 10, (4,), generator=generator)
    if opts is None:
        opts = [method.optim.build(method.weight_parameters(), 100)[0]]
        opts.append(method.structure_optimizer().build(method.structure_parameters()))
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    method.train()
    torch.manual_seed(seed)
    casts = Casts() if count else nullcontext(Casts())
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), casts as casts:
        logs = method.step_body(x, y, opts, opts[:1], lambda loss, last: loss.backward())
    params = dict(method.named_parameters())
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    return casts.count, logs, grads, {n: p.detach().clone() for n, p in params.items()}, opts


def _assert_same_step(plain, copied) -> None:
    for key, value in plain[1].items():
        assert torch.equal(copied[1][key], value), key
    for name, grad in plain[2].items():
        assert grad is not None, f"{name}: DBSN's step uses every parameter"
        assert copied[2][name].dtype == grad.dtype and torch.equal(copied[2][name], grad), name
        assert torch.equal(copied[3][name], plain[3][name]), name


@pytest.mark.parametrize("conv_1x1, depthwise, chunk, channels_last", SETTINGS)
def test_dbsn_steps_the_same_with_weight_copies_and_casts_less(conv_1x1, depthwise, chunk, channels_last):
    settings = dict(channels_last=channels_last, conv_1x1=conv_1x1, depthwise=depthwise)
    plain = _step(_method(chunk, **settings))
    method = _method(chunk, weight_copies=True, **settings)
    copied = _step(method)
    if channels_last:
        assert any(not p.is_contiguous() for p in method.parameters()), "some weights are channels-last"
    stacked = [m for m in method.net.modules() if isinstance(m, StackedConv2d)]
    assert {m.form for m in stacked} == {conv_1x1, depthwise}
    layers = copied_layers(method.net)
    assert set(map(id, stacked)) <= set(map(id, layers)), "every stacked convolution is copied"
    assert all("weight" not in m.__dict__ for m in layers), "the copies are gone after the step"
    _assert_same_step(plain, copied)
    # each copied weight: one cast forward and one back per forward (T of them with one structure a
    # forward and the cast cache off), replaced by one cast in all and one back per backward
    forwards = 2 // (chunk or 2)
    assert copied[0] == plain[0] - 2 * forwards * len(layers) + 1 + forwards


def test_a_weight_the_step_does_not_use_keeps_no_gradient_and_does_not_move():
    """A network with an unused branch (a convolution its forward skips): with the copies its weight's
    gradient stays None, as without, so SGD's weight decay and momentum do not move it; the used
    weights' gradients and updates are the same bit for bit, over two steps (momentum in play)."""

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Conv2d(3, 4, 3, padding=1, bias=False)
            self.unused = nn.Conv2d(3, 4, 1, bias=False)
            self.stacked = StackedConv2d(4, 8, 1, groups=2, stacked_edges=2)

        def forward(self, x):
            return self.stacked(self.used(x))

    results = []
    for copies in (False, True):
        torch.manual_seed(0)
        net = Branches()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        start = net.unused.weight.detach().clone()
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                context = WeightCopies(net).applied(torch.bfloat16) if copies else None
                if context is not None:
                    with context as count:
                        assert count == 3
                        net(x).float().square().sum().backward()
                else:
                    net(x).float().square().sum().backward()
            assert net.unused.weight.grad is None
            opt.step()
        assert torch.equal(net.unused.weight.detach(), start)
        results.append({n: p.detach().clone() for n, p in net.named_parameters()})
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def test_the_copied_layers_are_those_that_hand_their_weight_to_the_convolution():
    """`nn.Conv2d` and the fused cell's `StackedConv2d`; not a Bayesian twin (its weight is drawn from
    μ and ρ), not a parametrised layer (its weight is computed), not a layer that is a subclass."""

    class Sub(nn.Conv2d):
        pass

    net = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        StackedConv2d(4, 4, 1, groups=2, stacked_edges=2),
        BayesConv2d(4, 4, 1),
        torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 4, 1)),
        Sub(4, 4, 1),
    )
    assert copied_layers(net) == [net[0], net[1]]


def test_compiled_nodes_take_the_copies_without_recompiling():
    """``compile.scope=nodes`` (dynamo's eager backend: no code generation): two steps with the copies
    equal two eager steps without them bit for bit, and the second step compiles nothing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = _method(weight_copies=True, compile=Compilation(enabled=True, scope="nodes", backend="eager"))
    eager = _method()
    first = _step(compiled, count=False)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    try:
        torch.compiler.set_stance("fail_on_recompile")
        second = _step(compiled, seed=2, opts=first[4], count=False)
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == graphs
    reference = _step(eager)
    _assert_same_step(reference, first)
    _assert_same_step(_step(eager, seed=2, opts=reference[4]), second)


def test_weight_copies_without_mixed_precision_are_refused_in_one_line():
    method = _method(weight_copies=True)
    opts = [method.optim.build(method.weight_parameters(), 100)[0]]
    with pytest.raises(ValueError, match=r"^model.execution.weight_copies=true .*trainer.precision=bf16-mixed"):
        method.step_body(torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)), opts, opts)


def test_the_config_check_refuses_weight_copies_without_bf16_mixed(tmp_path):
    """Before anything is built, in one line naming both settings; with bf16-mixed it passes."""
    from dbsn.runtime.config import ConfigError, validate_config
    from tests.support.configs import compose_config

    base = ["data=digits", "trainer=cpu", "model.execution.weight_copies=true", "model.execution.channels_last=false"]
    with pytest.raises(ConfigError, match=r"^model.execution.weight_copies=true .*trainer.precision=bf16-mixed or "):
        validate_config(compose_config("train", base, tmp_path))
    validate_config(compose_config("train", [*base, "trainer.precision=bf16-mixed"], tmp_path))
