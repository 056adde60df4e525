"""Methods whose weight posterior is trained by natural-gradient VI: VOGN and NEK-FAC.

| config   | built by                                    | structure                           | weights                  |
|----------|---------------------------------------------|-------------------------------------|--------------------------|
| vogn     | `VOGNMethod(structure="map")`  -> `VOGNMAP` | softmax(θ), θ by Adam (as MAP)      | VOGN, diagonal Gaussian  |
| vogn_fbn | `VOGNMethod(structure="dbsn")` -> `VOGNFBN` | q(α|θ) sampled, NLL + KL/N (DBSN)   | VOGN, diagonal Gaussian  |
| nekfac   | `NEKFACMethod` (a MAP without structure)    | none (VGG16-BN)                     | NEK-FAC, Kronecker basis |

The structure side (θ, its Adam, the τ/β schedules, the structure KL, the prediction structures)
is inherited unchanged from `MAP` / `DBSN`; `NaturalGradientMethod`, a mixin placed before them,
changes only the weight side: the optimiser, the closure-driven training step, and the posterior
buffers that prediction reads (its docstring says how). The weight prior enters through the
optimiser's update, so ``train/loss`` is NLL + structure KL / N, without a weight KL.

Restrictions: one process (VOGN's and NEK-FAC's curvature statistics are per batch; under DDP
each rank would precondition with its own and the replicas would drift apart) and 32-bit or
bf16 precision (16-bit mixed precision steps the optimiser without a closure). The paper's
setting and results: docs/methods.md ("Natural-gradient baselines").
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from dbsn.methods.dbsn import DBSN
from dbsn.methods.map import MAP
from dbsn.methods.settings import Prediction, StructureOptimizer
from dbsn.natgrad import NEKFAC, VOGN, sampled_fisher_loss
from dbsn.natgrad.nekfac import _split, kfac_layers
from dbsn.nets.fused_cell import unfuse
from dbsn.structure.schedules import BetaSchedule, TauSchedule

__all__ = ["NEKFACMethod", "NaturalGradientMethod", "VOGNFBN", "VOGNMAP", "VOGNMethod"]

# The DBSN paper's small-model VOGN run (Appendix C): lr 0.01, prior variance 1, initial
# precision 8e-3, KL warm-up from 0.01 over 1000 steps. The rest are VOGN's defaults.
VOGN_DEFAULTS = dict(lr=1e-2, prior_variance=1.0, init_precision=8e-3, kl_warmup_start=0.01, kl_warmup_steps=1000)


def _settings(name: str, optimizer: type, given: dict | None, defaults: dict, set_by_method: set[str]) -> dict:
    """``defaults`` updated with ``given``, refusing keys the optimiser does not take (now, not at fit)."""
    accepted = set(inspect.signature(optimizer).parameters) - {"self", "model"} - set_by_method
    settings = {**defaults, **dict(given or {})}
    unknown = sorted(set(settings) - accepted)
    if unknown:
        raise ValueError(f"{name}: unknown {optimizer.__name__} settings {unknown}; valid: {sorted(accepted)}")
    return settings


class NaturalGradientMethod:
    """Mixin for a `Method` subclass (put it first): the weight side by VOGN or
    NEK-FAC (see the module docstring). Subclasses define `_make_optimizer`, `_closure_result`,
    `_posterior_shapes`, `_posterior_values` and `sample_parameters`.

    - `configure_optimizers`: the natural-gradient optimiser over the network's weights (first in
      the list, so Lightning checkpoints its state as ``optimizer_states[0]`` and restores it on
      resume), then Adam on θ when there is one; a multistep lr schedule (``lr_milestones``,
      fractions of ``max_epochs``, ``lr_gamma``) on the natural-gradient optimiser.
    - `training_step`: ``opt.step(closure)``. The closure is the inherited ``training_loss(x, y)``:
      one forward under freshly drawn structures (T = 1; VOGN calls the closure once per MC weight
      sample, so each weight sample gets its own α), loss = mean NLL + structure KL / N.
      VOGN's closure backpropagates that loss (``loss_reduction="mean"``: the optimiser rescales the
      captured output gradients to per-example gradients for ĥ; the same backward gives θ its
      gradient, averaged over the K samples before θ's Adam step). NEK-FAC's closure returns
      (loss, summed NLL at labels sampled from the model) and the optimiser backpropagates. The
      logged names are every method's (``train/loss``, ``train/nll``, ``train/kl``, ``train/error``).
    - Prediction: a Bayes ensemble over S weight draws (and S structures for VOGN-FBN), one forward
      per member, as for `shared_noise` weights. Evaluation rebuilds a method from its checkpoint's
      ``state_dict`` only (no optimiser state), so what prediction needs is kept in buffers of the
      ``posterior`` submodule: VOGN the posterior std σ of every network parameter (one flat vector
      in ``net.named_parameters()`` order; 0 for point estimates); NEK-FAC per Linear/Conv2d layer
      the eigenbases U_A, U_S and the eigenbasis std Σ. They are copied from the optimiser
      (`sync_posterior`) before validation, when a checkpoint is written (the checkpoint's
      ``state_dict`` is patched, since Lightning collects it before the hook) and at the end of
      fit. Until the first sync they are zero: predictions at the posterior mean.

    Args (keyword, the rest go to the method class):
        lr_milestones: fractions of ``max_epochs`` at which the lr is multiplied by ``lr_gamma``.
    """

    samples_weights = True

    def __init__(self, *args, lr_milestones: Sequence[float] = (), lr_gamma: float = 0.1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.execution.compile.enabled:
            raise ValueError(
                f"model.execution.compile.enabled=true is not supported by {type(self).__name__}: its optimiser captures every "
                "layer's input and output gradient with module and tensor hooks, which a compiled forward does not "
                "run. Set model.execution.compile.enabled=false."
            )
        self.lr_milestones = tuple(float(m) for m in lr_milestones)
        if any(not 0 < m < 1 for m in self.lr_milestones):
            raise ValueError(f"lr_milestones are fractions of training in (0, 1), got {self.lr_milestones}")
        self.lr_gamma = lr_gamma
        self.posterior = nn.Module()
        for name, shape in self._posterior_shapes().items():
            self.posterior.register_buffer(name, torch.zeros(shape))

    # ------------------------------------------------------------------ for subclasses
    def _make_optimizer(self, dataset_size: int) -> Optimizer:
        raise NotImplementedError

    def _closure_result(self, out: dict[str, Tensor]):
        """What the optimiser's closure returns for one ``training_loss`` output."""
        raise NotImplementedError

    def _posterior_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def _posterior_values(self, opt: Optimizer) -> dict[str, Tensor]:
        """The optimiser's current posterior, as values of (some of) the ``posterior`` buffers."""
        raise NotImplementedError

    def sample_parameters(self) -> dict[str, Tensor]:
        """One draw from the stored posterior: the drawn network parameters by name (those
        with noise; the others stay at their values)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ prediction
    @property
    def is_stochastic(self) -> bool:
        return True

    def stochastic_forward(self, x: Tensor, n: int, first: int = 0) -> Tensor:
        """(n, b, C): member i is one forward under structure i and its own weight draw. The draw
        is passed to ``functional_call``, so the parameters are never edited in place and
        gradients w.r.t. x (adversarial attacks) flow through every member."""
        alpha = self.prediction_structures(n)
        return torch.stack(
            [
                self.task.class_last(functional_call(self.net, self.sample_parameters(), (x, alpha[i : i + 1])))
                for i in range(n)
            ]
        )

    def _live_optimizer(self) -> Optimizer | None:
        trainer = self._trainer
        optimizers = trainer.optimizers if trainer is not None else []
        return optimizers[0] if optimizers and isinstance(optimizers[0], (VOGN, NEKFAC)) else None

    @torch.no_grad()
    def sync_posterior(self) -> None:
        """Copy the optimiser's posterior into the ``posterior`` buffers (no-op without one)."""
        opt = self._live_optimizer()
        if opt is None:
            return
        for name, value in self._posterior_values(opt).items():
            getattr(self.posterior, name).copy_(value)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.sync_posterior()

    def on_fit_end(self) -> None:
        super().on_fit_end()
        self.sync_posterior()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        self.sync_posterior()  # Lightning took the state_dict before this hook: patch it
        checkpoint["state_dict"].update(
            {f"posterior.{k}": v.detach().clone() for k, v in self.posterior.state_dict().items()}
        )

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        trainer = self.trainer
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise ValueError(
                f"The lr schedule is defined in epochs: set trainer.max_epochs (got {trainer.max_epochs})."
            )
        if trainer.world_size > 1:
            raise ValueError(
                f"{type(self).__name__} trains in one process: VOGN / NEK-FAC curvature statistics are per "
                "batch, and DDP replicas would precondition differently and drift apart."
            )
        if str(trainer.precision).startswith("16"):
            raise ValueError("16-bit mixed precision steps the optimiser without a closure; use 32-true or bf16-mixed.")
        if self.dataset_size is None:  # configure_optimizers runs before on_fit_start
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "num_train"):
                raise ValueError("dataset_size is unset and the data module does not report num_train")
            self.dataset_size = int(datamodule.num_train)
        opt = self._make_optimizer(self.dataset_size)
        epochs = sorted({max(1, round(m * trainer.max_epochs)) for m in self.lr_milestones})
        schedule = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=epochs, gamma=self.lr_gamma)
        optimizers = [opt]
        if self.structure_parameters():
            optimizers.append(self.structure_optimizer().build(self.structure_parameters()))
        return optimizers, [schedule]

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        natgrad, *others = self._optimizers()
        for opt in others:
            opt.zero_grad(set_to_none=True)
        outs: list[dict[str, Tensor]] = []

        def closure():
            out = self.training_loss(x, y)
            self._check_finite(out["loss"], batch_idx)  # raises before the weights change
            outs.append(out)
            return self._closure_result(out)

        natgrad.step(closure=closure)
        if len(outs) > 1:  # θ's gradient accumulated over the K weight samples: average it
            for p in self.structure_parameters():
                if p.grad is not None:
                    p.grad.div_(len(outs))
        for opt in others:
            opt.step()
        self.on_after_optimizer_step(y.shape[0])

        def mean(values) -> Tensor:
            return torch.stack([v.detach().float() for v in values]).mean()

        logs = {f"train/{k}": mean(o[k] for o in outs) for k in outs[0] if k not in ("loss", "logits", "targets")}
        logs["train/error"] = mean(self.task.error(o["logits"].detach(), o["targets"]) for o in outs)
        self.log_dict(logs, on_step=True, on_epoch=True, batch_size=y.shape[0])
        loss = mean(o["loss"] for o in outs)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=y.shape[0])
        return loss


