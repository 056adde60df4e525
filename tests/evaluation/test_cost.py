"""Cost of a method: parameters, training and prediction FLOPs against hand counts, the model left
as it was, and the epoch timer in a real Trainer run."""

from __future__ import annotations

import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dbsn.evaluation.cost import (
    Cost,
    EpochTimer,
    measure_cost,
    parameter_count,
    prediction_flops_per_image,
    training_flops_per_image,
)
from dbsn.methods import DBSN, MAP, DeepEnsemble, MCDropoutWeights, Prediction
from tests.support.netutil import tiny_structure_net

D, C, H = 12, 5, 4  # inputs (3 x 2 x 2 images), classes, conv channels


class LinearNet(nn.Module):
    """The smallest network a method takes: one edge with one op (α is ignored), optional dropout
    (for MC dropout members) and an optional 3x3 convolution before one linear layer."""

    num_edges, num_ops, num_classes = 1, 1, C

    def __init__(self, conv: bool = False, dropout: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, H, 3, padding=1) if conv else None
        self.dropout = nn.Dropout(0.5) if dropout else nn.Identity()
        self.fc = nn.Linear((H if conv else 3) * 4, C)

    def forward(self, x: Tensor, alpha: Tensor, replicate: bool = False) -> Tensor:
        if replicate:  # every example under each of the G structures: G rows, G dropout masks
            x = x.repeat_interleave(alpha.shape[0], dim=0)
        if self.conv is not None:
            x = self.conv(x)
        return self.fc(self.dropout(x.flatten(1)))


def _map(seed: int = 0, **net) -> MAP:
    torch.manual_seed(seed)
    dropout = net.get("dropout", False)
    return MAP(
        LinearNet(**net),
        learn_structure=False,
        dataset_size=10,
        weights=MCDropoutWeights(p=0.5, placement="existing") if dropout else None,
        prediction=Prediction(n_samples=3) if dropout else None,
    )


def _batch(b: int = 6) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, 2, 2, generator=g), torch.randint(0, C, (b,), generator=g)


def test_parameter_count_is_the_sum_by_hand():
    assert parameter_count(_map()) == D * C + C
    assert parameter_count(_map(conv=True)) == (3 * 9 * H + H) + (4 * H * C + C)
    assert parameter_count(DeepEnsemble([_map(s) for s in range(3)])) == 3 * (D * C + C)
    learned = MAP(LinearNet(), learn_structure=True, dataset_size=10)  # θ, (E, K) = (1, 1), counts
    assert parameter_count(learned) == D * C + C + 1
    frozen = _map()
    frozen.net.fc.bias.requires_grad_(False)
    assert parameter_count(frozen) == D * C


def test_training_flops_of_a_linear_layer_are_forward_and_weight_gradient():
    """addmm forward 2·d·c per image, and in backward only the weight gradient's mm 2·d·c: the
    images need no gradient (the bias gradient is a sum, not counted)."""
    x, y = _batch()
    assert training_flops_per_image(_map(), x, y) == 2 * D * C + 2 * D * C
    assert prediction_flops_per_image(_map(), x) == 2 * D * C


def test_training_flops_of_conv_then_linear_count_the_linear_input_gradient():
    """The convolution's backward is its weight gradient only (one forward's FLOPs); the linear
    layer's input (the conv's output) needs a gradient, so its backward is two forwards."""
    x, y = _batch()
    conv = 2 * H * 2 * 2 * 3 * 3 * 3  # 2·C_out·H_out·W_out·C_in·k·k
    fc = 2 * (4 * H) * C
    assert training_flops_per_image(_map(conv=True), x, y) == 2 * conv + 3 * fc
    assert prediction_flops_per_image(_map(conv=True), x) == conv + fc


def test_a_grouped_convolution_s_gradients_cost_its_forward_each():
    """A depthwise convolution's input and weight gradients cost one forward each: 2·C·H·W·k·k per
    gradient, not the dense convolution's C times as many (torch's own formula's count), so the
    fused cell's grouped convolutions count what the per-edge cell's count."""
    from dbsn.evaluation.cost import flop_counter_mode

    conv = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    forward = 2 * 2 * 16 * 8 * 8 * 3 * 3
    with flop_counter_mode() as counter:
        out = conv(x)
    assert counter.get_total_flops() == forward
    with flop_counter_mode() as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 2 * forward


def test_both_cells_cost_the_same_flops():
    from dbsn.methods import DBSN
    from dbsn.nets import StructureNet

    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,))
    counts = []
    for cell in ("per_edge", "fused"):
        torch.manual_seed(0)
        method = DBSN(
            StructureNet(
                num_classes=5, num_nodes=4, cells_per_stage=1, num_stages=2, growth=4, stem_channels=8, cell=cell
            ),
            train_samples=2,
            dataset_size=10,
        )
        counts.append((training_flops_per_image(method, x, y), prediction_flops_per_image(method, x)))
    assert counts[0] == counts[1]


