"""DDU's feature density as an OOD score of any method: `gda` (conf/ood_score/gda.yaml).

Deep Deterministic Uncertainty (Mukhoti et al., CVPR 2023) fits a Gaussian discriminant analysis
(one Gaussian per class, its own mean and covariance) to the training features of a network's last
layer and scores an image by the density of its feature, log q(z) (the maths:
:class:`dbsn.metrics.ood_scores.GDA`). DDU trains its network for it (`model=ddu`: spectral
normalisation on a residual network), but the density reads any method's features as the
Mahalanobis score does, so it is one more feature score of the OOD evaluation, fitted on the
training split and computed for every method; a method's members enter as for the other feature
scores (`per_member`: each member's own fit, the members' scores averaged; `pooled`: one fit on
their mean feature). Higher = more OOD: the score is -log q(z).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dbsn.evaluation.detection import FeatureScore, Members, ScoreUnavailable, Training
from dbsn.metrics.ood_scores import GDA

__all__ = ["GDAScore"]

#: The evaluation keeps scores in float32: a -log q(z) beyond its range (a feature in a direction
#: the training features of a class never varied in) is held at its largest, ranked last, not inf.
FLOAT32_MAX = torch.finfo(torch.float32).max


class GDAScore(FeatureScore):
    """-log q(z), DDU's feature density under a Gaussian per class fitted on the training features
    (Mukhoti et al. 2023; :class:`dbsn.metrics.ood_scores.GDA`, the authors' jitter search for
    positive-definite covariances). A method whose training features cannot be fitted (a class
    with fewer than two training images, covariances no jitter makes positive definite) has it left
    out, with the reason."""

    def fit_one(self, features: Tensor, training: Training, head) -> nn.Module:
        try:
            return GDA().fit(features, training.labels, training.num_classes)
        except ValueError as err:
            raise ScoreUnavailable(f"{training.method}'s training features: {err}") from err

    def score(self, members: Members) -> Tensor:
        return super().score(members).clamp(max=FLOAT32_MAX)