# ---------------------------------------------------------------------- VOGN
class _VOGNWeights(NaturalGradientMethod):
    """VOGN on every parameter of the network (Conv2d, Linear, BatchNorm); θ stays with Adam.

    Args (keyword):
        vogn: VOGN settings (``lr``, ``prior_variance``, ``tau``, ``augmentation_factor``,
            ``damping``, ``momentum``, ``beta2``, ``init_precision``, ``draws_per_step``,
            ``kl_warmup_start``, ``kl_warmup_steps``) over `VOGN_DEFAULTS`; ``dataset_size``
            is the method's, ``params`` and ``loss_reduction`` are set here.
        bn_point_estimate: BatchNorm affine parameters as point estimates (no noise, no prior,
            still preconditioned), as in Osawa et al. (2019).
    """

    optimizer_key = "vogn"
    prediction_defaults = {"n_samples": 100, "val_samples": 10}  # S weight draws (VOGN-FBN: with a structure each)

    def __init__(self, *args, vogn: dict | None = None, bn_point_estimate: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vogn = _settings("vogn", VOGN, vogn, VOGN_DEFAULTS, {"dataset_size", "params", "loss_reduction"})
        self.bn_point_estimate = bn_point_estimate

    def _posterior_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"std": (sum(p.numel() for p in self.net.parameters()),)}

    def _make_optimizer(self, dataset_size: int) -> VOGN:
        bn = {id(p) for m in self.net.modules() if isinstance(m, _BatchNorm) for p in m.parameters(recurse=False)}
        params = [p for p in self.net.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if id(p) not in bn]}]
        if bn:
            groups.append({"params": [p for p in params if id(p) in bn], "point_estimate": self.bn_point_estimate})
        return VOGN(self.net, dataset_size=dataset_size, params=groups, loss_reduction="mean", **self.vogn)

    def _closure_result(self, out: dict[str, Tensor]) -> Tensor:
        self.manual_backward(out["loss"])
        return out["loss"]

    def _posterior_values(self, opt: VOGN) -> dict[str, Tensor]:
        stds = opt.posterior_std()
        return {
            "std": torch.cat(
                [
                    stds[name].reshape(-1) if name in stds else torch.zeros_like(p).reshape(-1)
                    for name, p in self.net.named_parameters()
                ]
            )
        }

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        opt = self._live_optimizer()
        if opt is not None:
            self.log_dict({f"posterior/{k}": v for k, v in posterior_health(self.net, opt.posterior_std()).items()})

    def posterior_std(self) -> dict[str, Tensor]:
        """The stored σ by parameter name of ``net`` (what prediction samples with)."""
        params = dict(self.net.named_parameters())
        chunks = self.posterior.std.split([p.numel() for p in params.values()])
        return {name: chunk.view_as(p) for (name, p), chunk in zip(params.items(), chunks)}

    def sample_parameters(self) -> dict[str, Tensor]:
        """w = μ + σ ε for every parameter of the network (σ = 0: w = μ)."""
        return {
            name: p + std * torch.randn_like(p)
            for (name, p), std in zip(self.net.named_parameters(), self.posterior_std().values())
        }


