"""dbsn's OOD scores against pytorch-ood's detectors, on the same random logits and features.

Each score of `dbsn.metrics.ood_scores` / `dbsn.metrics.uncertainty` (and the member treatments of
`dbsn.evaluation.detection`) is computed by pytorch-ood's detector on the same inputs, in float64
where pytorch-ood allows it, and compared to a stated tolerance. Both orient scores alike (higher
= more OOD). Where a definition differs on purpose, the test says how and compares the part that
agrees:

- max softmax: dbsn scores ``1 - max_c p_c``, pytorch-ood ``-max_c p_c`` (an offset of 1); over
  several members, ``max_c`` of the members' mean softmax, pytorch-ood's MC-dropout mean;
- entropy: pytorch-ood clips p at 1e-7 before the log; the logits here keep every p above it;
- Mahalanobis: pytorch-ood's covariance is the class-centred scatter NOT divided by N, plus
  1e-6 I, and its score is half the squared distance, so dbsn's (OpenOOD's, Σ/N) is
  ``2 N`` times it up to the ridge (the same ranking);
- GDA (DDU's density) against pytorch-ood's GMM: DDU divides the class scatter by N_c - 1,
  pytorch-ood by N_c (plus ``reg`` I); the test compares the covariances through that factor
  and the density evaluation with pytorch-ood's fit moved to DDU's covariance;
- ViM: pytorch-ood fits and scores in float32 (it casts), so the tolerance is float32's;
- ODIN: pytorch-ood's step uses ``sign`` (0 for a zero gradient), dbsn ``ge(grad, 0)`` (+1);
  the smooth network here has no zero gradient. On several members dbsn perturbs the
  averaged predictive (no pytorch-ood counterpart); its per-member variant is the mean of
  pytorch-ood's ODIN of each member, which is tested.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("pytorch_ood", reason="pytorch-ood is not installed (pip install -e '.[oracles]')")

from pytorch_ood.detector import GMM, KNN, MCD, ODIN, EnergyBased, Entropy, MaxLogit, MaxSoftmax  # noqa: E402
from pytorch_ood.detector import Mahalanobis as PoodMahalanobis  # noqa: E402
from pytorch_ood.detector import ViM as PoodViM  # noqa: E402

from dbsn.evaluation.detection import EnergyScore, KNNScore, MaxLogitScore, Members, Training  # noqa: E402
from dbsn.metrics import ood_scores  # noqa: E402
from dbsn.metrics.uncertainty import ood_scores as predictive_scores  # noqa: E402

#: float64 agreement of two evaluations of the same closed form (a few ulps of the scores' size)
EXACT = dict(rtol=1e-12, atol=1e-12)


def _logits(n: int = 300, c: int = 10, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return scale * torch.randn(n, c, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _features(n: int, d: int, c: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-clustered features (n, d) with a spread spectrum and labels (n,) with every class."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % c
    means = 3 * torch.randn(c, d, generator=g, dtype=torch.float64)
    scales = torch.logspace(0, -1.5, d, dtype=torch.float64)  # distinct variances: a clean eigen-cut
    return means[labels] + torch.randn(n, d, generator=g, dtype=torch.float64) * scales, labels


# ---------------------------------------------------------------------------------- of the logits
def test_max_logit_and_energy_equal_pytorch_ood():
    z = _logits()
    torch.testing.assert_close(ood_scores.max_logit(z), MaxLogit(None).predict_logits(z), **EXACT)
    for t in (1.0, 0.5, 1000.0):
        torch.testing.assert_close(ood_scores.energy(z, t), EnergyBased(None, t=t).predict_logits(z), **EXACT)


def test_member_treatments_are_pytorch_ood_of_the_mean_logits_or_the_mean_over_members():
    """`max_logit` / `energy` of a posterior: of the members' mean logits, or (``_members``) the
    mean of each member's score; for one member both are pytorch-ood's score."""
    members = torch.stack([_logits(seed=s) for s in range(4)])  # (S, N, C)
    batch = Members(n=4, images=torch.empty(0), logits=members, features=None, logits_of=None, per_forward=4)
    for ours, theirs in ((MaxLogitScore, MaxLogit(None)), (EnergyScore, EnergyBased(None, t=2.0))):
        kwargs = {"temperature": 2.0} if ours is EnergyScore else {}
        mean = ours(members="mean_logits", **kwargs).score(batch)
        torch.testing.assert_close(mean, theirs.predict_logits(members.mean(0)), **EXACT)
        per_member = ours(members="per_member", **kwargs).score(batch)
        each = torch.stack([theirs.predict_logits(z) for z in members])
        torch.testing.assert_close(per_member, each.mean(0), **EXACT)


def test_predictive_scores_equal_pytorch_ood_max_softmax_and_entropy():
    """One member: dbsn's ``max_probability`` is ``1 - max p`` (pytorch-ood: ``-max p``), its
    ``entropy`` pytorch-ood's (whose clip at p = 1e-7 no probability here reaches)."""
    z = _logits(scale=2.0)
    assert z.softmax(1).min() > 1e-7
    ours = predictive_scores(torch.log_softmax(z, dim=1)[None])
    torch.testing.assert_close(ours["max_probability"] - 1, MaxSoftmax(None).predict_logits(z), **EXACT)
    torch.testing.assert_close(ours["entropy"], Entropy(None).predict_logits(z), **EXACT)
    torch.testing.assert_close(ours["mutual_information"], torch.zeros(len(z), dtype=z.dtype), rtol=0, atol=1e-12)


