"""What the test pass predicted, kept for the evaluations: the recorder of `trainer.test`.

`Method.test_step` updates the method's own test metrics and returns what it predicted for the
batch (`dbsn.methods.predictive.PredictedBatch`); the method keeps nothing for an evaluation.
`PredictionRecorder`, a Lightning callback that `dbsn.evaluation.test_pass.run_test_pass`
attaches for the duration of `trainer.test`, keeps of each batch what the evaluations read:

- classifiers: every test example's ensemble log-probabilities, target and uncertainty scores
  (`log_probs`, `targets`, `scores`), gathered over the devices;
- segmentation: the test metrics image by image (`image_metrics`, for bootstrap intervals; on one
  device: a copy of the method's test metrics once the pass is over) and the uncertainty maps of
  the first `task.num_maps` images (`maps`);
- the first batch's first inputs and targets (`example`: what the cost is measured on);
- the MC-sample ablation (`ablation`: the metrics of the ensembles of the first s members, for a
  bounded set of s (`dbsn.metrics.ablation.default_sizes`), from the same S members; `ablation_rows`
  once the pass is over). For the pass, the recorder sets the method's `prefix_sizes` to the
  ablation's sizes: the method streams its members and hands over only those prefix ensembles.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from dbsn.methods.predictive import PredictedBatch
from dbsn.metrics.ablation import SampleAblation

__all__ = ["PredictionRecorder", "sample_ablation"]

#: how many inputs and targets of the first test batch `example` keeps
EXAMPLE_SIZE = 4


def sample_ablation(model, sizes: Sequence[int] | None = None) -> SampleAblation | None:
    """The MC-sample ablation of `model`'s next test pass: the ensembles of the first s members,
    s in `sizes` (None: `default_sizes(S)`, every s up to 100; sizes above S dropped, S where none is left). None where there is
    nothing to ablate: no sizes, a one-member prediction, or (for now) segmentation."""
    if (sizes is not None and len(sizes) == 0) or not model.task.supports_ablation or model.num_members <= 1:
        return None
    sizes = None if sizes is None else [s for s in sizes if s <= model.num_members] or [model.num_members]
    return SampleAblation(model.num_classes, n_samples=model.num_members, sizes=sizes)


class PredictionRecorder(Callback):
    """Keeps what a method's test pass predicted (see the module docstring). After `trainer.test`:

    Attributes:
        log_probs, targets: classifiers: the Bayes ensemble's log-probabilities (N, C) and the
            targets (N,) of the whole test set, on the CPU (None for segmentation).
        scores: classifiers: each uncertainty score of every test example, name -> (N,).
        example: the first test batch's first inputs and targets, where the pass ran them.
        maps: segmentation: input, target, prediction, predictive entropy and mutual information
            of the first `task.num_maps` test images.
        image_metrics: segmentation on one device: a copy of the method's test metrics after the
            pass, whose `per_image` rows and `resampled` give the bootstrap intervals (None
            otherwise).
        ablation: the MC-sample ablation updated by the pass (None: none), `ablation_rows` its
            rows (`SampleAblation.compute`), `calibrated_ablation` each kept size's calibrated NLL
            of every test example (sizes, N), once `test_pass.add_calibrated_ablation` made it.
    """

    def __init__(self, ablation: SampleAblation | None = None) -> None:
        self.ablation = ablation
        self._clear()

    def _clear(self) -> None:
        self.log_probs: Tensor | None = None
        self.targets: Tensor | None = None
        self.scores: dict[str, Tensor] | None = None
        self.example: tuple[Tensor, Tensor] | None = None
        self.maps: list[dict[str, Tensor]] = []
        self.image_metrics: nn.Module | None = None
        self.ablation_rows: list[dict[str, float]] | None = None
        self.calibrated_ablation: Tensor | None = None
        self._batches: list[tuple[Tensor, Tensor, dict[str, Tensor]]] = []

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self._clear()
        if self.ablation is not None:
            self.ablation.to(pl_module.device).reset()
        pl_module.prefix_sizes = () if self.ablation is None else tuple(self.ablation.sizes)

    def on_test_batch_end(
        self, trainer, pl_module, outputs: PredictedBatch, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        x, y = outputs.inputs, outputs.targets
        if self.example is None:
            self.example = (x[:EXAMPLE_SIZE].detach(), y[:EXAMPLE_SIZE].detach())
        if self.ablation is not None:
            self.ablation.update_prefixes(
                outputs.prefixes, y.flatten(), pl_module.calibrate if pl_module.is_calibrated else None
            )
        if pl_module.task.keeps_test_outputs:
            self._batches.append(
                (
                    outputs.log_probs.detach().float(),
                    y.detach(),
                    {k: v.detach().float() for k, v in outputs.scores.items()},
                )
            )
            return
        self._keep_maps(outputs, pl_module.task.num_maps)

    def _keep_maps(self, outputs: PredictedBatch, count: int) -> None:
        """Input, target, prediction and uncertainty maps of the first `count` test images."""
        for i in range(min(outputs.inputs.shape[0], count - len(self.maps))):
            self.maps.append(
                {
                    "image": outputs.inputs[i].detach().float().cpu(),
                    "target": outputs.targets[i].cpu(),
                    "prediction": outputs.log_probs[i].argmax(-1).cpu(),
                    "entropy": outputs.scores["predictive_entropy"][i].float().cpu(),
                    "mutual_information": outputs.scores["mutual_information"][i].float().cpu(),
                }
            )

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        if self.ablation is not None:  # on every rank: computing synchronises them
            self.ablation_rows = self.ablation.compute()
        if self._batches:
            log_probs = torch.cat([lp for lp, _, _ in self._batches])
            targets = torch.cat([t for _, t, _ in self._batches])
            scores = {k: torch.cat([s[k] for _, _, s in self._batches]) for k in self._batches[0][2]}
            if trainer.world_size > 1:
                log_probs = pl_module.all_gather(log_probs).flatten(0, 1)
                targets = pl_module.all_gather(targets).flatten(0, 1)
                scores = {k: pl_module.all_gather(v).flatten(0, 1) for k, v in scores.items()}
            self.log_probs, self.targets = log_probs.cpu(), targets.cpu()
            self.scores = {k: v.cpu() for k, v in scores.items()}
        self._batches = []

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        pl_module.prefix_sizes = ()

    def on_test_end(self, trainer, pl_module) -> None:
        pl_module.prefix_sizes = ()
        # after the method's own epoch end: its test metrics hold the whole pass until the next starts
        if not pl_module.task.keeps_test_outputs and trainer.world_size == 1:
            self.image_metrics = copy.deepcopy(pl_module.test_metrics)
