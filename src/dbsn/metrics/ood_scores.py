"""OpenOOD's post-hoc out-of-distribution scores, as tensor code that runs where its inputs live.

Every score here is per example and oriented like :func:`dbsn.metrics.uncertainty.detection_scores`
and :mod:`dbsn.evaluation.ood`: HIGHER means MORE likely out-of-distribution. OpenOOD v1.5
(Zhang et al., 2023; github.com/Jingkang50/OpenOOD) returns a confidence, higher = more
in-distribution, so each score below is the NEGATIVE of its postprocessor's ``conf``; the
ranking metrics (AUROC, AUPR, FPR95) are then those of OpenOOD with OOD as the positive class.

* :func:`max_logit`, :func:`energy`: functions of the logits (N, C).
* :class:`Mahalanobis`, :class:`GDA`, :class:`KNN`, :class:`ViM`: fitted on the penultimate
  features (and, for ViM, the last layer) of the TRAINING set, then applied to any features
  (N, D). They are ``nn.Module`` s whose fitted statistics are buffers: ``.to(device)`` moves
  them and the state dict saves them. Mahalanobis, GDA and ViM fit and score in float64.
* :func:`odin`: a function of the input, since ODIN perturbs it; for an ensemble (members of a
  Bayes ensemble, structure samples of DBSN) it works on the averaged tempered predictive or
  member by member.

The hyper-parameters default to OpenOOD's for CIFAR (its ``configs/postprocessors/*.yml``).
OpenOOD v1.5 runs several of them with ``APS_mode: True``, choosing the value from a sweep on
its validation split; what such a sweep would pick is not reproduced here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dbsn.metrics.uncertainty import ensemble_log_probs

__all__ = [
    "GDA",
    "GDA_CHUNK_ELEMENTS",
    "GDA_JITTERS",
    "KNN",
    "KNN_CHUNK_ELEMENTS",
    "Mahalanobis",
    "ViM",
    "energy",
    "max_logit",
    "odin",
    "vim_dim",
]

#: KNN's memory budget: query rows × training rows of distances formed at once (2^24 floats,
#: 64 MiB in float32: 335 queries at a time against 50,000 training features).
KNN_CHUNK_ELEMENTS = 2**24
#: GDA's memory budget: classes × query rows × features of one block of whitened differences
#: (2^24 float64, 128 MiB: 262 queries at a time for 100 classes of 640 features).
GDA_CHUNK_ELEMENTS = 2**24
#: The jitters DDU's fit tries in turn, the first that makes every class covariance positive
#: definite added to its diagonal (the authors' ``utils/gmm_utils.py``, ``JITTERS``): 0, the
#: smallest positive normal float64, then 10^-308, 10^-307, ..., 10^-1.
GDA_JITTERS = (0.0, torch.finfo(torch.float64).tiny, *(10.0**exponent for exponent in range(-308, 0)))

MemberLogits = Callable[[Tensor, int, int], Tensor]


# ---------------------------------------------------------------------------------- of the logits
def max_logit(logits: Tensor) -> Tensor:
    """Maximum logit score ``-max_c z_c`` of logits (N, C) → (N,).

    Hendrycks et al., 2022, "Scaling Out-of-Distribution Detection for Real-World Settings"
    (ICML), MaxLogit; OpenOOD ``openood/postprocessors/maxlogit_postprocessor.py``
    (``MaxLogitPostprocessor``, ``mls``), whose confidence is ``max_c z_c``.
    """
    return -logits.amax(dim=-1)


def energy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Free energy ``E(x) = -T logsumexp_c(z_c / T)`` of logits (N, C) → (N,).

    Liu et al., 2020, "Energy-based Out-of-distribution Detection" (NeurIPS), Eq. 7 (the
    detector thresholds ``-E``); OpenOOD ``openood/postprocessors/ebo_postprocessor.py``
    (``EBOPostprocessor``), whose confidence is ``T logsumexp(z / T)``, with ``T = 1`` in
    ``configs/postprocessors/ebo.yml``. ``logsumexp`` subtracts the maximum first, so the
    score is finite for logits of any size.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return -temperature * torch.logsumexp(logits / temperature, dim=-1)


# ------------------------------------------------------------------------------ of the features
def _check_features(features: Tensor, name: str = "features") -> None:
    if features.ndim != 2 or features.shape[0] == 0:
        raise ValueError(f"expected {name} of shape (N, D) with N >= 1, got shape {tuple(features.shape)}")


def _covariance(x: Tensor, assume_centered: bool) -> Tensor:
    """scikit-learn's ``EmpiricalCovariance(assume_centered=...).covariance_`` of rows x (N, D):
    ``(x - m)^T (x - m) / N`` with ``m`` the mean of the rows, or ``m = 0`` if assume_centered."""
    if not assume_centered:
        x = x - x.mean(dim=0)
    return x.T @ x / x.shape[0]


class _Fitted(nn.Module):
    """A score whose statistics are buffers set by ``fit``; ``module(features)`` is ``score``."""

    _buffer_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        for name in self._buffer_names:
            self.register_buffer(name, None)

    @property
    def fitted(self) -> bool:
        return all(getattr(self, name) is not None for name in self._buffer_names)

    def _fitted_features(self, features: Tensor) -> Tensor:
        """``features`` checked and moved to the buffers' device and dtype."""
        if not self.fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(...) on the training features first")
        _check_features(features)
        reference = getattr(self, self._buffer_names[0])
        if features.shape[1] != reference.shape[-1]:
            raise ValueError(f"features have D = {features.shape[1]}, the fit had D = {reference.shape[-1]}")
        return features.detach().to(reference)

    def forward(self, features: Tensor) -> Tensor:
        return self.score(features)