def test_max_probability_of_members_equals_pytorch_ood_mc_dropout_mean():
    """Several members: dbsn's ``max_probability`` (1 − max_c of the members' mean softmax) against
    pytorch-ood's MC-dropout detector, whose N forward passes here return the members' logits in
    turn. ``MCD.run`` keeps float64 (1e-12); ``predict`` accumulates in float32 (float32's rounding)."""
    members = _logits(n=120, seed=8).unsqueeze(0) + 2 * torch.randn(
        5, 120, 10, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )

    class Cycle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return members[(self.calls - 1) % len(members)]

    ours = predictive_scores(torch.log_softmax(members, -1))["max_probability"]
    x = torch.zeros(120, 1)
    torch.testing.assert_close(1 - ours, MCD.run(Cycle(), x, samples=5)[0], **EXACT)
    theirs = MCD(Cycle(), samples=5, mode="mean").predict(x)
    torch.testing.assert_close(ours - 1, theirs.double(), rtol=0, atol=1e-6)


# -------------------------------------------------------------------------------- of the features
def test_mahalanobis_is_2n_times_pytorch_ood():
    """dbsn (OpenOOD's MDS): min_c d^T (S/N)^+ d; pytorch-ood: ½ min_c d^T (S + εI)^-1 d with ε = 1e-6,
    S the class-centred scatter. So dbsn = 2N · pytorch-ood up to the ridge, which shrinks every
    quadratic form by a relative amount of at most ε / λ_min(S): the tolerance. pytorch-ood
    allocates its statistics in the default dtype: float64 for this test."""
    z, y = _features(400, 12, 5)
    queries, _ = _features(150, 12, 5, seed=1)
    queries = queries + torch.randn(queries.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fitted = ood_scores.Mahalanobis().fit(z, y, 5)
    centred = z - fitted.class_means[y]
    ridge_effect = 1e-6 / torch.linalg.eigvalsh(centred.T @ centred)[0].item()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        theirs = PoodMahalanobis(None).fit_features(z, y).predict_features(queries)
    finally:
        torch.set_default_dtype(previous)
    assert theirs.dtype == torch.float64 and ridge_effect < 1e-5
    torch.testing.assert_close(fitted.score(queries), 2 * len(z) * theirs, rtol=ridge_effect + 1e-10, atol=0)


def test_knn_equals_pytorch_ood():
    """The distance to the k-th nearest normalised training feature. pytorch-ood searches with
    scikit-learn (exact Euclidean distances); dbsn forms ‖a‖² + ‖b‖² - 2ab in float64, whose
    cancellation costs about 1e-8 absolute on distances of order 1."""
    z, y = _features(500, 16, 5)
    queries, _ = _features(120, 16, 5, seed=3)
    for k in (1, 7, 50):
        ours = ood_scores.KNN(k=k).fit(z).score(queries)
        theirs = KNN(None, k=k).fit_features(z, y).predict_features(queries)
        torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=1e-7)


def test_feature_score_treatments_are_pytorch_ood_per_member_or_of_the_mean_feature():
    """`KNNScore` of a posterior (`dbsn.evaluation.detection`): ``per_member`` fits each member on
    its own training features and averages the members' scores; ``pooled`` fits and scores the
    members' mean feature. Both are pytorch-ood's KNN on those features."""
    train = torch.stack([_features(300, 8, 4, seed=s)[0] for s in range(3)])  # (S, N, D)
    labels = _features(300, 8, 4)[1]
    queries = torch.stack([_features(60, 8, 4, seed=10 + s)[0] for s in range(3)])
    training = Training(
        logits=torch.empty(3, 300, 4), features=train, labels=labels, num_classes=4, heads=None, method="test"
    )
    batch = Members(n=3, images=torch.empty(0), logits=None, features=queries, logits_of=None, per_forward=3)
    theirs = [KNN(None, k=5).fit_features(f, labels).predict_features(q) for f, q in zip(train, queries)]
    score = KNNScore(members="per_member", k=5)
    score.fit(training)
    torch.testing.assert_close(score.score(batch), torch.stack(theirs).mean(0), rtol=0, atol=1e-7)
    score = KNNScore(members="pooled", k=5)
    score.fit(training)
    pooled = KNN(None, k=5).fit_features(train.mean(0), labels).predict_features(queries.mean(0))
    torch.testing.assert_close(score.score(batch), pooled, rtol=0, atol=1e-7)


