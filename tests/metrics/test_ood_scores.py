"""Tests for dbsn.metrics.ood_scores: each score against a direct reference (scikit-learn, brute
force, OpenOOD's code written out in numpy/torch) and its orientation (higher = more OOD)."""

import math

import numpy as np
import pytest
import torch
from numpy.linalg import norm, pinv
from scipy.special import logsumexp
from sklearn.covariance import EmpiricalCovariance
from torch import nn

from dbsn.metrics.ood_scores import KNN, KNN_CHUNK_ELEMENTS, Mahalanobis, ViM, energy, max_logit, odin, vim_dim

FLAT = torch.zeros(1, 4, dtype=torch.float64)
CONFIDENT = torch.tensor([[8.0, 0.0, 0.0, 0.0]], dtype=torch.float64)


# ------------------------------------------------------------------------------------ logits
def test_max_logit_and_energy_by_formula():
    logits = 3 * torch.randn(20, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(max_logit(logits), -logits.max(dim=1).values)
    for t in (1.0, 0.5, 1000.0):
        by_hand = [-t * math.log(sum(math.exp(v / t) for v in row)) for row in logits.tolist()]
        assert energy(logits, temperature=t).tolist() == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        energy(logits, temperature=0)


def test_energy_is_finite_for_large_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [5e4, 5e4, 5e4]])  # exp overflows float32 at 89
    scores = energy(logits)
    assert torch.isfinite(scores).all()
    assert scores.tolist() == pytest.approx([-1e4, -5e4 - math.log(3)], rel=1e-6)


def test_logit_scores_are_higher_for_flat_logits():
    for score in (max_logit, energy, lambda z: energy(z, temperature=10.0)):
        assert score(FLAT).item() > score(CONFIDENT).item()


# ------------------------------------------------------------------------------- Mahalanobis
def _class_data(seed, n, d, c, rank=None):
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % c
    latent = rng.normal(size=(n, rank or d))
    x = (latent @ rng.normal(size=(rank, d)) if rank else latent) + 3 * rng.normal(size=(c, d))[labels]
    return x, labels, rng.normal(size=(15, d)) * 2


def _sklearn_mahalanobis(train, labels, c, queries):
    means = np.stack([train[labels == k].mean(0) for k in range(c)])
    ec = EmpiricalCovariance(assume_centered=False).fit(train - means[labels])
    diffs = queries[:, None, :] - means[None]  # (N, C, D)
    return np.einsum("ncd,de,nce->nc", diffs, ec.precision_, diffs).min(axis=1), means, ec.precision_


@pytest.mark.parametrize(
    ("n", "d", "c", "rank"),
    [(80, 5, 3, None), (60, 7, 3, 3), (6, 9, 2, None)],
    ids=["full-rank", "features-in-a-subspace", "fewer-samples-than-dimensions"],
)
def test_mahalanobis_equals_sklearn_closed_form(n, d, c, rank):
    train, labels, queries = _class_data(0, n, d, c, rank)
    expected, means, precision = _sklearn_mahalanobis(train, labels, c, queries)
    fitted = Mahalanobis().fit(torch.from_numpy(train), torch.from_numpy(labels), c)
    np.testing.assert_allclose(fitted.class_means.numpy(), means, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fitted.precision.numpy(), precision, rtol=1e-7, atol=1e-9 * np.abs(precision).max())
    scores = fitted.score(torch.from_numpy(queries))
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-8, atol=1e-9 * expected.max())
    assert torch.equal(fitted(torch.from_numpy(queries)), scores)
    if rank is None:  # float32 features in: fitted and scored in float64 all the same
        fitted32 = Mahalanobis().fit(torch.from_numpy(train).float(), torch.from_numpy(labels), c)
        assert fitted32.precision.dtype == torch.float64
        scores32 = fitted32.score(torch.from_numpy(queries).float())
        assert scores32.dtype == torch.float64
        np.testing.assert_allclose(scores32.numpy(), expected, rtol=1e-5)