def _class_counts(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Labels (N,) as longs on the features' device, checked against features (N, D) and
    ``range(num_classes)``, and each class's count (C,); every class needs a sample."""
    _check_features(features)
    labels = labels.detach().to(features.device, torch.long).flatten()
    if labels.shape[0] != features.shape[0]:
        raise ValueError(f"{features.shape[0]} features but {labels.shape[0]} labels")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")
    counts = torch.bincount(labels, minlength=num_classes)
    if (counts == 0).any():
        raise ValueError(f"classes {torch.nonzero(counts == 0).flatten().tolist()} have no training features")
    return labels, counts


class Mahalanobis(_Fitted):
    """Minimum Mahalanobis distance to the class means under a tied covariance.

    Lee et al., 2018, "A Simple Unified Framework for Detecting Out-of-Distribution Samples and
    Adversarial Attacks" (NeurIPS), Eq. 2, as OpenOOD v1.5 runs it
    (``openood/postprocessors/mds_postprocessor.py``, ``MDSPostprocessor``): penultimate
    features only, no input preprocessing, no ensemble of layers. From training features
    ``z_i`` with labels ``y_i``:

        μ_c = mean of the z_i with y_i = c,
        Σ   = covariance of the class-centred features z_i - μ_{y_i},
        score(z) = min_c (z - μ_c)^T Σ^+ (z - μ_c),

    ``Σ`` and ``Σ^+`` exactly as scikit-learn's ``EmpiricalCovariance(assume_centered=False)``
    (``covariance_``: mean subtracted again, divided by N; ``precision_``: the pseudo-inverse
    ``scipy.linalg.pinvh``, eigenvalues at most ``D·eps·λ_max`` in size dropped), which is what
    OpenOOD fits. ``Σ^+`` makes a rank-deficient covariance (fewer features than dimensions,
    collapsed features) usable: directions the training features never vary in are ignored.
    OpenOOD's confidence is ``max_c -(z - μ_c)^T Σ^+ (z - μ_c)``; it fits in float32, this in
    float64.
    """

    _buffer_names = ("class_means", "precision")

    def fit(self, features: Tensor, labels: Tensor, num_classes: int) -> Mahalanobis:
        """Class means (C, D) and precision (D, D) from training features (N, D) and labels (N,),
        in float64 on the features' device. Every class in ``range(num_classes)`` needs a sample."""
        labels, counts = _class_counts(features, labels, num_classes)
        z = features.detach().double()
        means = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, labels, z)
        means /= counts.unsqueeze(1)
        covariance = _covariance(z - means[labels], assume_centered=False)
        self.class_means = means
        self.precision = torch.linalg.pinv(covariance, hermitian=True)  # rtol = D·eps, as pinvh
        return self

    def score(self, features: Tensor) -> Tensor:
        """``min_c (z - μ_c)^T Σ^+ (z - μ_c)`` of features (N, D) → (N,), float64.

        Expanded as ``z^T P z - 2 z^T P μ_c + μ_c^T P μ_c`` so that no (N, C, D) tensor is
        formed; in float64 the cancellation costs far less than the distances' spread, and the
        result is clamped at 0 (P is positive semi-definite)."""
        z = self._fitted_features(features)
        pz = z @ self.precision
        quadratic_means = ((self.class_means @ self.precision) * self.class_means).sum(dim=1)
        distances = (pz * z).sum(dim=1, keepdim=True) - 2 * pz @ self.class_means.T + quadratic_means
        return distances.amin(dim=1).clamp(min=0)


