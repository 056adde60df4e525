r"""SWAG: a Gaussian over the weights from the SGD iterates of a training run (Maddox, Izmailov,
Garipov, Vetrov & Wilson, "A Simple Baseline for Bayesian Uncertainty in Deep Learning",
NeurIPS 2019, Algorithm 1).

Over the last epochs of a point-estimate run (map, map_fixed), `SWAGCollector` (a Lightning
callback; its state lives in every checkpoint and a resumed run continues it) keeps, in float64,
the running mean w̄ and second moment of the flattened network weights (BatchNorm's γ and β
included; not its running statistics, not the structure logits θ) and the last K ≤ `max_rank`
deviations D̂. The posterior is

    q(w) = N(w̄, ½ (diag(σ²) + D̂ D̂ᵀ / (K − 1))),    σ² = \overline{w²} − w̄² (≥ 1e-30),

sampled as w̄ + σ ∘ z₁ / √2 + D̂ z₂ / √(2(K − 1)) (`SWAGMoments.sample`; at least two snapshots).
`SWAGMethod` draws S members once, member s seeded by (`seed`, s), recomputes each one's
BatchNorm statistics on a fixed set of training images (as DBSN does for its structures, instead
of SWAG's ``bn_update`` pass) and predicts with their softmax average. The structure α is the
run's final one. Collected under a decayed schedule instead of the paper's constant SWA rate,
the posterior is narrower (docs/evaluation.md, "Post-hoc posteriors").
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from dbsn.methods.base import Method
from dbsn.methods.dbsn import BatchNormRecalibration, outside_inference
from dbsn.nets.batchnorm import GroupBatchNorm2d, Statistics, structure_statistics, using_statistics
from dbsn.posthoc.base import PosthocError, PosthocPosterior, point_estimate_classifier
from dbsn.posthoc.fixed import FixedStructurePosterior, point_estimate_structure

__all__ = ["SWAGCollector", "SWAGMethod", "SWAGMoments", "load_swag_state", "swag_parameters"]

#: The collector's key in a checkpoint's "callbacks".
STATE_KEY = "SWAGCollector"
#: Floor of the diagonal variance (SWAG's `var_clamp`).
VARIANCE_FLOOR = 1e-30


def swag_parameters(method: Method) -> list[tuple[str, nn.Parameter]]:
    """The weights SWAG collects: the trainable parameters of the method's network, by name
    (BatchNorm buffers and the structure logits θ are not among them)."""
    point_estimate_structure(method)  # refuses what is not a point estimate
    return [(name, p) for name, p in method.net.named_parameters() if p.requires_grad]


class SWAGMoments(nn.Module):
    """Running first and second moments of a weight vector and its last K deviations.

    Buffers: `count` (snapshots so far), `mean` and `sq_mean` (P,) in float64, `deviations`
    (max_rank, P) whose last min(count, max_rank) rows are the deviations, oldest first."""

    count: Tensor
    mean: Tensor
    sq_mean: Tensor
    deviations: Tensor

    def __init__(self, num_weights: int, max_rank: int = 20) -> None:
        super().__init__()
        if max_rank < 2:
            raise ValueError(f"max_rank must be >= 2 (the low-rank part divides by K - 1), got {max_rank}")
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(num_weights, dtype=torch.float64))
        self.register_buffer("sq_mean", torch.zeros(num_weights, dtype=torch.float64))
        self.register_buffer("deviations", torch.zeros(max_rank, num_weights))

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> SWAGMoments:
        """Moments restored from a `state_dict`."""
        moments = cls(state["mean"].shape[0], state["deviations"].shape[0])
        moments.load_state_dict(state)
        return moments

    @property
    def max_rank(self) -> int:
        return self.deviations.shape[0]

    @property
    def rank(self) -> int:
        """K: the deviations kept so far."""
        return min(int(self.count), self.max_rank)

    @torch.no_grad()
    def update(self, weights: Tensor) -> None:
        """Add one snapshot w (P,): w̄ ← (n w̄ + w)/(n + 1), the same for w², then append the
        deviation w − w̄ (from the updated mean), dropping the oldest beyond `max_rank`."""
        w = weights.detach().reshape(-1).to(self.mean)
        if w.shape != self.mean.shape:
            raise ValueError(f"a snapshot of {w.numel()} weights for moments of {self.mean.numel()}")
        n = int(self.count)
        self.mean.mul_(n / (n + 1)).add_(w / (n + 1))
        self.sq_mean.mul_(n / (n + 1)).add_(w * w / (n + 1))
        self.deviations.copy_(torch.roll(self.deviations, -1, dims=0))
        self.deviations[-1] = (w - self.mean).to(self.deviations.dtype)
        self.count.add_(1)

    def variance(self) -> Tensor:
        """σ² = E[w²] − w̄², floored at 1e-30, (P,)."""
        return (self.sq_mean - self.mean.square()).clamp_min(VARIANCE_FLOOR)

    def deviation_matrix(self) -> Tensor:
        """The K kept deviations, (K, P), oldest first."""
        return self.deviations[self.max_rank - self.rank :]

    def _check_samplable(self) -> None:
        if int(self.count) < 2:
            raise ValueError(f"SWAG needs at least 2 collected snapshots, has {int(self.count)}")

    def sample(self, generator: torch.Generator | None = None, scale: float = 0.5, n: int | None = None) -> Tensor:
        """w = w̄ + √scale (σ ∘ z₁ + D̂ z₂ / √(K − 1)) in float64: one draw (P,), or `n` draws
        (n, P); scale = ½ is the paper's sampler."""
        self._check_samplable()
        deviations = self.deviation_matrix().to(self.mean.dtype)
        shape = () if n is None else (n,)
        options = {"generator": generator, "device": self.mean.device, "dtype": self.mean.dtype}
        z1 = torch.randn(*shape, self.mean.shape[0], **options)
        z2 = torch.randn(*shape, deviations.shape[0], **options)
        spread = self.variance().sqrt() * z1 + z2 @ deviations / math.sqrt(deviations.shape[0] - 1)
        return self.mean + math.sqrt(scale) * spread

    def covariance(self, scale: float = 0.5) -> Tensor:
        """scale · (diag(σ²) + D̂ D̂ᵀ / (K − 1)), (P, P): the sampler's covariance (small P only)."""
        self._check_samplable()
        deviations = self.deviation_matrix().to(self.mean.dtype)
        return scale * (torch.diag(self.variance()) + deviations.T @ deviations / (deviations.shape[0] - 1))