def test_mahalanobis_refusals_and_orientation():
    train, labels, _ = _class_data(1, 40, 4, 2)
    train, labels = torch.from_numpy(train), torch.from_numpy(labels)
    with pytest.raises(RuntimeError, match="not fitted"):
        Mahalanobis().score(train)
    with pytest.raises(ValueError, match=r"classes \[2\] have no training features"):
        Mahalanobis().fit(train, labels, 3)
    with pytest.raises(ValueError, match="labels must lie"):
        Mahalanobis().fit(train, labels + 1, 2)
    fitted = Mahalanobis().fit(train, labels, 2)
    at_mean, far = fitted.class_means[:1], fitted.class_means[:1] + 50
    assert fitted.score(at_mean).item() == pytest.approx(0, abs=1e-9)
    assert fitted.score(far).item() > fitted.score(at_mean).item()


# ----------------------------------------------------------------------------------------- KNN
def _brute_force_knn(train, queries, k):
    normalize = lambda x: x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-10)  # the authors' form
    t, q = normalize(train), normalize(queries)
    distances = np.sqrt(((q[:, None, :] - t[None, :, :]) ** 2).sum(-1))
    return np.sort(distances, axis=1)[:, k - 1]


@pytest.mark.parametrize("chunk", [None, 1, 3, 11, 40])
def test_knn_equals_brute_force_across_chunk_boundaries(chunk):
    rng = np.random.default_rng(2)
    train, queries = rng.normal(size=(40, 6)), rng.normal(size=(11, 6))
    for k in (1, 5, 40):
        knn = KNN(k=k, chunk=chunk).fit(torch.from_numpy(train))
        np.testing.assert_allclose(
            knn.score(torch.from_numpy(queries)).numpy(), _brute_force_knn(train, queries, k), rtol=1e-10, atol=1e-10
        )
    # a training feature is its own nearest neighbour (distance 0 up to the expansion's round-off)
    assert KNN(k=1, chunk=chunk).fit(torch.from_numpy(train)).score(torch.from_numpy(train[:3])).max() < 1e-6


def test_knn_float32_as_faiss_and_openood_squared_distances():
    rng = np.random.default_rng(3)
    train, queries = rng.normal(size=(200, 16)), rng.normal(size=(30, 16))
    scores = KNN(k=50, chunk=7).fit(torch.from_numpy(train).float()).score(torch.from_numpy(queries).float())
    assert scores.dtype == torch.float32
    np.testing.assert_allclose(scores.numpy(), _brute_force_knn(train, queries, 50), rtol=1e-5)
    # OpenOOD: normalizer = x / norm(x) + 1e-10, faiss IndexFlatL2 → squared distances, conf = -D[:, -1]
    openood_normalizer = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True) + 1e-10
    t, q = openood_normalizer(train), openood_normalizer(queries)
    kth_squared = np.sort(((q[:, None, :] - t[None]) ** 2).sum(-1), axis=1)[:, 49]
    np.testing.assert_allclose(scores.numpy() ** 2, kth_squared, rtol=1e-5)


def test_knn_memory_budget_at_cifar_scale():
    train = torch.randn(50_000, 640, generator=torch.Generator().manual_seed(4))
    knn = KNN().fit(train)
    assert knn.k == 50 and knn.query_chunk == KNN_CHUNK_ELEMENTS // 50_000 == 335
    queries = torch.randn(4, 640, generator=torch.Generator().manual_seed(5))
    direct = torch.cdist(KNN.normalize(queries).double(), knn.train_features.double()).sort(dim=1).values[:, 49]
    torch.testing.assert_close(knn.score(queries).double(), direct, rtol=1e-5, atol=1e-6)


def test_knn_refusals_and_orientation():
    with pytest.raises(ValueError, match="k = 5 nearest neighbours asked for, but only 4 training features"):
        KNN(k=5).fit(torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="not fitted"):
        KNN().score(torch.randn(2, 3))
    train = torch.rand(100, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64) + 1  # one orthant
    knn = KNN(k=10).fit(train)
    with pytest.raises(ValueError, match="D = 7"):
        knn.score(torch.randn(2, 7))
    assert knn.score(-train[:1]).item() > knn.score(train[:1]).item()


