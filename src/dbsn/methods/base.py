"""What every classification method shares, so that a method differs only where it differs.

A method is a LightningModule that joins a network (which takes the structure α as an input) with
the method's distribution on structure or weights, and owns loss and optimisers. `Method` gives:

- its settings (`Prediction`, `Execution`, `WeightOptimizer`, the task) and their names;
- the loss (Eq. 3 per example), mean NLL + (structure KL + weight KL) / N, over T structures
  (Eq. 6-7) in one grouped forward (`x.repeat_interleave(T)`: row r uses α_{r mod T}) or in chunks of
  `train_samples_per_forward` structures with accumulated gradients (a memory knob: BatchNorm is
  per structure, so the chunks give the grouped step's gradients and statistics);
- two ways to use several devices (`parallel`): "data" (each rank its own batch and T structures)
  or "structure" (every rank the same batch and its share of the T structures, gradients and
  running statistics averaged: exactly one device's T-structure step);
- the weight side through a `WeightPosterior` (point, MC dropout, Gaussian/BBB); Bayes-ensemble
  prediction (`predictive.BayesEnsemble`) with the test metrics `test/{error,nll,brier,ece}`.

How its step runs comes from `dbsn.methods.training.TrainingLoop`, what detection scores read from
`dbsn.methods.features.MemberFeatures`. Subclasses draw structures: `training_structures(T) -> (α
(T, E, K), each one's KL (T,), or 0)`, `prediction_structures(n) -> α (n, E, K)`; that is all
DBSN, MAP and MAP-fixed α differ in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import ClassVar, Literal, get_args

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from dbsn.methods.features import MemberFeatures
from dbsn.methods.predictive import BayesEnsemble, EnsembleStream, PredictedBatch
from dbsn.methods.settings import Execution, Prediction, WeightOptimizer
from dbsn.methods.step import GraphedForward
from dbsn.methods.tasks import Classification
from dbsn.methods.temperature import TemperatureScaler, fit_temperature, require_validation
from dbsn.methods.training import TrainingLoop
from dbsn.methods.weights import WeightPosterior
from dbsn.metrics.classification import UncertaintyMetrics
from dbsn.metrics.uncertainty import uncertainty_decomposition

#: How several devices share a training step (see `Method`'s `parallel`).
Parallel = Literal["data", "structure"]
PARALLEL_MODES: tuple[str, ...] = get_args(Parallel)

#: The networks a method trains (`Method.networks`).
Networks = Literal["cells", "any", "own"]


class Method(TrainingLoop, MemberFeatures, pl.LightningModule):
    """A method: a network joined with the distributions it puts on its structure and weights,
    trained by the loss it owns and predicting with a Bayes ensemble of S members; for image
    classification or, by its `task`, segmentation. See the module docstring.

    Args:
        net: the network; `net.num_classes` gives the number of classes.
        optim: settings of the weights' optimiser.
        weights: the weight posterior (default: point estimate).
        prediction: S and how the ensemble is evaluated (`Prediction`).
        execution: memory layout, convolution forms and compilation of the network (`Execution`).
        task: classification (default) or `Segmentation` (per-pixel labels with a void
            label); see `dbsn.methods.tasks`.
        dataset_size: N in the per-example loss `NLL + KL / N`; `None` reads it from the
            data module at the start of training.
        train_samples: T, structures per training step (one grouped forward).
        parallel: how several devices share a step. "data": each rank draws its own batch and
            its own T structures (the effective batch grows with the device count).
            "structure": every rank sees the same batch and evaluates T / world size of the T
            structures (T must be a multiple of the device count). With point-estimate weights
            this is exactly one device's step; with stochastic weights (FBN) the ranks share
            the weight noise stream, so their blocks' noise is correlated.
        train_samples_per_forward: structures per grouped forward in training; None = all of
            this rank's structures at once. Smaller values run the structures one chunk after
            another and accumulate their gradients: the same step, at about
            train_samples_per_forward / T of the activation memory.

    Subclasses take their own settings and pass the rest on by keyword (`**settings`).
    """

    #: the ensemble sizes whose prefix ensembles `test_step` returns (a test pass's recorder sets
    #: them for the MC-sample ablation; none otherwise)
    prefix_sizes: tuple[int, ...] = ()

    # What the method is, declared for `dbsn.methods.registry`, which reads it with the method's
    # config without building anything (compare's choices and settings, the report's names). A
    # method that samples neither has its members fixed by its network (one network, or M members
    # inside it: S does not apply) unless its config's weight posterior samples (MC dropout, BBB).
    #: It draws structures α from a posterior q(α | θ) under DBSN's τ and β schedules (DBSN, FBN, VOGN-FBN).
    samples_structure: ClassVar[bool] = False
    #: It draws weights from a posterior of its own, not its config's `weights` (VOGN, NEK-FAC).
    samples_weights: ClassVar[bool] = False
    #: It draws its S prediction members in a way of its own, neither of the two above (an
    #: extension's structures drawn at random): S applies to it.
    samples_members: ClassVar[bool] = False
    #: The networks it trains: "cells" (DBSN's cell network only), "any" (the cell network or a
    #: residual backbone, e.g. ResNet-18, WideResNet), "own" (its own network only).
    networks: ClassVar[Networks] = "any"
    #: Where its config sets the weights' optimiser (whose `lr` is the base learning rate).
    optimizer_key: ClassVar[str] = "optim"
    #: The settings of its config that tell apart the methods it implements (a run is named by
    #: them): its task and its weight posterior (DBSN with Gaussian weights is FBN).
    variant_keys: ClassVar[tuple[str, ...]] = ("task", "weights")
    #: Its `Prediction` when none is given: `Prediction`'s own defaults updated by these, the one
    #: place a method's default S is written (its conf/model/ configs state the same S:
    #: tests/test_defaults.py).
    prediction_defaults: ClassVar[dict[str, int]] = {}

    def __init__(
        self,
        net: nn.Module,
        *,
        optim: WeightOptimizer | None = None,
        weights: WeightPosterior | None = None,
        prediction: Prediction | None = None,
        execution: Execution | None = None,
        task: Classification | None = None,
        dataset_size: int | None = None,
        train_samples: int = 1,
        parallel: Parallel = "data",
        train_samples_per_forward: int | None = None,
    ) -> None:
        super().__init__()
        self.task = task if task is not None else Classification()
        self.weights = weights if weights is not None else WeightPosterior()
        self.net = self.weights.prepare(net)
        self.prediction = prediction if prediction is not None else Prediction(**self.prediction_defaults)
        self.execution = execution if execution is not None else Execution()
        if self.execution.uses_channels_last:
            self.net.to(memory_format=torch.channels_last)
        self.execution.apply_conv_forms(self.net)
        if self.execution.compile.enabled:
            self.execution.compile.apply(self.net)
        self.optim = optim if optim is not None else WeightOptimizer()
        if train_samples < 1:
            raise ValueError(f"train_samples (T) must be >= 1, got {train_samples}")
        self.train_samples = train_samples
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        self.parallel = parallel
        if train_samples_per_forward is not None and train_samples_per_forward < 1:
            raise ValueError(f"train_samples_per_forward must be >= 1 (or null), got {train_samples_per_forward}")
        self.train_samples_per_forward = train_samples_per_forward
        self.dataset_size = dataset_size
        self.num_classes = num_classes = net.num_classes
        self.val_metrics = self.task.make_metrics(num_classes)
        self.test_metrics = self.task.make_metrics(num_classes)
        self.test_uncertainty = UncertaintyMetrics()
        # post-hoc temperature, fitted on the validation split after training (T = 1 until then)
        self.temperature = TemperatureScaler()
        # a post-hoc calibration map after it (`calibrate`), set by `dbsn.posthoc.calibrators`
        self.calibrator: nn.Module | None = None
        # the prediction's network forward in CUDA graphs (execution.cuda_graph_prediction)
        self._graphed_network = (
            GraphedForward(self.network, self._module_modes) if self.execution.cuda_graph_prediction else None
        )

    # ------------------------------------------------------------------ the settings, by name
    @property
    def n_samples(self) -> int:
        """S (`prediction.n_samples`)."""
        return self.prediction.n_samples

    @n_samples.setter
    def n_samples(self, value: int) -> None:
        self.prediction.n_samples = int(value)

    def use_samples(self, n_samples: int | None) -> None:
        """Predict with S = `n_samples`: this method and every method inside it (an ensemble's
        members, a post-hoc posterior's base); None leaves each its own S. The one way an
        evaluation sets S (`dbsn.runtime.evaluation.evaluation_samples` resolves it)."""
        if n_samples is None:
            return
        if int(n_samples) < 1:
            raise ValueError(f"n_samples (S) must be >= 1 (or null: the method's own), got {n_samples}")
        for method in self.modules():
            if isinstance(method, Method):
                method.n_samples = int(n_samples)

    @property
    def val_samples(self) -> int:
        return self.prediction.val_samples

    @val_samples.setter
    def val_samples(self, value: int) -> None:
        self.prediction.val_samples = int(value)

    @property
    def samples_per_forward(self) -> int:
        return self.prediction.samples_per_forward

    @samples_per_forward.setter
    def samples_per_forward(self, value: int) -> None:
        self.prediction.samples_per_forward = int(value)

    @property
    def temperature_scaling(self) -> bool:
        return self.prediction.temperature_scaling

    @temperature_scaling.setter
    def temperature_scaling(self, value: bool) -> None:
        self.prediction.temperature_scaling = bool(value)

    @property
    def channels_last(self) -> bool:
        return self.execution.uses_channels_last

    # ------------------------------------------------------------------ for subclasses
    def training_structures(self, n: int) -> tuple[Tensor, Tensor | float]:
        """n structures for a training step, (n, E, K), and their KL(q(α)||p(α)) estimate."""
        raise NotImplementedError

    def prediction_structures(self, n: int, first: int = 0) -> Tensor:
        """Structures of the prediction members first .. first + n - 1, (n, E, K) (fresh draws
        unless the method keeps a fixed set of members)."""
        raise NotImplementedError

    def prepare_prediction(self, datamodule) -> None:
        """Called before the test pass: a method may fix its prediction members here."""

    def prediction_statistics(self, n: int, first: int = 0):
        """A context in which the network predicts members first .. first + n - 1 (e.g. with
        their own BatchNorm statistics); by default the network as it is."""
        return nullcontext()

    @property
    def structure_is_stochastic(self) -> bool:
        return False

    def structure_parameters(self) -> list[nn.Parameter]:
        """Parameters optimised by the structure optimiser instead of SGD (θ)."""
        return []

    def structure_probabilities(self) -> Tensor | None:
        """Per-edge operation probabilities (E, K) of a *learned* structure distribution:
        the probability that each op is the one selected on its edge. None when the method
        learns no structure (fixed α, ensembles)."""
        return None

    def structure_optimizer(self):
        return None

    # ------------------------------------------------------------------ the method
    @property
    def is_stochastic(self) -> bool:
        """Whether prediction needs S > 1 Monte Carlo members."""
        return self.structure_is_stochastic or self.weights.stochastic

    def data_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The loss hook: the data term of the training loss, a scalar, from the logits of every
        (example, structure) row (class dimension 1) and its target; by default the task's mean
        cross-entropy (`task.loss`: the NLL of the loss, Eq. 3). A method with another data term (label
        smoothing, a focal loss, a proper scoring rule) overrides this one method: the KL terms,
        the T structures, chunking, several devices and the logged `train/nll` stay as they are."""
        return self.task.loss(logits, targets)

    def training_loss(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Mean NLL over this rank's T structures (one grouped forward) + (structure KL +
        weight KL) / N."""
        alpha, structure_kl = self.local_training_structures()
        return self.structures_loss(x, y, alpha, structure_kl)

    def local_training_structures(self) -> tuple[Tensor, Tensor | float]:
        """The T training structures and their KLs, (T, E, K) and (T,) (or 0); with
        `parallel="structure"` on W ranks, this rank's block of T / W of them. Every rank draws
        all T from the same random stream, so the blocks are one device's T structures."""
        alpha, kl = self.training_structures(self.train_samples)
        world = self._world_size()
        if self.parallel != "structure" or world == 1:
            return alpha, kl
        share = slice(self.global_rank * alpha.shape[0] // world, (self.global_rank + 1) * alpha.shape[0] // world)
        return alpha[share], kl[share] if isinstance(kl, Tensor) else kl

    def structures_loss(
        self,
        x: Tensor,
        y: Tensor,
        alpha: Tensor,
        structure_kl: Tensor | float,
        share: float = 1.0,
        weight_kl: bool = True,
        logged_kl: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """`share` · NLL of x under the structures alpha (one grouped forward), averaged over
        the structures, + the mean of `structure_kl` / N (+ weight KL / N with `weight_kl`).
        The logged parts (nll, kl) are this chunk's means, unscaled (`logged_kl`: the kl to log
        when the loss carries another one)."""
        logits = self.network(x, alpha)  # = net(x.repeat_interleave(G), alpha)
        targets = y.repeat_interleave(alpha.shape[0], dim=0)
        nll = self.data_loss(logits, targets)  # = mean over structures of each one's mean NLL
        structure_kl = structure_kl.mean() if isinstance(structure_kl, Tensor) else structure_kl
        out = {"nll": nll, "logits": logits, "targets": targets}
        if self.structure_is_stochastic:  # a number (0: no posterior over structures) logs as a tensor too
            out["kl"] = torch.as_tensor(
                structure_kl if logged_kl is None else logged_kl, dtype=nll.dtype, device=nll.device
            )
        out["loss"] = share * nll + structure_kl / self.dataset_size
        if weight_kl:
            kl = self.weights.kl(self.net, self.current_epoch)
            if self.weights.stochastic:
                out["weight_kl"] = torch.as_tensor(kl)
            out["loss"] = out["loss"] + kl / self.dataset_size
        return out

    def training_losses(self, x: Tensor, y: Tensor):
        """The step's loss in parts, one per chunk of `train_samples_per_forward` structures,
        as (share of the structures, whether it is the last part, output of `structures_loss`);
        the parts' losses add up to `training_loss(x, y)["loss"]`. One chunk: `training_loss`
        itself.

        The chunks' networks see the structures as a detached leaf, so each chunk's backward
        frees its whole graph (no `retain_graph`: compiled backward passes donate their
        buffers). The last part carries what the structures share: the KL of all of them, the
        weight KL, and the surrogate Σ α · ∂L/∂α of the earlier chunks, which back-propagates
        their structure gradients through the draw of α into θ (under `backward_extra`, outside
        the loss value)."""
        chunk = self.train_samples_per_forward
        if chunk is None or chunk >= self.train_samples:
            yield 1.0, True, self.training_loss(x, y)
            return
        alpha, kl = self.local_training_structures()
        leaf = alpha.detach().requires_grad_(alpha.requires_grad)
        starts = range(0, alpha.shape[0], chunk)
        for start in starts:
            part = slice(start, start + chunk)
            share = alpha[part].shape[0] / alpha.shape[0]
            chunk_kl = kl[part].mean().detach() if isinstance(kl, Tensor) else kl
            if start != starts[-1]:
                yield share, False, self.structures_loss(x, y, leaf[part], 0.0, share, False, logged_kl=chunk_kl)
                continue
            out = self.structures_loss(x, y, alpha[part], kl, share, True, logged_kl=chunk_kl)
            if leaf.grad is not None:
                out["backward_extra"] = (alpha[:start] * leaf.grad[:start]).sum()
            yield share, True, out

    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits of the members first .. first + n - 1 (structure and weights) on x, class
        dimension last: (n, b, C) for classification, (n, b, H, W, C) for segmentation."""
        if self.weights.shared_noise and n > 1:  # one weight draw per call: one call per member
            return torch.cat([self.stochastic_forward(x, 1, first + i) for i in range(n)])
        alpha = self.prediction_structures(n, first)
        statistics = self.prediction_statistics(n, first)
        # a graph replays the network as it was captured: only with the statistics the modules hold
        network = (
            self._graphed_network
            if (self._graphed_network is not None and isinstance(statistics, nullcontext))
            else self.network
        )
        with statistics:  # row i*n + s: example i, member s
            parts = [self.task.class_last(network(part, alpha)) for part in self._example_parts(x, n)]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        return logits.view(x.shape[0], n, *logits.shape[1:]).transpose(0, 1)

    def _example_parts(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        """x in parts of at most `prediction.rows_per_forward` // n examples (at least one), or
        whole: without a bound, or when the weights draw noise at every forward."""
        rows = self.prediction.rows_per_forward
        if rows is None or self.weights.stochastic or x.shape[0] * n <= rows:
            return (x,)
        return x.split(max(1, rows // n))

    def _module_modes(self) -> tuple[bool, ...]:
        """Every module's train/eval mode (a captured prediction belongs to one: MC dropout's)."""
        return tuple(m.training for m in self.net.modules())

    def network(self, x: Tensor, alpha: Tensor) -> Tensor:
        """The network's logits for every example of x under every structure of alpha, row
        i*G + g for example i and structure g (`net(x, alpha, replicate=True)`), with x in the
        network's memory layout."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x, alpha, replicate=True)

    def continue_schedules(self, epochs_trained: int) -> None:
        """`init_from`: the weights come from a run that trained `epochs_trained` epochs; a
        method whose schedules belong to its posterior continues them (DBSN's τ and β)."""

    def on_after_optimizer_step(self, batch_size: int) -> None:
        """Hook for progress counters, after each optimiser step on a batch of `batch_size`
        examples per rank (`examples_per_step` says how many the whole step saw)."""

    def run_facts(self) -> dict[str, float]:
        """Facts about the trained model that metrics.json records beside the test metrics (with
        a calibrator: its `facts`, how it was fitted)."""
        return dict(getattr(self.calibrator, "facts", {}))

    def examples_per_step(self, batch_size: int) -> int:
        """Training examples one optimiser step consumes over all ranks: `batch_size` per rank,
        times the world size in data-parallel training (every rank has its own batch), once
        in structure-parallel training (every rank has the same batch)."""
        return batch_size * (self._world_size() if self.parallel == "data" else 1)

    def _world_size(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    def check_world_size(self, world_size: int) -> None:
        """Refuse a structure-parallel run whose T structures do not split evenly over the
        devices (called before training starts)."""
        if self.parallel == "structure" and self.train_samples % world_size:
            raise ValueError(
                f"model.parallel=structure splits the T = {self.train_samples} structures of a step over "
                f"{world_size} devices, so T must be a multiple of {world_size}. Set model.train_samples to "
                f"a multiple of {world_size} (the paper: T = 4 on 4 GPUs), or model.parallel=data (every "
                "device its own batch and its own T structures)."
            )

    # ------------------------------------------------------------------ prediction
    def predict_log_probs(self, x: Tensor, n_samples: int | None = None, first: int = 0) -> Tensor:
        """log p(y | x) of the Bayes ensemble over `n_samples` draws (default: S; members
        first, first + 1, ...), calibrated (`calibrate`) when a temperature or a calibrator is
        fitted. Streams over chunks of `samples_per_forward` draws, so S never multiplies the memory."""
        ensemble = BayesEnsemble(self._num_draws(n_samples), self.samples_per_forward, first)
        return self.calibrate(ensemble(self.stochastic_forward, x))

    def predict_members(self, x: Tensor, n_samples: int | None = None, first: int = 0) -> Tensor:
        """Log-probabilities of every Monte Carlo member, (S, b, C), uncalibrated (no temperature, no
        calibrator): what the uncertainty decomposition and the sample ablation need. Deterministic
        methods have one member."""
        return BayesEnsemble(self._num_draws(n_samples), self.samples_per_forward, first).member_log_probs(
            self.stochastic_forward, x
        )

    def member_chunks(self, x: Tensor) -> Iterator[Tensor]:
        """`predict_members(x)` a chunk at a time ((n, b, C) each, `samples_per_forward` members), for
        what reads the members once and keeps only what it needs of them (`test_step`). A method
        that overrides `predict_members` overrides this too."""
        yield from BayesEnsemble(self._num_draws(None), self.samples_per_forward).member_chunks(
            self.stochastic_forward, x
        )

    def uncertainty_scores(self, x: Tensor, n_samples: int | None = None) -> dict[str, Tensor]:
        """Per-example uncertainty of the prediction on x (`uncertainty_decomposition` of the
        members, each calibrated as the prediction is, `calibrate`)."""
        return uncertainty_decomposition(self.calibrate(self.predict_members(x, n_samples)))

    @property
    def is_calibrated(self) -> bool:
        """Whether `calibrate` changes anything: a fitted temperature or a calibrator is applied."""
        return self.temperature_scaling or self.calibrator is not None

    def calibrate(self, log_probs: Tensor) -> Tensor:
        """Log-probabilities (..., C), the ensemble's or each member's, as the method predicts
        them: divided by the temperature when `temperature_scaling`, then through `calibrator`
        (an nn.Module from log-probabilities to log-probabilities) when one is set; unchanged
        otherwise."""
        if self.temperature_scaling:
            log_probs = self.temperature(log_probs)
        return log_probs if self.calibrator is None else self.calibrator(log_probs)

    def _num_draws(self, n_samples: int | None) -> int:
        return (n_samples or self.n_samples) if self.is_stochastic else 1

    @property
    def num_members(self) -> int:
        """How many members `predict_members` returns: the resolved S (`n_samples`, as built or
        as `use_samples` set it) for a method that draws its members, 1 for a deterministic one."""
        return self._num_draws(None)

    # ------------------------------------------------------------------ calibration, validation and test
    @torch.no_grad()
    def fit_temperature(self, datamodule) -> float:
        """Fit the post-hoc temperature on `datamodule`'s validation split (never the test set)."""
        require_validation(datamodule)
        self.eval()
        self.enable_test_noise()
        self.prepare_prediction(datamodule)  # the predictor the test pass uses
        enabled, self.temperature_scaling = self.temperature_scaling, False  # fit on raw predictions
        try:
            scaler = fit_temperature(
                lambda x: self.predict_log_probs(datamodule.preprocess(x)), datamodule.val_dataloader(), self.device
            )
        finally:
            self.temperature_scaling = enabled
        self.temperature.load_state_dict(scaler.state_dict())
        return scaler.temperature

    def enable_test_noise(self) -> None:
        """Turn on what stays stochastic at test time (MC dropout) after `eval()`."""
        self.weights.enable_test_noise(self.net)

    def on_validation_model_eval(self) -> None:
        super().on_validation_model_eval()
        self.enable_test_noise()

    def on_test_model_eval(self) -> None:
        super().on_test_model_eval()
        self.enable_test_noise()

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.val_metrics.update(self.predict_log_probs(x, self.val_samples), y)

    def on_validation_epoch_end(self) -> None:
        self.log_dict({f"val/{k}": v for k, v in self.val_metrics.compute().items()}, prog_bar=True)
        self.val_metrics.reset()

    def test_step(self, batch, batch_idx: int) -> PredictedBatch:
        """Update the test metrics of the ensemble and its uncertainty decomposition (per pixel for
        segmentation) from one set of S member predictions, read a chunk at a time (`member_chunks`
        into an `EnsembleStream`: memory does not grow with S), and return that prediction
        (`PredictedBatch`, with the prefix ensembles of `prefix_sizes`): what an evaluation keeps
        of the test pass is its recorder's."""
        x, y = batch
        # With a fitted temperature or calibrator each member is calibrated for the decomposition,
        # so that it describes the calibrated members (unchanged otherwise).
        stream = EnsembleStream(self.calibrate if self.is_calibrated else None, self.prefix_sizes)
        shape = None
        for members in self.member_chunks(x):  # (n, b, C) or (n, b, H, W, C)
            shape = members.shape[1:-1]
            stream.add(self.task.flatten(members))  # (n, b·H·W, C)
        log_probs = self.calibrate(stream.log_probs()).view(*shape, -1)
        self.test_metrics.update(log_probs, y)
        scores = stream.scores()
        self.test_uncertainty.update(scores)
        return PredictedBatch(x, y, log_probs, {k: v.view(shape) for k, v in scores.items()}, stream.prefixes)

    def on_test_epoch_start(self) -> None:
        self.test_metrics.reset()
        self.test_uncertainty.reset()
        self.prepare_prediction(self.trainer.datamodule)

    def on_test_epoch_end(self) -> None:
        """Log the pass's test metrics. They keep its state until the next pass starts: a
        recorder reads segmentation's per-image rows from them once the pass is over."""
        self.log_dict({f"test/{k}": v for k, v in self.test_metrics.compute().items()})
        self.log_dict({f"test/{k}": v for k, v in self.test_uncertainty.compute().items()})
