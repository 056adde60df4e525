"""The settings a method is built with, each group as one object (a dataclass that the configs
build with `_target_`): how its weights are optimised (`WeightOptimizer`) and its structure
(`StructureOptimizer`), how it predicts (`Prediction`: S, the validation S, members per forward,
temperature scaling) and how its network runs (`Execution`: memory layout, convolution forms,
`Compilation`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from dbsn.nets.cell import CellBase
from dbsn.nets.conv_forms import CONV_1X1_FORMS, DEPTHWISE_FORMS, set_conv_forms

__all__ = ["Compilation", "Execution", "Prediction", "StructureOptimizer", "WeightOptimizer"]


@dataclass
class WeightOptimizer:
    """SGD on the network weights: the paper's CIFAR settings by default.

    Two lr schedules, stepped once per epoch:

    - `schedule="multistep"`: the lr is multiplied by `gamma` at the fractions `milestones` of
      `max_epochs` (paper, CIFAR: 50% / 75%; the research code used 60% / 80%);
    - `schedule="linear"`: constant until the fraction `decay_start` of `max_epochs`, then
      decreasing linearly to 0 at the end (the CamVid recipe: constant for 350 of 850 epochs).

    `warmup_epochs` > 0 ramps the lr linearly from 1 / steps of the warm-up up to the schedule's
    over that many epochs, step by step (uncertainty-baselines' CIFAR recipes: 1 epoch).
    """

    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    nesterov: bool = False
    grad_clip_norm: float | None = 5.0
    milestones: Sequence[float] = (0.5, 0.75)
    gamma: float = 0.1
    schedule: str = "multistep"
    decay_start: float = 0.5
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        self.milestones = tuple(float(m) for m in self.milestones)
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if any(not 0 < m < 1 for m in self.milestones):
            raise ValueError(f"milestones are fractions of training in (0, 1), got {self.milestones}")
        if self.schedule not in ("multistep", "linear"):
            raise ValueError(f"schedule must be 'multistep' or 'linear', got {self.schedule!r}")
        if not 0 <= self.decay_start < 1:
            raise ValueError(f"decay_start is a fraction of training in [0, 1), got {self.decay_start}")
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        # the other schedule's settings are not read: a value other than its default would be ignored
        if self.schedule == "linear" and (self.milestones != (0.5, 0.75) or self.gamma != 0.1):
            raise ValueError(
                f"milestones={list(self.milestones)} and gamma={self.gamma} drop the lr of "
                "schedule=multistep, and schedule=linear does not read them (it decays linearly from "
                "decay_start): leave them at [0.5, 0.75] and 0.1, or set schedule=multistep"
            )
        if self.schedule == "multistep" and self.decay_start != 0.5:
            raise ValueError(
                f"decay_start={self.decay_start} is where schedule=linear starts to decay, and "
                "schedule=multistep does not read it (its lr drops at the milestones): leave it at 0.5, "
                "or set schedule=linear"
            )

    def warmup_factor(self, epoch: int, batch_idx: int, batches_per_epoch: float) -> float:
        """The lr's multiplier at step `batch_idx` of `epoch` under the linear warm-up: the
        fraction of `warmup_epochs` done after this step, (epoch + (batch_idx + 1) / batches) /
        warmup_epochs, at most 1 (uncertainty-baselines' WarmUpPiecewiseConstantSchedule: one
        epoch). 1 without a warm-up or an epoch length (an iterable without a length)."""
        if self.warmup_epochs <= 0 or not math.isfinite(batches_per_epoch) or batches_per_epoch <= 0:
            return 1.0
        return min(1.0, (epoch + (batch_idx + 1) / batches_per_epoch) / self.warmup_epochs)

    def build(
        self,
        params,
        max_epochs: int,
        no_decay=(),
        lr_scales: Mapping[int, float] | None = None,
        capturable: bool = False,
    ):
        """SGD over `params` and its lr schedule. The parameters of `params` that are also in
        `no_decay` (a Gaussian posterior's scales, see `WeightPosterior.no_decay_parameters`)
        form a second param group with weight decay 0, in the same optimiser, so that gradient
        clipping and the lr schedule still cover the whole group of weights. `lr_scales`
        ({id(parameter): multiplier}, see `Method.lr_scales`) gives parameters a multiple of
        the lr, in param groups of their own (the schedule scales every group alike).

        PyTorch's fused SGD (one kernel for all parameters, and an update it skips on the device
        when a non-finite loss set its ``found_inf``: `dbsn.methods.step.FiniteGuard`).
        `capturable`: every group's lr is a tensor on the parameters' device, which the schedule
        writes in place, so that a CUDA graph of the step sees each new value."""
        params, skip, scales = list(params), {id(p) for p in no_decay}, dict(lr_scales or {})
        by_kind: dict[tuple[bool, float], list] = {}
        for p in params:
            by_kind.setdefault((id(p) in skip, float(scales.get(id(p), 1.0))), []).append(p)

        def lr(scale: float):
            return torch.tensor(self.lr * scale, device=params[0].device) if capturable else self.lr * scale

        groups = [
            {"params": by_kind[kind], **({"weight_decay": 0.0} if kind[0] else {}), "lr": lr(kind[1])}
            for kind in sorted(by_kind, key=lambda k: (k[0], k[1] != 1.0, k[1]))
        ]
        opt = torch.optim.SGD(
            groups,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
            fused=True,
        )
        if self.schedule == "linear":
            start = round(self.decay_start * max_epochs)
            span = max(1, max_epochs - start)
            return opt, torch.optim.lr_scheduler.LambdaLR(
                opt, lambda epoch: min(1.0, max(0.0, (max_epochs - epoch) / span))
            )
        epochs = sorted({max(1, round(m * max_epochs)) for m in self.milestones})
        return opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=epochs, gamma=self.gamma)


@dataclass
class Compilation:
    """`torch.compile` of the network's forward, for training steps and prediction alike.

    One training step of the paper's network dispatches thousands of small operations, each
    launched from Python (docs/performance.md counts them); on a GPU their number, not the
    arithmetic, sets the pace. Compiled, the
    forward and its backward become a few fused kernels. The structures α reach the graph as a
    tensor input, so a new draw (and new τ, β, which only shape α) reuses the graph: after the
    first steps nothing recompiles (tested). New shapes compile once more each: the number of
    structures per forward (T in training, `samples_per_forward` at prediction), a last short
    batch, train / eval mode.

    Args:
        enabled: compile (off by default).
        scope: "network" (the whole forward), "cells" (regional compilation: each cell's
            forward on its own, every cell shape compiled once, so a compiler sees one cell at a
            time instead of the whole network; tested: nothing recompiles after the first step) or
            "nodes" (the fused cell's nodes, everything after its input projection
            (`FusedCell.nodes`), with static shapes and the running-statistics bookkeeping outside
            the graph: one graph per distinct cell shape, 4 for the paper's network, where "cells"
            makes one per cell; the projection, the stem and the head run eagerly. Only for a
            network of fused cells (``model.net.cell=fused``). Its graphs are the same under a CUDA
            graph's capture: `GraphedStep` warms up with the capture's autocast settings).
        mode: inductor's mode: "default", "reduce-overhead" (CUDA graphs: least launch
            overhead, fixed input shapes), "max-autotune", "max-autotune-no-cudagraphs".
        backend: "inductor" (needs a C++ compiler on a CPU, Triton on a GPU), or "aot_eager"
            / "eager" to check that a problem lies in code generation.
        dynamic: torch.compile's `dynamic` (None: specialise, then generalise a dimension
            that changes; with scope "nodes", None means static shapes: a shared first cell's
            fewer rows would otherwise turn dynamic shapes on, which trace several times slower).
        fullgraph: refuse graph breaks (an error instead of a slower split graph).
        cache: keep the compiler's work for the next start (on by default; nothing without
            ``enabled``): a training run writes `torch.compiler.save_cache_artifacts()` to
            ``compile_cache.bin`` in its folder after its first steps (and again when later
            phases compiled more), and loads it when it starts again there (``resume=true``), so
            the compiler finds its graphs and kernels instead of generating them (on a GPU the
            Triton binaries too: valid for the same torch, Triton and GPU model). A file that
            cannot be read is noted and the run compiles cold.
        cache_from: an earlier run's ``compile_cache.bin`` to load when this run's folder holds
            none (a new run, a fresh machine), so that it too starts warm.
    """

    enabled: bool = False
    scope: str = "network"
    mode: str = "default"
    backend: str = "inductor"
    dynamic: bool | None = None
    fullgraph: bool = False
    cache: bool = True
    cache_from: str | None = None

    MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    SCOPES = ("network", "cells", "nodes")

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"compile.mode must be one of {self.MODES}, got {self.mode!r}")
        if self.scope not in self.SCOPES:
            raise ValueError(f"compile.scope must be one of {self.SCOPES}, got {self.scope!r}")
        if self.backend != "inductor" and self.mode != "default":
            raise ValueError(f"compile.mode={self.mode!r} is an inductor mode; backend {self.backend!r} takes none")

    def apply(self, net: nn.Module) -> None:
        """Compile `net`'s forward, each of its cells', or each fused cell's nodes (`scope`), in place
        (the state dict keeps its keys)."""
        options = {"mode": self.mode} if self.backend == "inductor" else {}
        if self.scope == "nodes":
            self._apply_to_nodes(net, options)
            return
        targets = [net] if self.scope == "network" else [m for m in net.modules() if isinstance(m, CellBase)]
        if not targets:
            raise ValueError(f"compile.scope=cells: {type(net).__name__} has no cells; use compile.scope=network")
        if self.scope == "cells":
            # every cell's forward is one code object to dynamo: each cell shape (a dense cell's width grows
            # cell by cell), in training and evaluation, is one entry of its cache, whose default of 8 entries
            # would send the later cells back to eager
            _raise_recompile_limit(8 * len(targets))
        for module in targets:
            module.compile(backend=self.backend, dynamic=self.dynamic, fullgraph=self.fullgraph, **options)

    def _apply_to_nodes(self, net: nn.Module, options: dict) -> None:
        from dbsn.nets.fused_cell import FusedCell

        cells = [m for m in net.modules() if isinstance(m, CellBase)]
        if not cells or not all(isinstance(m, FusedCell) for m in cells):
            kind = "no cells" if not cells else "per-edge cells"
            raise ValueError(
                f"compile.scope=nodes compiles the fused cell's nodes, and this {type(net).__name__} has "
                f"{kind}: set model.net.cell=fused, or compile.scope=cells or network"
            )
        # one code object (`FusedCell.nodes`) for all cells: an entry per shape, mode and autocast state
        _raise_recompile_limit(8 * len(cells))
        for cell in cells:
            cell.compile_nodes(
                backend=self.backend,
                dynamic=False if self.dynamic is None else self.dynamic,
                fullgraph=self.fullgraph,
                **options,
            )


def _raise_recompile_limit(entries: int) -> None:
    """Let dynamo keep at least `entries` graphs per code object before it runs one eagerly."""
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, entries)


@dataclass
class StructureOptimizer:
    """Adam on the structure logits θ (paper: lr 3e-4, betas (0.5, 0.999), no weight decay)."""

    lr: float = 3e-4
    betas: Sequence[float] = field(default=(0.5, 0.999))
    weight_decay: float = 0.0

    def build(self, params, capturable: bool = False):
        """Fused Adam (one kernel; skips its update on the device with ``found_inf``, see
        `WeightOptimizer.build`); `capturable`: its step count on the device, for a CUDA graph."""
        return torch.optim.Adam(
            params,
            lr=self.lr,
            betas=tuple(self.betas),
            weight_decay=self.weight_decay,
            fused=True,
            capturable=capturable,
        )


@dataclass
class Prediction:
    """How a method predicts: the Bayes ensemble of S members (`dbsn.methods.predictive`).

    Args:
        n_samples: S, members of the test-time ensemble (1 for deterministic methods).
        val_samples: members used for validation during training (cheaper than S).
        samples_per_forward: members evaluated in one batched forward (bounds memory).
        rows_per_forward: the most network rows (examples × members) one prediction forward
            holds; a larger forward runs its examples in parts, every part under the same
            members. A member's network treats each example on its own, so the numbers change
            at most by float rounding (a smaller product may sum in another order; bit for bit
            on `make train`'s network; tested). None: no bound. It bounds the memory of a
            forward without changing `samples_per_forward`, which sets how the ensemble is
            summed. It applies where a method predicts through `Method.stochastic_forward`
            (DBSN, MAP, MAP-fixed, SNGP, DDU, and such members of a deep ensemble); methods
            with a forward of their own (the single-pass ensembles, the rank-1 BNN, VOGN,
            NEK-FAC, cSG-MCMC, SWAG, Laplace) and weights that draw noise at every forward
            (`WeightPosterior.stochastic`: a split would draw other noise) keep their forwards
            whole.
        temperature_scaling: after training, fit a temperature on the validation split (Guo et
            al. 2017) and apply it to every prediction; refused without a validation split
            (checked before training starts).
    """

    n_samples: int = 1
    val_samples: int = 1
    samples_per_forward: int = 10
    rows_per_forward: int | None = None
    temperature_scaling: bool = False

    def __post_init__(self) -> None:
        for key in ("n_samples", "val_samples", "samples_per_forward"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"prediction.{key} must be >= 1, got {getattr(self, key)}")
        if self.rows_per_forward is not None and int(self.rows_per_forward) < 1:
            raise ValueError(f"prediction.rows_per_forward must be >= 1 (or null), got {self.rows_per_forward}")


@dataclass
class Execution:
    """How the network runs; no setting changes what it computes (the convolution forms change
    only the order of its sums: equal to round-off; tested).

    Args:
        channels_last: keep the network's weights and activations in the channels-last (NHWC)
            layout; "auto" (the configs' default, which the runtime resolves for the trainer's
            device and precision) means on where the network is compiled and no GPU is available:
            with the fused cell, eager steps run faster contiguous on CPUs and GPUs alike, and a
            compiled CPU step fastest in channels-last (docs/performance.md).
        compile: compile the network's forward (`Compilation`); off by default.
        cuda_graph: capture the whole training step (forward, backward, optimisers) in a CUDA
            graph after three eager steps and replay it (`dbsn.methods.step.GraphedStep`): one
            launch instead of thousands; one GPU, the methods that say they support it
            (`Method.cuda_graph_refusal`); "auto": where it can (one GPU, a method that supports it),
            eager steps elsewhere (`speed=fast`). Off by default.
        cuda_graph_prediction: the prediction's network forward (S members in forwards of
            `samples_per_forward`) captured per input shape and replayed
            (`dbsn.methods.step.GraphedForward`), where the members use the modules' own BatchNorm
            statistics; on a GPU, without gradients. Off by default: on an H200 it predicted 3 % more
            images/s than eager prediction (docs/performance.md).
        conv_1x1: how the fused cell's grouped 1×1 convolutions compute (`dbsn.nets.conv_forms`):
            "conv" (`F.conv2d`: cuDNN on a GPU, which runs several kernels of its own for every
            grouped convolution and which a compiler calls as they are), "bmm" (a batched matrix
            product over (example, edge)) or "mulsum" (a multiply and a sum over the input
            channels): the same sums as tensor arithmetic that a compiler fuses with the work
            around them. Refused on a network without fused cells (the per-edge cell, backbones).
        depthwise: how the fused cell's depthwise 3×3 convolutions (dilation 1 and 2) compute:
            "conv" (`F.conv2d`) or "stencil" (9 shifted multiply-adds on the zero-padded input,
            elementwise work a compiler fuses). Refused like `conv_1x1`. "auto" (either): the form
            measured fastest where the layer runs (`dbsn.nets.conv_forms.AUTO_FORMS`: the 1×1s as
            a batched matmul on a GPU, `F.conv2d` elsewhere), never refused (`speed=fast` sets it).
        weight_copies: under mixed precision, the convolution weights (`nn.Conv2d` and the fused
            cell's stacked convolutions in every form; not Gaussian layers, whose weights are
            drawn) cast to the autocast dtype once per training step, in one concatenation and one
            cast, instead of one cast per convolution and one per weight gradient back
            (`dbsn.methods.weight_copies`): the same step bit for bit, and a weight that a step does
            not use keeps no gradient, as without. It composes with `cuda_graph` (the copies are
            made inside the captured step) and with `compile` (the compiled regions take the copies
            as inputs; nothing recompiles from step to step). Refused at the first training step
            without mixed precision. Off by default: it saves small kernels, whose cost only a GPU
            can measure.
    """

    channels_last: bool | Literal["auto"] = False
    compile: Compilation = field(default_factory=Compilation)
    cuda_graph: bool | Literal["auto"] = False
    cuda_graph_prediction: bool = False
    conv_1x1: str = "conv"
    depthwise: str = "conv"
    weight_copies: bool = False

    def __post_init__(self) -> None:
        if self.channels_last not in (True, False, "auto"):
            raise ValueError(f"execution.channels_last must be true, false or auto, got {self.channels_last!r}")
        if self.cuda_graph not in (True, False, "auto"):
            raise ValueError(f"execution.cuda_graph must be true, false or auto, got {self.cuda_graph!r}")
        if self.conv_1x1 not in CONV_1X1_FORMS:
            raise ValueError(f"execution.conv_1x1 must be one of {list(CONV_1X1_FORMS)}, got {self.conv_1x1!r}")
        if self.depthwise not in DEPTHWISE_FORMS:
            raise ValueError(f"execution.depthwise must be one of {list(DEPTHWISE_FORMS)}, got {self.depthwise!r}")

    def apply_conv_forms(self, net: nn.Module) -> int:
        """Set the forms of `net`'s fused-cell convolutions (`dbsn.nets.conv_forms.set_conv_forms`:
        a form other than "conv" is refused on a network that has none); how many were set. Both
        at "conv" leave `net` as it is: a network is built in that form, and one that a method
        shares with the method that built it (a deep ensemble's first member, a fixed-structure
        posthoc method) keeps the forms that method set."""
        if (self.conv_1x1, self.depthwise) == ("conv", "conv"):
            return 0
        return set_conv_forms(net, conv_1x1=self.conv_1x1, depthwise=self.depthwise)

    @property
    def uses_channels_last(self) -> bool:
        """Whether the network runs in the channels-last layout ("auto": compiled where no GPU is
        available)."""
        if self.channels_last == "auto":
            return self.compile.enabled and not torch.cuda.is_available()
        return bool(self.channels_last)