class GDA(_Fitted):
    """Gaussian discriminant analysis of the training features: DDU's feature density.

    Mukhoti, Kirsch, van Amersfoort, Torr & Gal, 2023, "Deep Deterministic Uncertainty: A New
    Simple Baseline" (CVPR), Sec. 4 and Algorithm 1, as the authors' code fits it
    (github.com/omegafragger/DDU, ``utils/gmm_utils.py``: ``gmm_fit``, ``gmm_evaluate``). One
    Gaussian per class, from training features ``z_i`` with labels ``y_i``, in float64:

        μ_c = mean of the z_i with y_i = c,
        Σ_c = Σ_{y_i = c} (z_i - μ_c)(z_i - μ_c)^T / (N_c - 1)      (``centered_cov_torch``),
        π_c = N_c / N,
        log q(z) = logsumexp_c [log π_c + log N(z; μ_c, Σ_c + ε I)],
        score(z) = -log q(z).

    ε is the first of :data:`GDA_JITTERS` for which every Σ_c + ε I has a Cholesky factor (the
    authors' loop: ``torch.distributions.MultivariateNormal`` refuses a covariance whose
    factorisation fails, and the next jitter is tried); it is 0 when every covariance is
    positive definite already, and one ε serves all classes. A jitter too small to change any
    diagonal entry gives the matrices of the attempt before it and is passed over without
    factorising them again (the same matrices fail the same way). Where none up to 0.1 works,
    ``fit`` raises ValueError. The authors' ``torch.eye`` is float32, so their jitters below
    float32's smallest subnormal (1.4e-45) add nothing and the others are float32's roundings;
    here each is added in float64 as written. ``log N`` is ``MultivariateNormal.log_prob``'s
    formula, -½ (D log 2π + ‖L_c⁻¹ (z - μ_c)‖²) - Σ log diag L_c with L_c the Cholesky factor,
    formed ``chunk`` queries at a time (default: as many as keep classes × queries × D within
    :data:`GDA_CHUNK_ELEMENTS`).

    The class prior π_c is the paper's q(y); the authors' ``evaluate.py`` ranks by the
    logsumexp of the class log-likelihoods alone, which for balanced classes (CIFAR's training
    split) differs from log q(z) by the constant log C and ranks every feature the same. Where a
    class covariance needed a jitter far below its own scale, features off the training
    features' span get very large distances: a log-density may be below float64's range, -inf.
    Each class needs two training features (a covariance); the fit holds C·D² floats (the factors).
    """

    _buffer_names = ("class_means", "scale_tril", "log_priors", "jitter")

    def __init__(self, chunk: int | None = None) -> None:
        super().__init__()
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be at least 1 or None, got {chunk}")
        self.chunk = chunk

    def fit(self, features: Tensor, labels: Tensor, num_classes: int) -> GDA:
        """Class means (C, D), Cholesky factors (C, D, D) of the jittered class covariances, log
        priors (C,) and the jitter (a 0-dim tensor) from training features (N, D) and labels
        (N,), in float64 on the features' device."""
        labels, counts = _class_counts(features, labels, num_classes)
        if (counts < 2).any():
            raise ValueError(
                f"classes {torch.nonzero(counts < 2).flatten().tolist()} have one training feature: "
                "a class covariance needs two"
            )
        z = features.detach().double()
        # the authors' arithmetic to the last bit (torch.mean, then centered_cov_torch): whether a
        # rank-deficient covariance has a Cholesky factor can turn on its rounding
        classes = [z[labels == c] for c in range(num_classes)]
        means = torch.stack([x.mean(dim=0) for x in classes])
        centred = [x - m for x, m in zip(classes, means)]
        covariances = torch.stack([1 / (len(x) - 1) * x.T @ x for x in centred])
        scale_tril, jitter = self._cholesky(covariances)
        self.class_means, self.scale_tril, self.jitter = means, scale_tril, z.new_tensor(jitter)
        self.log_priors = (counts.double() / counts.sum()).log()
        return self

    @staticmethod
    def _cholesky(covariances: Tensor) -> tuple[Tensor, float]:
        """The Cholesky factors of covariances (C, D, D) + ε I and ε, the first of
        :data:`GDA_JITTERS` for which every one of them is positive definite."""
        eye = torch.eye(covariances.shape[-1], dtype=covariances.dtype, device=covariances.device)
        diagonal = covariances.diagonal(dim1=-2, dim2=-1)
        failed = None  # the diagonal of the last matrices that failed
        for jitter in GDA_JITTERS:
            shifted = diagonal + jitter
            if failed is not None and torch.equal(shifted, failed):
                continue  # the jitter changed nothing: the same matrices fail again
            scale_tril, info = torch.linalg.cholesky_ex(covariances + jitter * eye)
            if not info.any():
                return scale_tril, jitter
            failed = shifted
        raise ValueError(
            f"no jitter up to {GDA_JITTERS[-1]} makes every class covariance positive definite "
            f"(the diagonals' smallest entry is {diagonal.min().item():.3g}); the features may be "
            "non-finite or far from unit scale"
        )

    @property
    def query_chunk(self) -> int:
        """Queries per block: ``chunk``, or as many as keep the block within the budget."""
        if self.chunk is not None:
            return self.chunk
        return max(1, GDA_CHUNK_ELEMENTS // self.class_means.numel())

    def class_log_likelihoods(self, features: Tensor) -> Tensor:
        """log N(z; μ_c, Σ_c + ε I) (N, C) of features (N, D), float64 (the authors'
        ``gmm_evaluate``'s "logits")."""
        z = self._fitted_features(features)
        d = z.shape[1]
        half_log_det = self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(dim=-1)  # ½ log det Σ_c, (C,)
        blocks = []
        for block in z.split(self.query_chunk):
            difference = (block.unsqueeze(0) - self.class_means.unsqueeze(1)).transpose(1, 2)  # (C, D, n)
            whitened = torch.linalg.solve_triangular(self.scale_tril, difference, upper=False)
            distance = whitened.square().sum(dim=1)  # (C, n): (z - μ_c)^T Σ_c⁻¹ (z - μ_c)
            blocks.append((-0.5 * (d * math.log(2 * math.pi) + distance) - half_log_det.unsqueeze(1)).T)
        return torch.cat(blocks)

    def log_density(self, features: Tensor) -> Tensor:
        """log q(z) = logsumexp_c [log π_c + log N(z; μ_c, Σ_c + ε I)] of features (N, D) → (N,),
        float64: higher = more like the training features."""
        return torch.logsumexp(self.class_log_likelihoods(features) + self.log_priors, dim=1)

    def score(self, features: Tensor) -> Tensor:
        """-log q(z) of features (N, D) → (N,), float64: higher = more OOD."""
        return -self.log_density(features)


class KNN(_Fitted):
    """Distance to the k-th nearest training feature, after L2 normalisation.

    Sun et al., 2022, "Out-of-Distribution Detection with Deep Nearest Neighbors" (ICML), Eq. 3
    and Algorithm 1; the authors' code (github.com/deeplearning-wisc/knn-ood, ``run_cifar.py``)
    and OpenOOD (``openood/postprocessors/knn_postprocessor.py``, ``KNNPostprocessor``):

        ẑ = z / (‖z‖_2 + 1e-10),   score(z) = ‖ẑ - ẑ_(k)‖_2,

    ``ẑ_(k)`` the k-th nearest of the normalised training features. ``k = 50`` is the CIFAR
    setting of both (``run_cifar.py``: ``for K in [50]``; ``configs/postprocessors/knn.yml``:
    ``K: 50``, sweep ``K_list: [50]``).

    Two differences from OpenOOD that change no ranking: faiss's ``IndexFlatL2`` returns
    SQUARED distances, so OpenOOD's confidence is ``-‖ẑ - ẑ_(k)‖^2``, a monotone function of
    this score; and OpenOOD's normaliser reads ``x / norm(x) + 1e-10`` (the offset added to
    every coordinate, not to the norm), which shifts every normalised feature by the same vector
    and so leaves all distances as they are (except for an all-zero feature, where it gives
    NaN and the authors' form here gives the zero vector).

    The search is exact and brute force, in torch (no faiss): the queries go ``chunk`` at a
    time (default: as many as keep ``chunk × N ≤`` :data:`KNN_CHUNK_ELEMENTS`, 335 for
    N = 50,000), each chunk's squared distances ``‖a‖² + ‖b‖² - 2 a·b`` formed at once in one
    (chunk, N) block and the k smallest taken, in the dtype of the training features (float32
    like faiss, or float64).
    """

    _buffer_names = ("train_features",)

    def __init__(self, k: int = 50, chunk: int | None = None) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be at least 1 or None, got {chunk}")
        self.k, self.chunk = int(k), chunk

    @staticmethod
    def normalize(features: Tensor) -> Tensor:
        """``z / (‖z‖_2 + 1e-10)`` row by row (the authors' normaliser)."""
        return features / (torch.linalg.vector_norm(features, dim=-1, keepdim=True) + 1e-10)

    def _check_k(self, n_train: int) -> None:
        if self.k > n_train:
            raise ValueError(f"k = {self.k} nearest neighbours asked for, but only {n_train} training features")

    def fit(self, features: Tensor) -> KNN:
        """Store the normalised training features (N, D) (floating point, on their device)."""
        _check_features(features)
        self._check_k(features.shape[0])
        features = features.detach()
        if not features.is_floating_point():
            features = features.float()
        self.train_features = self.normalize(features)
        return self

    @property
    def query_chunk(self) -> int:
        """Queries per block: ``chunk``, or as many as keep the block within the budget."""
        if self.chunk is not None:
            return self.chunk
        return max(1, KNN_CHUNK_ELEMENTS // self.train_features.shape[0])

    def score(self, features: Tensor) -> Tensor:
        """Distance (N,) from each normalised feature (N, D) to its k-th nearest training feature."""
        queries = self.normalize(self._fitted_features(features))
        train = self.train_features
        self._check_k(train.shape[0])
        train_squared = (train * train).sum(dim=1)
        kth = []
        for block in queries.split(self.query_chunk):
            squared = torch.addmm(train_squared, block, train.T, alpha=-2)  # ‖b‖² - 2 a·b, in place below
            squared += (block * block).sum(dim=1, keepdim=True)
            kth.append(squared.topk(self.k, dim=1, largest=False).values[:, -1])
        return torch.cat(kth).clamp(min=0).sqrt()


def vim_dim(feature_dim: int) -> int:
    """ViM's default principal dimension for features of size D.

    The authors' rule (github.com/haoqiwang/vim, ``benchmark.py``:
    ``DIM = 1000 if D >= 2048 else 512``) where it leaves a residual space: 1000 for D ≥ 2048
    (ResNet-50, BiT), 512 for 768 ≤ D < 2048 (ViT-B/16's 768). Below that, where 512 would
    leave nothing, D // 2: OpenOOD's CIFAR setting, 256 for ResNet-18's D = 512
    (``configs/postprocessors/vim.yml``: ``dim: 256``, sweep ``[256, 1000]``;
    ``scripts/ood/vim/cifar10_test_ood_vim.sh``: ``--postprocessor.postprocessor_args.dim 256``).
    """
    if feature_dim >= 2048:
        return 1000
    if feature_dim >= 768:
        return 512
    return feature_dim // 2


class ViM(_Fitted):
    """Virtual-logit matching: the norm of the feature's residual off the training features'
    principal subspace, scaled to the logits, against the energy.

    Wang et al., 2022, "ViM: Out-Of-Distribution with Virtual-logit Matching" (CVPR), Eqs. 5-9;
    the authors' ``benchmark.py`` (github.com/haoqiwang/vim) and OpenOOD
    (``openood/postprocessors/vim_postprocessor.py``, ``VIMPostprocessor``). For the last layer
    ``z -> W z + b`` (W (C, D), b (C,)) and training features ``z_i``:

        u  = -W^+ b                        (the origin: W u + b = 0 when W has full row rank),
        R  = eigenvectors of Σ beyond the top `dim`, Σ = 1/N Σ_i (z_i - u)(z_i - u)^T
             (``EmpiricalCovariance(assume_centered=True)`` of z_i - u),
        α  = mean_i max_c (W z_i + b)_c / mean_i ‖(z_i - u) R‖,
        score(z) = α ‖(z - u) R‖ - logsumexp_c (W z + b)_c.

    OpenOOD's confidence is ``-α ‖(z - u) R‖ + logsumexp(W z + b)``, the negative. ``W^+`` is
    numpy's ``pinv`` (singular values below ``1e-15 σ_max`` dropped); the eigenvectors come
    from a symmetric eigensolver instead of ``np.linalg.eig``, which changes no norm
    ``‖(z - u) R‖`` (signs and bases within an eigenspace do not matter) unless an eigenvalue
    is repeated across the cut. ``dim`` defaults to :func:`vim_dim`; it must leave a residual,
    ``0 ≤ dim < D``. Fitted and scored in float64.
    """

    _buffer_names = ("origin", "residual_basis", "weight", "bias", "alpha")

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def fit(self, features: Tensor, weight: Tensor, bias: Tensor) -> ViM:
        """Origin, residual basis (D, D - dim) and α from training features (N, D) and the last
        layer's weight (C, D) and bias (C,)."""
        _check_features(features)
        z = features.detach().double()
        weight = weight.detach().to(z)
        bias = bias.detach().to(z)
        d = z.shape[1]
        if weight.ndim != 2 or weight.shape[1] != d or bias.shape != weight.shape[:1]:
            raise ValueError(
                f"expected weight (C, {d}) and bias (C,), got {tuple(weight.shape)} and {tuple(bias.shape)}"
            )
        dim = vim_dim(d) if self.dim is None else int(self.dim)
        if not 0 <= dim < d:
            raise ValueError(f"dim = {dim} principal dimensions must leave a residual space: need 0 <= dim < D = {d}")
        origin = -torch.linalg.pinv(weight, rtol=1e-15) @ bias
        centred = z - origin
        _, eigenvectors = torch.linalg.eigh(_covariance(centred, assume_centered=True))  # ascending
        residual_basis = eigenvectors[:, : d - dim].contiguous()
        residual_norm = torch.linalg.vector_norm(centred @ residual_basis, dim=1)
        logits = z @ weight.T + bias
        self.origin, self.residual_basis, self.weight, self.bias = origin, residual_basis, weight, bias
        self.alpha = logits.amax(dim=1).mean() / residual_norm.mean()
        return self

    def score(self, features: Tensor) -> Tensor:
        """``α ‖(z - u) R‖ - logsumexp(W z + b)`` of features (N, D) → (N,), float64."""
        z = self._fitted_features(features)
        virtual_logit = self.alpha * torch.linalg.vector_norm((z - self.origin) @ self.residual_basis, dim=1)
        return virtual_logit - torch.logsumexp(z @ self.weight.T + self.bias, dim=1)


# ---------------------------------------------------------------------------------- of the input
def _normal_tensor(t: Tensor) -> Tensor:
    """``t`` detached, as a normal (non-inference) tensor autograd can use."""
    if not t.is_inference():
        return t.detach()
    with torch.inference_mode(False):
        return t.clone()


def _member_chunks(n_members: int, chunk: int | None) -> list[tuple[int, int]]:
    """``(first, n)`` of consecutive blocks of at most ``chunk`` members."""
    chunk = n_members if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 or None, got {chunk}")
    return [(first, min(chunk, n_members - first)) for first in range(0, n_members, chunk)]


def _logits(member_logits: MemberLogits, x: Tensor, first: int, n: int) -> Tensor:
    """Logits (n, b, C) of members first .. first + n - 1 on x, shape checked."""
    logits = member_logits(x, n, first)
    if logits.ndim != 3 or logits.shape[:2] != (n, x.shape[0]):
        raise ValueError(
            f"member_logits(x, {n}, {first}) must give (n, b, C) = ({n}, {x.shape[0]}, C), got {tuple(logits.shape)}"
        )
    return logits


def _mean_tempered_probs(
    member_logits: MemberLogits, x: Tensor, chunks: list[tuple[int, int]], temperature: float
) -> Tensor:
    """``p̄_T = 1/S Σ_s softmax(z_s(x) / T)`` (b, C) over the members in ``chunks``, without gradients."""
    with torch.no_grad():
        total = sum(
            F.softmax(_logits(member_logits, x, first, n) / temperature, dim=-1).sum(dim=0) for first, n in chunks
        )
    return total / sum(n for _, n in chunks)


def _perturbed(x: Tensor, ascent: Tensor, epsilon: float) -> Tensor:
    """OpenOOD's step ``x - ε s`` with ``s = +1`` where the loss gradient is ≥ 0 and ``-1``
    elsewhere (``torch.ge(grad, 0)``, so a zero gradient steps by ``-ε``, not 0); ``ascent`` is
    True where the loss gradient is ≥ 0. Not clamped to [0, 1], as in OpenOOD."""
    return x - epsilon * (2 * ascent.to(x.dtype) - 1)


def _predictive_perturbation(
    member_logits: MemberLogits, x: Tensor, temperature: float, epsilon: float, chunks: list[tuple[int, int]]
) -> Tensor:
    """``x - ε sign(∇_x -log p̄_T,ĉ(x))`` with ``ĉ = argmax p̄_T(x)``; x is a normal tensor."""
    x_grad = x.clone().requires_grad_(True)
    if len(chunks) == 1:  # one piece: the cross-entropy of the tempered predictive itself
        log_probs = F.log_softmax(_logits(member_logits, x_grad, *chunks[0]) / temperature, dim=-1)
        log_predictive = ensemble_log_probs(log_probs)  # for S = 1 exactly log_probs[0]
        label = log_predictive.detach().argmax(dim=1, keepdim=True)
        (grad,) = torch.autograd.grad(-log_predictive.gather(1, label).mean(), x_grad)
        return _perturbed(x, grad >= 0, epsilon)
    # ∇(-log p̄_ĉ) = -∇p̄_ĉ / p̄_ĉ has the sign of -Σ_s ∇p_{s,ĉ}, summed chunk by chunk
    label = _mean_tempered_probs(member_logits, x, chunks, temperature).argmax(dim=1)
    grad_sum = torch.zeros_like(x)
    for first, n in chunks:
        probs = F.softmax(_logits(member_logits, x_grad, first, n) / temperature, dim=-1)
        (grad,) = torch.autograd.grad(probs.gather(2, label.expand(n, -1).unsqueeze(2)).sum(), x_grad)
        grad_sum += grad
    return _perturbed(x, grad_sum <= 0, epsilon)


def _member_perturbation(member_logits: MemberLogits, x: Tensor, s: int, temperature: float, epsilon: float) -> Tensor:
    """OpenOOD's ODIN step for member s alone: ``x - ε sign(∇_x CE(z_s(x) / T, argmax z_s(x)))``."""
    x_grad = x.clone().requires_grad_(True)
    logits = _logits(member_logits, x_grad, s, 1)[0]
    label = logits.detach().argmax(dim=1)
    (grad,) = torch.autograd.grad(F.cross_entropy(logits / temperature, label), x_grad)
    return _perturbed(x, grad >= 0, epsilon)


def odin(
    member_logits: MemberLogits,
    x: Tensor,
    n_members: int,
    temperature: float = 1000.0,
    epsilon: float = 0.0014,
    on: str = "predictive",
    chunk: int | None = None,
) -> Tensor:
    """ODIN: temperature scaling and an input perturbation towards higher confidence; (b,) scores.

    Liang et al., 2018, "Enhancing The Reliability of Out-of-distribution Image Detection in
    Neural Networks" (ICLR), Eqs. 1-2; OpenOOD ``openood/postprocessors/odin_postprocessor.py``
    (``ODINPostprocessor``) with its defaults ``temperature: 1000``, ``noise: 0.0014``
    (``configs/postprocessors/odin.yml``; v1.5 sweeps T in {1, 10, 100, 1000} and the noise in
    {0.0014, 0.0028} under ``APS_mode``). OpenOOD, for one network with logits z:

        ĉ = argmax_c z_c(x),   x̃ = x - ε sign(∇_x CE(z(x) / T, ĉ)),
        confidence = max_c softmax(z(x̃) / T)_c,

    and this score is ``-confidence``. ``sign`` is OpenOOD's ``torch.ge(grad, 0)``: +1 where the
    gradient is ≥ 0 (a zero gradient steps by -ε). OpenOOD perturbs the NORMALISED input by
    ``ε sign / std`` per channel; here ``x`` is in [0, 1] pixel units and ``member_logits``
    normalises inside, so the same step is ``ε sign`` on the pixels (the gradient's sign is
    the same in both spaces, std > 0). The perturbed input is not clamped to [0, 1]: OpenOOD
    does not clamp either.

    ``member_logits(x, n, first)`` gives the logits (n, b, C) of members first .. first + n - 1
    on ``x`` (b, ...), differentiably in ``x``; each member must be the same function in every
    call. ``chunk`` members go in one call (None: all).

    * ``on="predictive"``: the averaged tempered predictive ``p̄_T = 1/S Σ_s softmax(z_s / T)``
      takes the network's place: ``ĉ = argmax_c p̄_T(x)``, ``x̃ = x - ε sign(∇_x -log p̄_T,ĉ(x))``,
      score ``-max_c p̄_T(x̃)``. In one chunk the loss is exactly that (for S = 1, OpenOOD's
      cross-entropy); in several, ``ĉ`` comes from a forward without gradients first and the
      gradient is accumulated as ``Σ_s ∇_x p_{s,ĉ}``, which has the sign of ``∇ p̄_ĉ`` and so
      the opposite sign of ``∇ -log p̄_ĉ``; only the sign is used.
    * ``on="members"``: each member runs OpenOOD's ODIN on its own (its own argmax, gradient and
      perturbed input), score ``-1/S Σ_s max_c softmax(z_s(x̃_s) / T)_c``. Each member is called
      alone (``n = 1``), twice; ``chunk`` does not apply.

    Works inside ``torch.no_grad()`` / ``torch.inference_mode()`` (gradients are re-enabled, as
    in :mod:`dbsn.evaluation.attacks`), and takes gradients with ``torch.autograd.grad`` with
    respect to the input only, so no parameter's ``.grad`` is touched. ``ε = 0`` skips the
    gradient.
    """
    if n_members < 1:
        raise ValueError(f"n_members must be at least 1, got {n_members}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if on not in ("predictive", "members"):
        raise ValueError(f'on must be "predictive" or "members", got {on!r}')
    chunks = _member_chunks(n_members, chunk)
    with torch.inference_mode(False), torch.enable_grad():
        x = _normal_tensor(x)
        if on == "predictive":
            x_tilde = x if epsilon == 0 else _predictive_perturbation(member_logits, x, temperature, epsilon, chunks)
            return -_mean_tempered_probs(member_logits, x_tilde, chunks, temperature).amax(dim=1)
        confidence = 0.0
        for s in range(n_members):  # each member needs its own perturbed input: one call each
            x_tilde = x if epsilon == 0 else _member_perturbation(member_logits, x, s, temperature, epsilon)
            confidence = confidence + _mean_tempered_probs(member_logits, x_tilde, [(s, 1)], temperature).amax(dim=1)
    return -confidence / n_members