def test_vim_equals_pytorch_ood_to_float32():
    """Virtual logit minus the energy, on the same head W, b and principal dimension. pytorch-ood
    casts everything to float32, so the scores agree to float32's precision relative to their
    spread (the features' spectrum is spread, so the eigen-cut is the same subspace)."""
    c, d, dim = 6, 16, 8
    z, y = _features(600, d, c)
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(c, d, generator=g, dtype=torch.float64), torch.randn(c, generator=g, dtype=torch.float64)
    queries, _ = _features(100, d, c, seed=5)
    queries = queries + 0.3 * torch.randn(queries.shape, generator=g, dtype=torch.float64)
    fitted = ood_scores.ViM(dim=dim).fit(z, weight, bias)
    detector = PoodViM(None, d=dim, w=weight, b=bias).fit_features(z, y)
    assert math.isclose(fitted.alpha.item(), detector.alpha, rel_tol=1e-4)
    ours, theirs = fitted.score(queries), detector.predict_features(queries).double()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * ours.abs().max().item())


def test_gda_equals_pytorch_ood_gmm_up_to_the_covariance_divisor():
    """DDU's GDA (dbsn) and pytorch-ood's GMM: -log Σ_c π_c N(z; μ_c, Σ_c). They differ on purpose
    in Σ_c: the class scatter / (N_c - 1) (DDU's ``centered_cov_torch``) against / N_c + reg I.
    With reg = 0: (1) dbsn's Σ_c = N_c / (N_c - 1) · pytorch-ood's; (2) pytorch-ood's fitted
    precision and log-determinant moved to DDU's Σ_c give dbsn's score exactly (the means, priors
    and the Gaussian log-density agree), to float64 rounding."""
    c, d = 4, 6
    z, y = _features(403, d, c)  # unequal class sizes (101, 101, 101, 100)
    queries, _ = _features(80, d, c, seed=6)
    ours = ood_scores.GDA().fit(z, y, c)
    assert ours.jitter.item() == 0
    gmm = GMM(None, reg=0.0).fit_features(z, y)
    counts = torch.bincount(y, minlength=c).double()
    factor = counts / (counts - 1)
    theirs_cov = torch.linalg.inv(gmm._precision)
    ours_cov = ours.scale_tril @ ours.scale_tril.transpose(-1, -2)
    torch.testing.assert_close(ours_cov, factor[:, None, None] * theirs_cov, rtol=1e-10, atol=1e-12)
    gmm._precision = gmm._precision / factor[:, None, None]
    gmm._log_det = gmm._log_det + d * factor.log()
    torch.testing.assert_close(ours.score(queries), gmm.predict_features(queries), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------- of the input
class _Net(nn.Module):
    """A smooth network (tanh) in float64: no input gradient is exactly zero."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5)).double()

    def forward(self, x):
        return self.body(x)


def test_odin_equals_pytorch_ood_for_one_network_and_per_member():
    """One network: dbsn's ODIN (either treatment) is pytorch-ood's (no ``norm_std``: the step is
    in the input's own units, as dbsn's). Several members: dbsn's ``on="members"`` is the mean of
    pytorch-ood's ODIN of each member; ``on="predictive"`` (the averaged tempered predictive
    perturbed as one) has no pytorch-ood counterpart and is not compared."""
    nets = [_Net(s) for s in range(3)]
    x = torch.rand(20, 3, 2, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def member_logits(inputs, n, first):
        return torch.stack([nets[first + i](inputs) for i in range(n)])

    for temperature, epsilon in ((1000.0, 0.0014), (10.0, 0.05), (1.0, 0.0)):
        one = lambda inputs, n, first: member_logits(inputs, n, 0)  # noqa: E731
        theirs = ODIN(nets[0], eps=epsilon, temperature=temperature).predict(x)
        for on in ("predictive", "members"):
            ours = ood_scores.odin(one, x, 1, temperature=temperature, epsilon=epsilon, on=on)
            torch.testing.assert_close(ours, theirs, **EXACT)
        ours = ood_scores.odin(member_logits, x, 3, temperature=temperature, epsilon=epsilon, on="members")
        mean = torch.stack([ODIN(net, eps=epsilon, temperature=temperature).predict(x) for net in nets]).mean(0)
        torch.testing.assert_close(ours, mean, **EXACT)