@torch.no_grad()
def posterior_health(net: nn.Module, stds: dict[str, Tensor]) -> dict[str, float]:
    """Medians over the noisy parameters (σ > 0) of σ and of the signal-to-noise ratio |μ| / σ.

    A posterior that has collapsed to the prior shows as σ near sqrt(prior variance) and a
    signal-to-noise ratio far below 1: every weight draw is then mostly noise (VOGN on a small N
    with prior variance 1, for instance)."""
    params = dict(net.named_parameters())
    std = torch.cat([stds[k].flatten() for k in params])
    mu = torch.cat([p.detach().flatten() for p in params.values()])
    noisy = std > 0
    return {"std_median": std[noisy].median().item(), "snr_median": (mu[noisy].abs() / std[noisy]).median().item()}


class VOGNMAP(_VOGNWeights, MAP):
    """VOGN weights, MAP structure α = softmax(θ) (``model=vogn``); build with `VOGNMethod`."""


class VOGNFBN(_VOGNWeights, DBSN):
    """VOGN weights, DBSN's structure posterior (``model=vogn_fbn``); build with `VOGNMethod`."""

    def prepare_prediction(self, datamodule) -> None:
        if self.bn_recalibration.enabled:  # its members draw weights too: not implemented for them
            raise ValueError("bn_recalibration is not available for vogn_fbn; set bn_recalibration.enabled=false.")


