"""OpenOOD's post-hoc detection scores of any method, beside the predictive's own (entropy, mutual
information, 1 − max probability): what the OOD evaluation (`evaluations=[ood]`) adds per set.

Each score is computed for every member of the prediction (the first `members` of them: a
method's members are networks, `Method.member_outputs` gives each one's logits and the features
its last layer sees) and then, where both make sense, in two ways, named apart:

=====================  =========================================================================
``max_logit``          −max_c z̄_c of the members' mean logits z̄ (Hendrycks et al. 2022)
``max_logit_members``  the mean over members of each member's −max_c z_c
``energy``             −T·logsumexp(z̄ / T) of the mean logits (Liu et al. 2020)
``energy_members``     the mean over members of each member's energy
``mahalanobis``        each member's min_c Mahalanobis distance to its training class means under a
                       tied covariance (Lee et al. 2018, OpenOOD's MDS), averaged over members
``knn``                each member's distance to the k-th nearest normalised training feature
                       (Sun et al. 2022), averaged over members
``vim``                each member's virtual-logit score (Wang et al. 2022) on its own linear head,
                       averaged over members
``odin``               ODIN (Liang et al. 2018) on the averaged predictive: the input perturbed
                       to raise max_c p̄_T, the score −max_c p̄_T of the perturbed input
``odin_members``       each member perturbs for its own softmax; the mean of the members' scores
=====================  =========================================================================

The ``_members`` variants exist only when the method has more than one member (for one network
both ways are the same number). The feature scores fit on the training split, unaugmented, in
eval mode, member by member (`Method.fixed_members` holds DBSN's sampled structures fixed for
the whole evaluation, so member s is one network on training, test and OOD images; MC dropout
and BBB draw their noise at every forward: their members are exchangeable draws, fitted and
scored alike). A score that a method cannot give (ViM without a linear last layer, e.g. SNGP's
Gaussian-process head; feature scores where no `classifier` layer sees the features) is left
out, and the evaluation's record says why. Every score is higher for more OOD.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dbsn.data.augment import normalize, to_unit_range
from dbsn.data.base import in_memory_loader
from dbsn.evaluation.progress import progress
from dbsn.methods.base import FeaturesUnavailable
from dbsn.metrics.ood_scores import KNN, Mahalanobis, ViM, energy, max_logit, odin

__all__ = ["COMPUTED_ON", "NETWORK_SCORES", "DetectionScores"]

#: The scores this module adds, in the order tables show them (the `_members` variants follow).
NETWORK_SCORES = ("max_logit", "energy", "mahalanobis", "knn", "vim", "odin")

#: What each score is computed on (the evaluation's record and the docs).
COMPUTED_ON = {
    "entropy": "averaged predictive", "max_probability": "averaged predictive",
    "mutual_information": "members (their disagreement)",
    "max_logit": "members' mean logits", "max_logit_members": "mean over members",
    "energy": "members' mean logits", "energy_members": "mean over members",
    "mahalanobis": "mean over members", "knn": "mean over members", "vim": "mean over members",
    "odin": "averaged predictive", "odin_members": "mean over members",
}

_FEATURE_SCORES = ("mahalanobis", "knn", "vim")
#: images per ODIN gradient: its graph holds every member's activations (a single-pass ensemble's
#: tiled batch too), which for a whole evaluation batch can exhaust the memory
ODIN_BATCH = 64


@dataclass
class DetectionScores:
    """Fits and computes the scores of `NETWORK_SCORES` chosen in `scores` (see the module docstring).

    Args:
        scores: which of `NETWORK_SCORES` to compute.
        members: how many of the prediction's members the scores use (the first ones; None: all S).
        fit_images: training images the feature scores fit on (the first ones; None: all).
        knn_k: k of the KNN score.
        vim_dim: ViM's principal dimension (None: its default for the feature size).
        energy_temperature: T of the energy score.
        odin_temperature, odin_epsilon: ODIN's temperature and perturbation (in [0, 1] pixel units).
    """

    scores: Sequence[str] = NETWORK_SCORES
    members: int | None = 10
    fit_images: int | None = None
    knn_k: int = 50
    vim_dim: int | None = None
    energy_temperature: float = 1.0
    odin_temperature: float = 1000.0
    odin_epsilon: float = 0.0014
    notes: dict[str, str] = field(default_factory=dict)  # score -> why it was left out

    def __post_init__(self) -> None:
        self.scores = [str(s) for s in self.scores]
        unknown = sorted(set(self.scores) - set(NETWORK_SCORES))
        if unknown:
            raise ValueError(f"unknown detection score(s) {unknown}: choose from {list(NETWORK_SCORES)}")
        if self.members is not None and int(self.members) < 1:
            raise ValueError(f"members must be >= 1 (or null: all), got {self.members}")
        if self.fit_images is not None and int(self.fit_images) < 1:
            raise ValueError(f"fit_images must be >= 1 (or null: all), got {self.fit_images}")
        if int(self.knn_k) < 1:
            raise ValueError(f"knn_k must be >= 1, got {self.knn_k}")
        self._fitted: dict[str, list] = {}

    def count(self, model) -> int:
        """The members the scores use."""
        return model.num_members if self.members is None else min(int(self.members), model.num_members)

    def holding(self, model):
        """The context of a whole evaluation: the members fixed (see `Method.fixed_members`)."""
        return model.fixed_members(self.count(model)) if self.scores else nullcontext()

    # ------------------------------------------------------------------ fit
    @torch.no_grad()
    def fit(self, model, datamodule, device: torch.device, show: bool = True) -> None:
        """Fit the feature scores on the training split (call inside `holding`)."""
        self._fitted, self.notes = {}, {}
        wanted = [s for s in _FEATURE_SCORES if s in self.scores]
        if not wanted:
            return
        if getattr(datamodule, "train_set", None) is None:
            datamodule.setup("fit")
        n = self.count(model)
        features, labels, logits = [], [], []
        seen = 0
        loader = in_memory_loader(datamodule, datamodule.train_set, train=False)
        try:
            for images, targets in progress(loader, desc="Detection scores: training features", enabled=show):
                if self.fit_images is not None and seen >= self.fit_images:
                    break
                keep = len(targets) if self.fit_images is None else min(len(targets), self.fit_images - seen)
                z, f = model.member_outputs(datamodule.preprocess(images[:keep].to(device)), n)
                features.append(f.float().cpu())
                logits.append(z.float().cpu())
                labels.append(targets[:keep].cpu())
                seen += keep
        except FeaturesUnavailable as err:
            for score in wanted:
                self.notes[score] = str(err)
            return
        features, labels = torch.cat(features, 1), torch.cat(labels)
        heads = model.member_heads(n) if "vim" in wanted else None
        if "vim" in wanted and heads is None:
            self.notes["vim"] = (f"{type(model).__name__}'s last layer is not linear (ViM needs its weights and bias: "
                                 "e.g. SNGP's is a Gaussian process)")
        for score in wanted:
            if score in self.notes:
                continue
            fitted = []
            for s in range(n):
                if score == "mahalanobis":
                    fitted.append(Mahalanobis().fit(features[s], labels, model.num_classes))
                elif score == "knn":
                    fitted.append(KNN(k=self.knn_k).fit(features[s]))
                else:
                    weight, bias = heads[s]
                    fitted.append(ViM(dim=self.vim_dim).fit(features[s], weight.float().cpu(), bias.float().cpu()))
            self._fitted[score] = fitted

    # ------------------------------------------------------------------ score
    def of(self, model, datamodule, loader: Iterable, device: torch.device, desc: str, show: bool = True,
           in_data=None) -> dict[str, Tensor]:
        """Every chosen score of the images of `loader` (uint8, normalised as `in_data`, the
        in-distribution data module; default `datamodule`), on the CPU (call inside `holding`)."""
        in_data = in_data or datamodule
        n = self.count(model)
        out: dict[str, list[Tensor]] = {}
        mean, std = (t.clone() for t in in_data.statistics_on(device))  # not inference tensors: ODIN differentiates
        for images, _ in progress(loader, desc=desc, enabled=show):
            x_unit = to_unit_range(images.to(device))
            with torch.no_grad():
                parts = self._network_scores(model, normalize(x_unit, mean, std), n)
            if "odin" in self.scores:
                def member_logits(x, count, first, model=model):
                    return model.stochastic_forward(normalize(x, mean, std), count, first)
                for on, name in (("predictive", "odin"), ("members", "odin_members")):
                    if on == "members" and n == 1:
                        continue
                    parts[name] = torch.cat([  # the gradient's graph for ODIN_BATCH images at a time
                        odin(member_logits, x, n, temperature=self.odin_temperature, epsilon=self.odin_epsilon, on=on,
                             chunk=model.samples_per_forward) for x in x_unit.split(ODIN_BATCH)])
            for key, value in parts.items():
                out.setdefault(key, []).append(value.detach().float().cpu())
        return {k: torch.cat(v) for k, v in out.items()}

    def _network_scores(self, model, x: Tensor, n: int) -> dict[str, Tensor]:
        wanted = [s for s in self.scores if s in ("max_logit", "energy") or s in self._fitted]
        if not wanted:
            return {}
        # without a fitted feature score the logits alone, all members in one call
        logits, features = model.member_outputs(x, n) if self._fitted else (model.stochastic_forward(x, n, 0), None)
        logits = logits.float()
        out: dict[str, Tensor] = {}
        mean_logits = logits.mean(0)
        for name, fn in (("max_logit", max_logit), ("energy", self._energy)):
            if name in self.scores:
                out[name] = fn(mean_logits)
                if n > 1:
                    out[f"{name}_members"] = torch.stack([fn(z) for z in logits]).mean(0)
        for name, fitted in self._fitted.items():
            out[name] = torch.stack([f.to(features.device).score(features[s].float()) for s, f in enumerate(fitted)]).mean(0)
        return out

    def _energy(self, logits: Tensor) -> Tensor:
        return energy(logits, self.energy_temperature)

    def names(self, n: int) -> list[str]:
        """The score names computed for a method with n members, in table order."""
        names = []
        for score in NETWORK_SCORES:
            if score not in self.scores or score in self.notes:
                continue
            names.append(score)
            if n > 1 and score in ("max_logit", "energy", "odin"):
                names.append(f"{score}_members")
        return names

    def record(self, n: int) -> Mapping:
        return {"members": n, "fit_images": self.fit_images, "knn_k": self.knn_k, "vim_dim": self.vim_dim,
                "energy_temperature": self.energy_temperature, "odin_temperature": self.odin_temperature,
                "odin_epsilon": self.odin_epsilon, "left_out": dict(self.notes)}