class SWAGCollector(Callback):
    """Collects SWAG's moments during training (see the module docstring).

    Args:
        start: the first collected epoch: a fraction of `trainer.max_epochs` in [0, 1) (float;
            epoch ⌊start · max_epochs⌋, counting from 0) or an epoch index (int).
        max_rank: K, deviations kept (the paper: 20).
        collect: "epoch" (after each training epoch) or "step" (after each optimiser step).
    """

    COLLECT = ("epoch", "step")

    def __init__(self, start: float | int = 0.75, max_rank: int = 20, collect: str = "epoch") -> None:
        if collect not in self.COLLECT:
            raise ValueError(f"collect must be one of {self.COLLECT}, got {collect!r}")
        if (
            isinstance(start, bool)
            or not isinstance(start, (int, float))
            or start < 0
            or (isinstance(start, float) and start >= 1)
        ):
            raise ValueError(f"start is a fraction of training in [0, 1) or an epoch index >= 0, got {start!r}")
        if max_rank < 2:
            raise ValueError(f"max_rank must be >= 2, got {max_rank}")
        self.start, self.max_rank, self.collect = start, max_rank, collect
        self.moments: SWAGMoments | None = None
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.epochs: list[int] = []  # the epoch of every snapshot

    @property
    def state_key(self) -> str:
        return STATE_KEY

    def first_epoch(self, max_epochs: int | None) -> int:
        if isinstance(self.start, int):
            return self.start
        if max_epochs is None or max_epochs < 1:
            raise ValueError(f"a fractional SWAG start needs trainer.max_epochs, got {max_epochs}")
        return math.floor(self.start * max_epochs)

    def on_fit_start(self, trainer, pl_module) -> None:
        try:
            swag_parameters(pl_module)
            reason = point_estimate_classifier(pl_module, "swag")
            if reason:  # e.g. SNGP: a point estimate whose head posthoc=swag refuses; nothing to collect for it
                raise ValueError(reason)
        except ValueError as err:  # a sweep's stochastic methods (DBSN, MC dropout, ...): nothing to collect
            self.active = False
            rank_zero_info(f"SWAG collects the weights of point-estimate runs only; not this one ({err})")
            return
        self.active = True
        if (
            trainer.max_epochs is not None
            and trainer.max_epochs > 0
            and self.first_epoch(trainer.max_epochs) >= trainer.max_epochs
        ):
            raise ValueError(
                f"SWAG starts at epoch {self.first_epoch(trainer.max_epochs)} of a run of "
                f"{trainer.max_epochs} epochs: it would collect nothing"
            )

    def _collecting(self, trainer) -> bool:
        return getattr(self, "active", True) and trainer.current_epoch >= self.first_epoch(trainer.max_epochs)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.collect == "step" and self._collecting(trainer):
            self.collect_from(pl_module, trainer.current_epoch)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.collect == "epoch" and self._collecting(trainer):
            self.collect_from(pl_module, trainer.current_epoch)

    @torch.no_grad()
    def collect_from(self, method: Method, epoch: int = -1) -> None:
        """Add the method's current weights as one snapshot."""
        params = swag_parameters(method)
        weights = torch.cat([p.detach().reshape(-1) for _, p in params])
        if self.moments is None:
            self.names = [name for name, _ in params]
            self.shapes = [tuple(p.shape) for _, p in params]
            self.moments = SWAGMoments(weights.numel(), self.max_rank).to(weights.device)
        elif [name for name, _ in params] != self.names:
            raise ValueError("the network's parameters changed between SWAG snapshots")
        self.moments.to(weights.device).update(weights)
        self.epochs.append(int(epoch))

    def state_dict(self) -> dict:
        if self.moments is None:
            return {"start": self.start, "max_rank": self.max_rank, "collect": self.collect}
        return {
            "start": self.start,
            "max_rank": self.max_rank,
            "collect": self.collect,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "epochs": list(self.epochs),
            "moments": {k: v.detach().cpu().clone() for k, v in self.moments.state_dict().items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if "moments" not in state_dict:
            return
        self.names = list(state_dict["names"])
        self.shapes = [tuple(s) for s in state_dict["shapes"]]
        self.epochs = list(state_dict["epochs"])
        self.moments = SWAGMoments.from_state(state_dict["moments"])


def load_swag_state(checkpoint: dict) -> dict:
    """The `SWAGCollector` state saved in a Lightning checkpoint, already loaded (and checked:
    `dbsn.runtime.checkpoint.load_checkpoint`)."""
    state = checkpoint.get("callbacks", {}).get(STATE_KEY)
    if state is None or "moments" not in state:
        raise ValueError(
            "the checkpoint holds no SWAG statistics: train with the SWAGCollector callback "
            "(and read the last checkpoint, written after the last collected epoch)"
        )
    return state


class SWAGMethod(FixedStructurePosterior):
    """A point-estimate method's SWAG posterior: S fixed weight samples, each with its own
    BatchNorm statistics; prediction 1/S Σ_s softmax(f(x; w_s)).

    Args:
        base: the finished point-estimate method whose run was collected (its network is shared;
            its weights are not changed: the members are functional).
        state: the `SWAGCollector` state (`load_swag_state(path)` or `collector.state_dict()`).
        n_samples: S (`SWAG.n_samples`, resolved by the evaluation; its default is the paper's).
        scale: the covariance factor (½: the paper's sampler).
        bn_recalibration: images for each member's BatchNorm statistics (`enabled=False`
            predicts with the base's running statistics, which belong to the last iterate).
        seed: member s is drawn from a generator seeded by (seed, s).
        temperature_scaling: a post-hoc temperature on top (fitted by `fit_temperature`).
    """

    def __init__(
        self,
        base: Method,
        state: dict,
        n_samples: int,
        scale: float = 0.5,
        bn_recalibration: BatchNormRecalibration | None = None,
        seed: int = 0,
        temperature_scaling: bool = False,
    ) -> None:
        params = swag_parameters(base)
        names, shapes = [name for name, _ in params], [tuple(p.shape) for _, p in params]
        super().__init__(base, n_samples, "classifier", temperature_scaling)
        if "moments" not in state or list(state["names"]) != names or [tuple(s) for s in state["shapes"]] != shapes:
            raise ValueError(
                "the SWAG statistics do not belong to this network (its parameters' names or shapes differ)"
            )
        net = self.network_fixed.net
        plain = [
            n
            for n, m in net.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, GroupBatchNorm2d)
        ]
        if plain:
            raise ValueError(f"SWAG's BatchNorm refresh needs GroupBatchNorm2d layers; {plain[:3]} are not")
        self.moments = SWAGMoments.from_state(state["moments"])
        self.moments.to(next(net.parameters()).device)
        self.parameter_names, self.parameter_shapes = names, shapes
        self.scale = scale
        self.seed = seed
        self.bn_recalibration = (
            bn_recalibration
            if bn_recalibration is not None
            else BatchNormRecalibration(enabled=True, images=1024, batch_size=256)
        )
        self._calibration: list[Tensor] | None = None
        self._statistics: dict[int, Statistics] = {}
        self._weights: dict[int, dict[str, Tensor]] = {}

    def run_facts(self) -> dict:
        images = (
            "running" if not self.bn_recalibration.enabled else f"per member, {self.bn_recalibration.images} images"
        )
        return {
            **super().run_facts(),
            "posterior": "SWAG",
            "swag_snapshots": int(self.moments.count),
            "swag_rank": self.moments.rank,
            "bn_statistics": images,
        }

    # ------------------------------------------------------------------ members
    def member_weights(self, index: int) -> dict[str, Tensor]:
        """Member `index`'s weights w_s by parameter name (the same on every call: drawn once
        per device and kept, as every batch of every evaluation asks for them again)."""
        device = self.moments.mean.device
        weights = self._weights.get(index)
        if weights is None or next(iter(weights.values())).device != device:
            generator = torch.Generator(device=device).manual_seed((self.seed * 1_000_003 + index) % 2**63)
            flat = self.moments.sample(generator, self.scale)
            dtype = next(self.network_fixed.parameters()).dtype
            parts = flat.to(dtype).split([math.prod(s) for s in self.parameter_shapes])
            weights = self._weights[index] = {
                f"net.{name}": part.view(shape)
                for name, part, shape in zip(self.parameter_names, parts, self.parameter_shapes)
            }
        return {name: outside_inference(w) for name, w in weights.items()}

    def _member_forward(self, weights: dict[str, Tensor]):
        return lambda x: torch.func.functional_call(self.network_fixed, weights, (x,))

    def prepare_prediction(self, datamodule) -> None:
        """With `bn_recalibration.enabled`: take its images from the training split (seeded,
        preprocessed; augmented if asked) and forget earlier members' statistics."""
        self._calibration, self._statistics = None, {}
        if self.bn_recalibration.enabled:
            self.use_calibration_images(
                self.bn_recalibration.calibration_batches(
                    datamodule, self.moments.mean.device, "SWAG's BatchNorm refresh"
                )
            )

    def use_calibration_images(self, batches: list[Tensor]) -> None:
        """Each member's BatchNorm statistics from now on come from these (preprocessed) batches."""
        self._calibration, self._statistics = batches, {}

    def member_statistics(self, index: int, weights: dict[str, Tensor]) -> Statistics:
        """Member `index`'s BatchNorm statistics on the calibration images (computed once)."""
        if index not in self._statistics:
            self._statistics[index] = structure_statistics(
                self._member_forward(weights), self.network_fixed.net, self._calibration, 1
            )
        return {k: tuple(map(outside_inference, v)) for k, v in self._statistics[index].items()}

    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """Logits of members first .. first + n - 1, (n, b, C): one forward per member."""
        if self.bn_recalibration.enabled and self._calibration is None:
            raise ValueError(
                "SWAG members need their BatchNorm statistics: call prepare_prediction(datamodule) "
                "(the test pass does) or use_calibration_images(batches) first"
            )
        logits = []
        for index in range(first, first + n):
            weights = self.member_weights(index)
            context = (
                using_statistics(self.network_fixed.net, self.member_statistics(index, weights))
                if self.bn_recalibration.enabled
                else nullcontext()
            )
            with context:
                logits.append(self.task.class_last(self._member_forward(weights)(x)))
        return torch.stack(logits)


class SWAG(PosthocPosterior):
    """SWAG as a post-hoc posterior (`posthoc=swag`): the moments a point-estimate run collected
    (`callbacks=swag`) and S members drawn from them, each with its own BatchNorm statistics.

    Args:
        name: see `PosthocPosterior`.
        n_samples: S, see `PosthocPosterior` (default: the paper's 30).
        scale: the covariance factor (½: the paper's sampler).
    """

    name = "swag"
    draws_members = True

    def __init__(self, name: str | None = None, n_samples: int | None = 30, scale: float = 0.5) -> None:
        super().__init__(name, n_samples)
        if not scale > 0:
            raise PosthocError(f"posthoc.scale must be > 0 (½ is the paper's sampler), got {scale}")
        self.scale = float(scale)

    def why_not(self, method: Method, checkpoint: dict) -> str | None:
        reason = point_estimate_classifier(method, self.name)
        if reason is not None:
            return reason
        try:
            load_swag_state(checkpoint)
        except (KeyError, ValueError) as err:
            return (
                f"posthoc={self.name} needs the SWAG moments its run collected, and this checkpoint has none ({err}): "
                "train with callbacks=swag (e.g. python train.py model=map_fixed callbacks=swag)"
            )
        return None

    def check(self, method: Method, datamodule, checkpoint: dict, n_samples: int | None = None) -> None:
        super().check(method, datamodule, checkpoint, n_samples)
        snapshots = int(load_swag_state(checkpoint)["moments"]["count"])
        if snapshots < 2:
            raise PosthocError(
                f"posthoc={self.name} needs at least 2 collected snapshots of the weights, and this "
                f"checkpoint has {snapshots}: collect over more epochs (callbacks.swag.start earlier, "
                "or more epochs) or after every step (callbacks.swag.collect=step)."
            )

    def fit(self, method: Method, datamodule, checkpoint: dict, n_samples: int) -> SWAGMethod:
        return SWAGMethod(method, load_swag_state(checkpoint), n_samples=n_samples, scale=self.scale)