def VOGNMethod(
    net: nn.Module,
    *,
    vogn: dict | None = None,
    structure: str = "map",
    structure_optim: StructureOptimizer | None = None,
    tau: TauSchedule | None = None,
    beta: BetaSchedule | None = None,
    test_tau: float = 1.0,
    bn_point_estimate: bool = True,
    theta_init_std: float = 1e-3,
    lr_milestones: Sequence[float] = (),
    lr_gamma: float = 0.1,
    prediction: Prediction | None = None,
    **settings,
) -> VOGNMAP | VOGNFBN:
    """VOGN weights with a MAP (``structure="map"``) or DBSN (``"dbsn"``) structure.

    ``vogn``: VOGN settings (see `_VOGNWeights`); ``tau``, ``beta``, ``test_tau``: DBSN's
    schedules and prediction temperature (``"dbsn"`` only). Training uses one structure per
    VOGN weight draw (T = 1; ``vogn.draws_per_step`` is the number of Monte Carlo weight draws per
    step). ``prediction``: None: `_VOGNWeights.prediction_defaults` (S weight draws, fewer for
    validation). Other arguments as for `MAP` / `DBSN` / `Method`.
    """
    net = unfuse(net)  # VOGN's per-example statistics cover BatchNorm layers: every edge keeps its own
    common = dict(
        vogn=vogn,
        bn_point_estimate=bn_point_estimate,
        lr_milestones=lr_milestones,
        lr_gamma=lr_gamma,
        structure_optim=structure_optim,
        theta_init_std=theta_init_std,
        prediction=prediction,
        **settings,
    )
    if structure == "map":
        if tau is not None or beta is not None or test_tau != 1.0:
            raise ValueError("tau, beta and test_tau belong to structure='dbsn'; a MAP structure has no schedules")
        return VOGNMAP(net, learn_structure=True, **common)
    if structure == "dbsn":
        return VOGNFBN(net, tau=tau, beta=beta, train_samples=1, test_tau=test_tau, parallel="data", **common)
    raise ValueError(f"structure must be 'map' or 'dbsn', got {structure!r}")