def test_prediction_flops_grow_linearly_with_s():
    x, _ = _batch()
    method = _map(dropout=True)
    assert prediction_flops_per_image(method, x) == 3 * 2 * D * C  # S = 3
    method.n_samples = 1
    one = prediction_flops_per_image(method, x)
    method.n_samples = 4
    assert prediction_flops_per_image(method, x) == 4 * one == 4 * 2 * D * C


def test_a_deep_ensemble_costs_its_members_together():
    x, y = _batch()
    ensemble = DeepEnsemble([_map(s, conv=True) for s in range(3)])
    member = _map(conv=True)
    assert training_flops_per_image(ensemble, x, y) == 3 * training_flops_per_image(member, x, y)
    assert prediction_flops_per_image(ensemble, x) == 3 * prediction_flops_per_image(member, x)
    dropout = DeepEnsemble([_map(s, dropout=True) for s in range(2)])  # each member S = 3
    assert prediction_flops_per_image(dropout, x) == 2 * 3 * 2 * D * C


def _tiny_dbsn(train_samples: int, **settings) -> DBSN:
    torch.manual_seed(0)
    return DBSN(
        tiny_structure_net(num_classes=4),
        train_samples=train_samples,
        dataset_size=100,
        prediction=Prediction(n_samples=4, samples_per_forward=2),
        **settings,
    )


def test_dbsn_flops_are_a_shared_prefix_plus_t_or_s_structures():
    """StructureNet runs its structure-independent prefix (the stem) once per grouped forward,
    so a step's FLOPs are prefix + T · structure part; chunks of one structure run the prefix
    every time, and S members in forwards of one cost S times one member."""
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    one, two, three = (training_flops_per_image(_tiny_dbsn(t), x, y) for t in (1, 2, 3))
    assert 0 < one < two < 2 * one and three - two == two - one
    assert training_flops_per_image(_tiny_dbsn(2, train_samples_per_forward=1), x, y) == 2 * one
    method = _tiny_dbsn(1)  # S = 4, 2 members per forward
    four = prediction_flops_per_image(method, x)
    method.n_samples = 1
    single = prediction_flops_per_image(method, x)
    assert 2 * single < four < 4 * single
    method.n_samples, method.samples_per_forward = 4, 1
    assert prediction_flops_per_image(method, x) == 4 * single


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_measuring_leaves_the_method_as_it_was(mode):
    """Parameters, BatchNorm running statistics, schedule buffers, gradients, every module's
    mode and the global random stream, all as before."""
    method = _tiny_dbsn(2, weights=MCDropoutWeights(p=0.2))  # FBN-like: dropout, BatchNorm, sampled α
    method.train(mode == "train")
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    method.net.classifier.weight.grad = torch.ones_like(method.net.classifier.weight)
    before, modes = _state(method), {name: m.training for name, m in method.named_modules()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in method.named_parameters()}
    random_state = torch.get_rng_state()

    cost = measure_cost(method, x, y, epoch_seconds=1.5)

    after = _state(method)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert {name: m.training for name, m in method.named_modules()} == modes
    for n, p in method.named_parameters():
        assert (p.grad is None) == (grads[n] is None) and (p.grad is None or torch.equal(p.grad, grads[n]))
    assert torch.equal(torch.get_rng_state(), random_state)
    assert cost.n_samples == 4 and cost.epoch_seconds == 1.5 and cost.params == parameter_count(method)
    assert cost.train_flops_per_image > 0 and cost.predict_flops_per_image > 0
    assert cost.peak_memory_mib > 0 and cost.peak_memory_of == "cpu_max_rss"
    assert Cost(**cost.as_dict()) == cost


def test_measuring_a_method_on_a_trainer_counts_one_device_and_leaves_the_trainer():
    method, (x, y) = _map(conv=True), _batch()
    expected = training_flops_per_image(method, x, y)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(method, DataLoader(TensorDataset(x, y), batch_size=6))
    assert method.trainer is trainer
    assert training_flops_per_image(method, x, y) == expected
    assert method.trainer is trainer


def test_a_structure_parallel_rank_is_counted_as_the_whole_step():
    """On rank 0 of 2 structure-parallel devices the method evaluates T / 2 structures; the
    count is of one device's step with all T."""
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    method = _tiny_dbsn(2)
    whole = training_flops_per_image(method, x, y)
    method._trainer = SimpleNamespace(world_size=2, global_rank=0)
    assert method.local_training_structures()[0].shape[0] == 1
    assert training_flops_per_image(method, x, y) == whole


class _SlowValidation(MAP):
    def validation_step(self, batch, batch_idx: int) -> None:
        time.sleep(0.15)
        super().validation_step(batch, batch_idx)


def test_epoch_timer_times_each_training_epoch_without_validation():
    torch.manual_seed(0)
    method = _SlowValidation(LinearNet(), learn_structure=False, dataset_size=12)
    x, y = _batch(12)
    timer = EpochTimer()
    assert timer.mean_epoch_seconds is None
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer.fit(method, loader, DataLoader(TensorDataset(x[:4], y[:4]), batch_size=2))
    assert len(timer.epoch_seconds) == 2 and all(s > 0 for s in timer.epoch_seconds)
    assert all(s < 0.3 for s in timer.epoch_seconds)  # the two 0.15 s validation steps are left out
    assert timer.mean_epoch_seconds == pytest.approx(sum(timer.epoch_seconds) / 2)

    resumed = EpochTimer()
    resumed.load_state_dict(timer.state_dict())
    assert resumed.epoch_seconds == timer.epoch_seconds and resumed.state_dict() is not timer.state_dict()


