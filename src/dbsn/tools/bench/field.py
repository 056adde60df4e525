"""The field's "ensemble at the cost of one network" claims, as ratios within one run.

    python -m dbsn.tools.bench --suite field [--backbone resnet18|wrn28_10|structure_net]
                                             [--size quick|paper] [--batch 64] [--repeats 5]

On one backbone, every method of the field is built as the field sweep's job builds it
(`conf/field/<backbone>/<method>.yaml`: its M, dropout rate, S; else the method's own config) and
timed on the same batch in interleaved repetitions (median): ``train``, one training step with the
method's own loss; ``predict``, the test-time prediction of one batch by all the method's members,
in eval mode. Each method's seconds are divided by one network's (`map_fixed`) on the same
backbone (a deep ensemble of M costs about M in both; the single-pass ensembles claim about 1 at
prediction), and the prediction also by S single networks (S = the method's members). Parameters
are counted too. `--size quick` narrows the backbone to run on a CPU in minutes (ResNet-18 width
16, WideResNet-16-2, DBSN's small cell network); `paper` is the published size. What each
method's step and prediction hold, and the results: docs/performance.md.
"""

from __future__ import annotations

import statistics
from datetime import date
from types import SimpleNamespace

import torch

from dbsn.tools.bench.common import _device_name, timed_call
from dbsn.tools.compare import DROPOUT_PLACEMENT

#: The methods timed on every backbone (config names, and `SNAPSHOT`'s), one network first.
FIELD_METHODS = (
    "map_fixed",
    "mc_dropout",
    "deep_ensemble",
    "batch_ensemble",
    "rank1_bnn",
    "packed_ensemble",
    "masksembles",
    "mimo",
    "sngp",
    "ddu",
    "snapshot_ensemble",
    "csghmc",
)
#: A snapshot ensemble: (its name, the method of the run it collects): that run under
#: `callbacks=snapshot_ensemble`, predicting with its M snapshots (`posthoc=snapshot_ensemble`).
SNAPSHOT = ("snapshot_ensemble", "map_fixed")
#: Methods that run only on DBSN's cell network, timed when the backbone is structure_net.
CELL_METHODS = ("dbsn", "csghmc_structure")
#: The length of the run a cSG-MCMC sampler is built for: 100 CIFAR epochs at batch 64 (its cycles divide it).
SAMPLER_RUN_STEPS = 100 * 782
#: Network overrides of each backbone at each size.
SIZES = {
    "resnet18": {"quick": ["width=16"], "paper": [], "tiny": ["width=10"]},
    "wrn28_10": {"quick": ["depth=16", "widen_factor=2"], "paper": [], "tiny": ["depth=10", "widen_factor=1"]},
    "structure_net": {
        "quick": ["num_nodes=4", "cells_per_stage=1"],
        "paper": [],
        "tiny": ["num_nodes=3", "cells_per_stage=1", "num_stages=2", "growth=10", "stem_channels=16"],
    },
}  # tiny: the suite's tests (Masksembles' masks need 10 channels in a layer)


def build_method(method: str, backbone: str, size: str = "quick", num_classes: int = 10, extra: list[str] = ()):
    """`method` on `backbone` as the field sweep's job builds it (conf/field/<backbone>/<method>.yaml:
    its M, dropout rate, S), else as the method's own config does; the network's width from `SIZES`."""
    from hydra import compose, initialize_config_dir

    from dbsn.runtime.build import build_model
    from dbsn.runtime.config import CONF_DIR

    key = "model.member" if method == "deep_ensemble" else "model"
    sizes = [f"{key}.net.{o}" for o in SIZES[backbone][size]]
    if (CONF_DIR / "field" / backbone / f"{method}.yaml").is_file():  # the field sweep's job: its M, rates, S
        overrides = [f"field={backbone}/{method}", *sizes, *extra]
    else:
        choice = "model/net@model.member.net" if method == "deep_ensemble" else "model/net"  # the members' network
        overrides = [f"model={method}", f"{choice}={backbone}", *sizes, *extra]
        if method == "deep_ensemble":
            overrides.append("model.size=4")  # the field's ensembles of 4
        if method == "mc_dropout" and backbone in DROPOUT_PLACEMENT:  # no cells: the field's placement
            overrides.append(f"model.weights.placement={DROPOUT_PLACEMENT[backbone]}")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    torch.manual_seed(0)
    return build_model(cfg.model, num_classes)


def snapshot_ensemble(backbone: str, size: str = "quick", num_classes: int = 10):
    """The run a snapshot ensemble collects (`SNAPSHOT`'s method on `backbone`), its collector as
    conf/callbacks/snapshot_ensemble.yaml builds it (M, α₀), and the ensemble of M snapshots it predicts
    with (copies of the run's state: the time does not depend on the weights)."""
    import copy

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from dbsn.posthoc.snapshot_ensemble import SnapshotEnsembleMethod
    from dbsn.runtime.config import CONF_DIR

    method = build_method(SNAPSHOT[1], backbone, size, num_classes)
    collector = instantiate(OmegaConf.load(CONF_DIR / "callbacks" / "snapshot_ensemble.yaml").snapshot_ensemble)
    cycles = collector.schedule.cycles
    return (
        method,
        collector,
        SnapshotEnsembleMethod([copy.deepcopy(method) for _ in range(cycles)], list(range(cycles))),
    )