# ----------------------------------------------------------------------------------------- ViM
def _openood_vim(feature_id_train, feature_ood, w, b, dim):
    """openood/postprocessors/vim_postprocessor.py (setup, postprocess), line by line; the confidence."""
    logit_id_train = feature_id_train @ w.T + b
    u = -np.matmul(pinv(w), b)
    ec = EmpiricalCovariance(assume_centered=True)
    ec.fit(feature_id_train - u)
    eig_vals, eigen_vectors = np.linalg.eig(ec.covariance_)
    NS = np.ascontiguousarray((eigen_vectors.T[np.argsort(eig_vals * -1)[dim:]]).T)
    vlogit_id_train = norm(np.matmul(feature_id_train - u, NS), axis=-1)
    alpha = logit_id_train.max(axis=-1).mean() / vlogit_id_train.mean()

    logit_ood = feature_ood @ w.T + b
    energy_ood = logsumexp(logit_ood, axis=-1)
    vlogit_ood = norm(np.matmul(feature_ood - u, NS), axis=-1) * alpha
    return -vlogit_ood + energy_ood


def test_vim_equals_openood_on_a_tiny_network():
    torch.manual_seed(7)
    body = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    head = nn.Linear(10, 3).double()
    with torch.no_grad():
        train = body(torch.randn(300, 4, dtype=torch.float64))
        test = body(torch.cat([torch.randn(20, 4, dtype=torch.float64), 4 * torch.randn(20, 4, dtype=torch.float64)]))
    w, b = head.weight.detach(), head.bias.detach()
    fitted = ViM().fit(train, w, b)
    assert vim_dim(10) == 5 and fitted.residual_basis.shape == (10, 5)
    confidence = _openood_vim(train.numpy(), test.numpy(), w.numpy(), b.numpy(), dim=5)
    np.testing.assert_allclose(fitted.score(test).numpy(), -confidence, rtol=1e-9, atol=1e-9)
    for dim in (0, 2, 9):
        np.testing.assert_allclose(
            ViM(dim=dim).fit(train, w, b).score(test.float()).numpy(),
            -_openood_vim(train.numpy(), test.numpy(), w.numpy(), b.numpy(), dim),
            rtol=1e-6,
            atol=1e-6,
        )  # float32 features in, float64 scores out


def test_vim_default_dims_and_refusals():
    assert [vim_dim(d) for d in (4096, 2048, 768, 512, 342, 10)] == [1000, 1000, 512, 256, 171, 5]
    train, w, b = torch.randn(50, 6), torch.randn(2, 6), torch.randn(2)
    for dim in (6, 7, -1):
        with pytest.raises(ValueError, match="must leave a residual space"):
            ViM(dim=dim).fit(train, w, b)
    with pytest.raises(ValueError, match="expected weight"):
        ViM().fit(train, torch.randn(2, 5), b)