def test_the_peak_memory_restarts_where_linux_lets_it():
    from pathlib import Path

    from dbsn.evaluation.cost import peak_memory_mib, reset_peak_memory

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs: the peak is the process's since it started")

    def resident_mib() -> float:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    before, what = peak_memory_mib()
    assert what == "cpu_max_rss" and before >= resident_mib() - 1
    del block
    reset_peak_memory()  # the peak becomes what the process holds now (freed memory it keeps counts)
    after, _ = peak_memory_mib()
    assert after <= resident_mib() + 8 and after <= before
    grown = torch.ones(3 * int(after + 64) * 2**20 // 4 // 3)  # more than the process held: a new peak
    assert peak_memory_mib()[0] >= after + 48
    del grown


# ---------------------------------------------------------------------- on a test pass's examples
def _inference_copies(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as a test pass keeps them: made under inference mode (Lightning's test loop)."""
    with torch.inference_mode():
        return tuple(t.clone() for t in tensors)


@pytest.mark.parametrize("caller", ["plain", "no_grad", "inference_mode"])
def test_examples_kept_from_a_test_pass_are_counted_like_any_other(caller):
    """`cost_of` measures the examples the test pass kept, made under inference mode, which autograd
    cannot save for backward. The training step's count is that of normal tensors, also when the
    caller is in `no_grad` or inference mode. The network takes x as it comes (channels_last off,
    the layout of a GPU and of bf16 on a CPU with native bf16), so the first convolution saves x
    itself: a channels-last copy of it would be a normal tensor."""
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    method = _tiny_dbsn(2)
    assert not method.channels_last
    expected = measure_cost(method, x, y)
    xi, yi = _inference_copies(x, y)
    assert xi.is_inference()
    context = {"plain": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[caller]
    with context():
        cost = measure_cost(method, xi, yi)
    assert cost.train_flops_per_image == expected.train_flops_per_image > 0
    assert cost.predict_flops_per_image == expected.predict_flops_per_image > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
def test_a_model_the_test_pass_left_on_the_cpu_is_counted_on_the_run_s_gpu():
    """After `trainer.test` Lightning's teardown leaves the model on the CPU and its kept examples
    on the GPU: `device` counts a copy on the GPU (the same FLOPs) and reads the GPU's peak memory,
    and the model stays where it was."""
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    method = _tiny_dbsn(2)
    expected = measure_cost(method, x, y)
    xi, yi = _inference_copies(x.cuda(), y.cuda())
    cost = measure_cost(method, xi, yi, device="cuda")
    assert cost.train_flops_per_image == expected.train_flops_per_image
    assert cost.predict_flops_per_image == expected.predict_flops_per_image
    assert cost.peak_memory_of == "cuda_max_allocated"
    assert all(p.device.type == "cpu" for p in method.parameters())


#: the methods whose S members are samples (the ensembles predict with their own M members)
SAMPLING = ("dbsn", "fbn", "mc_dropout", "bbb", "vogn", "vogn_fbn", "nekfac")


@pytest.mark.parametrize(
    "model",
    [
        "dbsn",
        "fbn",
        "map",
        "map_fixed",
        "mc_dropout",
        "bbb",
        "vogn",
        "vogn_fbn",
        "nekfac",
        "deep_ensemble",
        "batch_ensemble",
        "packed_ensemble",
        "mimo",
        "sngp",
    ],
)
def test_every_method_is_measured_on_inference_tensors_without_channels_last(model, tmp_path):
    """Each method as configured (small: DBSN's cell network with 3 nodes, Packed-Ensembles on a
    ResNet-18 of width 4, NEK-FAC on VGG16-BN at width 0.25), in the layout without channels-last,
    on a test pass's kind of examples: its training step's FLOPs are counted."""
    from dbsn.runtime.build import build_model
    from tests.support.configs import compose_config, small_model

    prefix = "model.member" if model == "deep_ensemble" else "model"
    if model == "packed_ensemble":
        overrides = ["model=packed_ensemble", "model/net=resnet18", "model.net.width=4"]
    elif model in ("batch_ensemble", "mimo", "sngp"):
        overrides = small_model(model, "model/net=structure_net")
    else:
        overrides = small_model(model)
    # S = 3 where a method samples its members (a count, not a cost); the ensembles keep their M
    samples = ["model.prediction.n_samples=3"] if model in SAMPLING else []
    cfg = compose_config("train", [*overrides, *samples, f"{prefix}.execution.channels_last=false"], tmp_path)
    method = build_model(cfg.model, num_classes=10)
    x, y = _inference_copies(torch.rand(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    cost = measure_cost(method, x, y)
    assert cost.train_flops_per_image > 0 and cost.predict_flops_per_image > 0