def training_step(method, x: torch.Tensor, y: torch.Tensor, collector=None):
    """A callable running one training step of `method` as `Method.training_step` does, without
    Lightning's logging (the same as the cpu suite's); with a snapshot ensemble's `collector`, which
    sets the weights' lr before the step."""
    for m in (method, *getattr(method, "members", ())):  # as on_fit_start sets it (a deep ensemble's members too)
        m.dataset_size = 50_000
    groups = method.weight_parameter_groups()
    if hasattr(method, "run_optimizers"):  # cSG-MCMC: its sampler (and the structure sampler's weights' SGD)
        opts = method.run_optimizers(SAMPLER_RUN_STEPS, 100)[0]
    else:
        opts = [method.optim.build(group, 100, method.no_decay_parameters(), method.lr_scales())[0] for group in groups]
        if method.structure_parameters():
            opts.append(method.structure_optimizer().build(method.structure_parameters()))
    method.attach_guard(opts)  # the NaN guard on the device, as in training (no host read per step)
    trainer = SimpleNamespace(
        optimizers=opts, lr_scheduler_configs=groups, current_epoch=0, num_training_batches=1, max_epochs=100
    )  # what the collector reads of a trainer

    def step():
        method.train()  # every step: the prediction's call (the same method, interleaved) leaves it in eval mode
        if collector is not None:
            collector.set_lr(trainer, 0)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        method.accumulate_gradients(x, y, lambda loss, last: loss.backward())
        if method.optim.grad_clip_norm:
            for group in groups:
                torch.nn.utils.clip_grad_norm_(group, method.optim.grad_clip_norm)
        for opt in opts:
            opt.step()
        method.on_after_optimizer_step(x.shape[0])

    return step


def keep_samples(method) -> None:
    """A cSG-MCMC method's members: as many samples as its run keeps (copies of its state now: the
    time does not depend on the weights)."""
    for step in range(method.sampler.schedule.kept):
        method.keep_sample(step)


def prediction(method, x: torch.Tensor):
    """A callable predicting `x` with every member of `method`'s ensemble, in eval mode."""

    def predict():
        method.eval()
        method.enable_test_noise()
        with torch.inference_mode():
            method.predict_log_probs(x)

    return predict


def run(
    backbone: str = "resnet18",
    size: str = "quick",
    batch: int = 64,
    repeats: int = 5,
    device: str = "auto",
    methods: tuple[str, ...] | None = None,
) -> dict:
    """Seconds (median over `repeats`) and ratios to one network of every method on `backbone`."""
    from dbsn.evaluation.progress import progress

    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    names = methods or (FIELD_METHODS + (CELL_METHODS if backbone == "structure_net" else ()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    calls, parameters, members = {}, {}, {}
    for name in names:
        if name == SNAPSHOT[0]:  # one network's run under the callback; its M snapshots at prediction
            method, collector, ensemble = snapshot_ensemble(backbone, size)
            method, ensemble = method.to(dev), ensemble.to(dev)
        else:
            method, collector = build_method(name, backbone, size).to(dev), None
            ensemble = method
            if hasattr(method, "keep_sample"):  # cSG-MCMC: the samples a run keeps
                keep_samples(method)
        parameters[name] = sum(p.numel() for p in ensemble.parameters() if p.requires_grad)
        members[name] = ensemble.num_members
        calls[name, "train"] = training_step(method, x, y, collector)
        calls[name, "predict"] = prediction(ensemble, x)
    for call in calls.values():  # warm-up (allocator, lazy initialisation)
        call()
    times = {key: [] for key in calls}
    for _ in progress(range(repeats), desc=f"bench field ({backbone}, {size})"):
        for key, call in calls.items():  # interleaved: every case sees the same machine state
            times[key].append(timed_call(call, dev))
    seconds = {f"{name} {what}": statistics.median(times[name, what]) for name, what in calls}
    one = {what: seconds[f"map_fixed {what}"] for what in ("train", "predict")}
    return {
        "date": date.today().isoformat(),
        "device": _device_name(dev),
        "torch": torch.__version__,
        "backbone": backbone,
        "size": size,
        "batch": batch,
        "repeats": repeats,
        "parameters": parameters,
        "members": members,
        "seconds": seconds,
        "ratios": {
            f"{name} {what} / map_fixed {what}": seconds[f"{name} {what}"] / one[what]
            for name in names
            if name != "map_fixed"
            for what in ("train", "predict")
        },
        # the S-member prediction against S single networks: below 1, the members share work
        "prediction_per_member": {
            name: seconds[f"{name} predict"] / (members[name] * one["predict"]) for name in names
        },
    }


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]dbsn bench field[/] {result['date']} on {result['device']}, torch {result['torch']}, "
        f"{result['backbone']} ({result['size']}), batch {result['batch']}, median of {result['repeats']}"
    )
    table = Table(
        "method",
        "parameters",
        "members",
        "train s",
        "train / one network",
        "predict s",
        "predict / one network",
        "predict / members × one network",
    )
    for name, count in result["parameters"].items():
        ratio = lambda what: (
            "1" if name == "map_fixed" else f"{result['ratios'][f'{name} {what} / map_fixed {what}']:.2f}"
        )  # noqa: E731
        table.add_row(
            name,
            f"{count:,}",
            str(result["members"][name]),
            f"{result['seconds'][f'{name} train']:.4f}",
            ratio("train"),
            f"{result['seconds'][f'{name} predict']:.4f}",
            ratio("predict"),
            f"{result['prediction_per_member'][name]:.2f}",
        )
    console.print(table)