def test_vim_is_higher_for_flat_logits_off_the_principal_subspace():
    gen = torch.Generator().manual_seed(8)
    w, b = torch.zeros(2, 6, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    w[0, 0] = w[1, 1] = 3.0  # origin u = 0; the logits read dims 0 and 1
    labels = torch.arange(200) % 2
    train = 0.1 * torch.randn(200, 6, generator=gen, dtype=torch.float64)
    train[:, :2] += 2 * nn.functional.one_hot(labels, 2) + 0.5 * torch.randn(200, 2, generator=gen, dtype=torch.float64)
    fitted = ViM(dim=2).fit(train, w, b)
    confident = torch.tensor([[2.0, 0, 0, 0, 0, 0]], dtype=torch.float64)  # logits (6, 0)
    flat_off_subspace = torch.tensor([[0, 0, 0.5, 0.5, 0, 0]], dtype=torch.float64)  # logits (0, 0)
    assert fitted.score(flat_off_subspace).item() > fitted.score(confident).item()


# ---------------------------------------------------------------------------------------- ODIN
MEAN = torch.tensor([0.49, 0.48, 0.45], dtype=torch.float64).view(1, 3, 1, 1)
STD = torch.tensor([0.247, 0.243, 0.261], dtype=torch.float64).view(1, 3, 1, 1)


def _tiny_nets(n, seed=9):
    """n small networks without biases that ignore pixel 0 (its gradient is exactly 0, where
    OpenOOD's ``torch.ge(grad, 0)`` steps by -ε and a plain ``sign`` would not step)."""
    torch.manual_seed(seed)
    nets = [
        nn.Sequential(nn.Flatten(), nn.Linear(48, 16, bias=False), nn.Tanh(), nn.Linear(16, 5, bias=False)).double()
        for _ in range(n)
    ]
    for net in nets:
        with torch.no_grad():
            net[1].weight[:, 0] = 0
    return nets


def _member_logits(nets, calls=None):
    def member_logits(x, n, first):
        if calls is not None:
            calls.append((x.detach().clone(), n, first))
        return torch.stack([nets[first + i]((x - MEAN) / STD) for i in range(n)])

    return member_logits


def _openood_odin(net, data, temperature, noise):
    """openood/postprocessors/odin_postprocessor.py (postprocess), line by line on the
    normalised input; the confidence."""
    input_std = STD.flatten().tolist()
    data = data.clone()
    data.requires_grad = True
    output = net(data)
    criterion = nn.CrossEntropyLoss()
    labels = output.detach().argmax(axis=1)
    output = output / temperature
    loss = criterion(output, labels)
    loss.backward()
    gradient = torch.ge(data.grad.detach(), 0)
    gradient = (gradient.float() - 0.5) * 2
    gradient[:, 0] = (gradient[:, 0]) / input_std[0]
    gradient[:, 1] = (gradient[:, 1]) / input_std[1]
    gradient[:, 2] = (gradient[:, 2]) / input_std[2]
    tempInputs = torch.add(data.detach(), gradient, alpha=-noise)
    output = net(tempInputs)
    output = output / temperature
    nnOutput = output.detach()
    nnOutput = nnOutput - nnOutput.max(dim=1, keepdims=True).values
    nnOutput = nnOutput.exp() / nnOutput.exp().sum(dim=1, keepdims=True)
    conf, _ = nnOutput.max(dim=1)
    return conf, tempInputs * STD + MEAN  # and the perturbed input in pixels


def _images(b=8, seed=10):
    return torch.rand(b, 3, 4, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("on", ["predictive", "members"])
@pytest.mark.parametrize(("temperature", "epsilon"), [(1000.0, 0.0014), (1.0, 0.0028)])
def test_odin_one_member_equals_openood(on, temperature, epsilon):
    (net,) = _tiny_nets(1)
    x = _images()
    scores = odin(_member_logits([net]), x, 1, temperature=temperature, epsilon=epsilon, on=on)
    assert all(p.grad is None for p in net.parameters())
    confidence = _openood_odin(net, (x - MEAN) / STD, temperature, epsilon)[0]  # its backward() fills .grad
    torch.testing.assert_close(scores, -confidence, rtol=1e-9, atol=1e-12)
    # the test can tell the direction: stepping the other way changes the score far beyond that tolerance
    wrong_way, _ = _openood_odin(net, (x - MEAN) / STD, temperature, -epsilon)
    assert (wrong_way - confidence).abs().min() > 1e3 * 1e-9 * confidence.abs().max()


def test_odin_defaults_are_openoods():
    (net,) = _tiny_nets(1)
    x = _images()
    expected = -_openood_odin(net, (x - MEAN) / STD, 1000, 0.0014)[0]
    torch.testing.assert_close(odin(_member_logits([net]), x, 1), expected, rtol=1e-9, atol=1e-12)


def _one_piece_perturbation(nets, x, temperature, epsilon):
    """x - ε sign(∇_x -log p̄_T,ĉ) (OpenOOD's sign: +1 where ≥ 0), the predictive in one piece."""
    x = x.clone().requires_grad_(True)
    probs = torch.stack([torch.softmax(net((x - MEAN) / STD) / temperature, dim=-1) for net in nets])
    log_predictive = probs.mean(dim=0).log()
    label = log_predictive.detach().argmax(dim=1, keepdim=True)
    (grad,) = torch.autograd.grad(-log_predictive.gather(1, label).sum(), x)
    return x.detach() - epsilon * torch.where(grad >= 0, 1.0, -1.0).to(x.dtype)


@pytest.mark.parametrize("chunk", [None, 1, 2, 5])
def test_odin_predictive_direction_is_the_sign_of_the_whole_gradient(chunk):
    nets, x, t, eps = _tiny_nets(5), _images(), 1000.0, 0.0014
    calls = []
    scores = odin(_member_logits(nets, calls), x, 5, temperature=t, epsilon=eps, chunk=chunk)
    expected_x = _one_piece_perturbation(nets, x, t, eps)
    blocks = [(first, min(chunk or 5, 5 - first)) for first in range(0, 5, chunk or 5)]
    perturbed_calls = calls[-len(blocks) :]  # the last pass runs every member on x̃
    assert [(first, n) for _, n, first in perturbed_calls] == blocks
    for x_tilde, _, _ in perturbed_calls:
        assert torch.equal(torch.sign(x_tilde - x), torch.sign(expected_x - x))
        assert (x_tilde - x)[:, 0, 0, 0].tolist() == pytest.approx([-eps] * len(x))  # zero gradient: -ε, as OpenOOD
    with torch.no_grad():
        predictive = torch.stack([torch.softmax(net((expected_x - MEAN) / STD) / t, dim=-1) for net in nets]).mean(0)
    torch.testing.assert_close(scores, -predictive.amax(dim=1), rtol=1e-12, atol=1e-15)
    assert all(p.grad is None for net in nets for p in net.parameters())


def test_odin_members_is_the_mean_of_each_members_odin():
    nets, x = _tiny_nets(3), _images()
    calls = []
    scores = odin(_member_logits(nets, calls), x, 3, on="members")
    assert all(p.grad is None for net in nets for p in net.parameters())
    references = [_openood_odin(net, (x - MEAN) / STD, 1000, 0.0014) for net in nets]
    torch.testing.assert_close(scores, -torch.stack([conf for conf, _ in references]).mean(0), rtol=1e-9, atol=1e-12)
    # member by member: its gradient call on x, then its own perturbed input
    assert [(n, first) for _, n, first in calls] == [(1, 0), (1, 0), (1, 1), (1, 1), (1, 2), (1, 2)]
    for (x_tilde, _, _), (_, expected_x) in zip(calls[1::2], references):
        assert torch.equal(torch.sign(x_tilde - x), torch.sign(expected_x - x))
        assert (x_tilde - x)[:, 0, 0, 0].tolist() == pytest.approx([-0.0014] * len(x))  # the ignored pixel


def test_odin_under_inference_mode_and_no_grad():
    nets = _tiny_nets(2)
    x = _images()
    expected = {on: odin(_member_logits(nets), x, 2, on=on) for on in ("predictive", "members")}
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            x_inner = _images()
            for on in ("predictive", "members"):
                torch.testing.assert_close(odin(_member_logits(nets), x_inner, 2, on=on, chunk=1), expected[on])
    assert all(p.grad is None for net in nets for p in net.parameters())


def test_odin_zero_epsilon_is_tempered_confidence_and_refusals():
    nets, x = _tiny_nets(2), _images()
    with torch.no_grad():
        probs = torch.stack([torch.softmax(net((x - MEAN) / STD) / 10.0, dim=-1) for net in nets])
    torch.testing.assert_close(odin(_member_logits(nets), x, 2, temperature=10.0, epsilon=0.0), -probs.mean(0).amax(1))
    torch.testing.assert_close(
        odin(_member_logits(nets), x, 2, temperature=10.0, epsilon=0.0, on="members"), -probs.amax(2).mean(0)
    )
    with pytest.raises(ValueError, match="on must be"):
        odin(_member_logits(nets), x, 2, on="mean")
    with pytest.raises(ValueError, match=r"must give \(n, b, C\)"):
        odin(lambda x, n, first: torch.zeros(n, 5), x, 2)


def test_odin_is_higher_for_flat_logits():
    nets = _tiny_nets(3)  # no biases: the normalised input 0 (pixels at the mean) has logits exactly 0
    flat = MEAN.expand(1, 3, 4, 4).clone()
    confident = MEAN + 3 * STD * torch.randn(
        1, 3, 4, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64
    )
    for on in ("predictive", "members"):
        scores = odin(_member_logits(nets), torch.cat([flat, confident]), 3, on=on)
        assert scores[0] > scores[1]