def _vogn_class(*, structure: str = "map", **settings) -> type[VOGNMAP] | type[VOGNFBN]:
    """The class `VOGNMethod` builds with these settings (`dbsn.methods.registry` asks, building nothing)."""
    return VOGNFBN if structure == "dbsn" else VOGNMAP


VOGNMethod.builds = _vogn_class


# ---------------------------------------------------------------------- NEK-FAC
class NEKFACMethod(NaturalGradientMethod, MAP):
    """NEK-FAC (Bae et al. 2018) on a network without structure (``model=nekfac``: VGG16-BN).

    Every Linear/Conv2d layer has a Gaussian posterior in its Kronecker eigenbasis; the other
    parameters (BatchNorm) are point estimates trained by NEK-FAC's SGD with the prior as weight
    decay (see `dbsn.natgrad.nekfac`). One weight sample per training step; S samples at test.

    Args:
        nekfac: `NEKFAC` settings (``lr``, ``kl_weight``, ``prior_var``, ``damping``,
            ``kl_clip``, ``momentum``, ``cov_update_every``, ``eigen_update_every``,
            ``stat_decay``); its defaults are the paper's CIFAR settings. N is ``dataset_size``.
        prediction: S weight draws at test; None: `prediction_defaults` (the paper's comparison's S,
            fewer for validation).
        lr_milestones: the fractions of training at which the lr is multiplied by `lr_gamma`.
        lr_gamma: that factor.
    """

    networks = "own"  # VGG16-BN, the network it is defined on
    optimizer_key = "nekfac"
    prediction_defaults = {"n_samples": 30, "val_samples": 10}

    def __init__(
        self,
        net: nn.Module,
        *,
        nekfac: dict | None = None,
        lr_milestones: Sequence[float] = (0.5, 0.75),
        lr_gamma: float = 0.1,
        prediction: Prediction | None = None,
        **settings,
    ) -> None:
        super().__init__(
            net,
            lr_milestones=lr_milestones,
            lr_gamma=lr_gamma,
            learn_structure=False,
            prediction=prediction,
            **settings,
        )
        self.nekfac = _settings("nekfac", NEKFAC, nekfac, {}, {"dataset_size"})

    def _posterior_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for i, layer in enumerate(kfac_layers(self.net)):
            groups = layer.groups if isinstance(layer, nn.Conv2d) else 1
            out, d = layer.weight.shape[0] // groups, layer.weight[0].numel() + (layer.bias is not None)
            shapes.update({f"U_A_{i}": (groups, d, d), f"U_S_{i}": (groups, out, out), f"sigma_{i}": (groups, out, d)})
        return shapes

    def _make_optimizer(self, dataset_size: int) -> NEKFAC:
        return NEKFAC(self.net, dataset_size=dataset_size, **self.nekfac)

    def _closure_result(self, out: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return out["loss"], sampled_fisher_loss(out["logits"])

    def _posterior_values(self, opt: NEKFAC) -> dict[str, Tensor]:
        values = {}
        for i, layer in enumerate(opt.layers):
            state = opt.layer_state(layer)
            if "s_star" in state:  # a basis exists (after the first step)
                values.update({f"U_A_{i}": state["U_A"], f"U_S_{i}": state["U_S"], f"sigma_{i}": opt.noise_std(layer)})
        return values

    def sample_parameters(self) -> dict[str, Tensor]:
        """W̄ = M + U_S (ε ⊙ Σ) U_Aᵀ for every Linear/Conv2d layer (see `dbsn.natgrad.nekfac`)."""
        names = {module: name for name, module in self.net.named_modules()}
        drawn = {}
        for i, layer in enumerate(kfac_layers(self.net)):
            u_a, u_s, sigma = (getattr(self.posterior, f"{k}_{i}") for k in ("U_A", "U_S", "sigma"))
            noise = _split(layer, u_s @ (torch.randn_like(sigma) * sigma) @ u_a.mT)
            for kind, p, delta in zip(("weight", "bias"), (layer.weight, layer.bias), noise):
                if p is not None:
                    drawn[f"{names[layer]}.{kind}".lstrip(".")] = p + delta
        return drawn
