"""Per-structure BatchNorm statistics at prediction: each fixed member of the Bayes ensemble is
normalised with the statistics of its own structure, computed for many structures in grouped
forwards; they must equal those of the structure alone."""

from __future__ import annotations

import copy

import torch

from dbsn.methods import DBSN, BatchNormRecalibration, Prediction
from dbsn.nets import GroupBatchNorm2d, StructureNet


class _Images:
    """What the method needs of a data module: training images and their preprocessing."""

    def __init__(self, n: int = 24) -> None:
        self.images = torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def training_images(self, n: int, seed: int = 0) -> torch.Tensor:
        return self.images[:n]

    def preprocess(self, images: torch.Tensor, train: bool = False) -> torch.Tensor:
        return images.float() / 255 - 0.5


def _method(enabled: bool = True) -> DBSN:
    torch.manual_seed(0)
    net = StructureNet(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)
    method = DBSN(net, dataset_size=100, prediction=Prediction(n_samples=100, val_samples=10, samples_per_forward=2),
                  bn_recalibration=BatchNormRecalibration(enabled=enabled, images=24, batch_size=10))
    with torch.no_grad():  # running statistics unlike any structure's, as after training
        for m in net.modules():
            if isinstance(m, GroupBatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    method.beta.fill_(0.5)
    return method.eval()


def _alone(method: DBSN, alpha: torch.Tensor, batches: list[torch.Tensor]):
    """The network with the running statistics of one structure on `batches`, computed the
    plain way: nn.BatchNorm2d's cumulative average (momentum=None) over the batches, groups = 1."""
    net = copy.deepcopy(method.net).train()
    for m in net.modules():
        if isinstance(m, GroupBatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    with torch.no_grad():
        for x in batches:
            net(x, alpha)
    return net.eval()


def test_each_member_has_the_statistics_of_its_structure_alone():
    method, data = _method(), _Images()
    method.prepare_prediction(data)
    batches = [data.preprocess(b) for b in data.images.split(10)]  # 10, 10, 4 images
    alpha, statistics = method._fixed_members(5)  # grouped forwards of 2, 2 and 1 structures
    assert alpha.shape[0] == 5 and len(statistics) == sum(isinstance(m, GroupBatchNorm2d) for m in method.net.modules())
    for s in range(5):
        reference = dict(_alone(method, alpha[s], batches).named_modules())
        for name, (mean, var) in statistics.items():
            torch.testing.assert_close(mean[s], reference[name].running_mean, rtol=1e-4, atol=1e-5, msg=name)
            torch.testing.assert_close(var[s], reference[name].running_var, rtol=1e-4, atol=1e-5, msg=name)
    # the network's own running statistics are untouched
    assert all(torch.equal(a, b) for a, b in zip(method.net.state_dict().values(), _method().net.state_dict().values()))


def test_a_member_predicts_as_its_structure_alone_with_its_statistics():
    method, data = _method(), _Images()
    method.prepare_prediction(data)
    batches = [data.preprocess(b) for b in data.images.split(10)]
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        members = method.stochastic_forward(x, 3, first=2)  # members 2, 3, 4
        alpha = method.prediction_structures(3, first=2)
        for i in range(3):
            torch.testing.assert_close(members[i], _alone(method, alpha[i], batches)(x, alpha[i]), rtol=1e-4, atol=1e-5)
        # with the shared running statistics the prediction is another one
        assert not torch.allclose(members[0], method.net(x, alpha[0]), atol=1e-3)


def test_members_are_fixed_and_grow_on_demand_while_recalibrated():
    method, data = _method(), _Images()
    method.prepare_prediction(data)
    first = method.prediction_structures(3)
    assert torch.equal(method.prediction_structures(2, first=1), first[1:3])
    more = method.prediction_structures(4, first=3)  # members 3..6 are drawn now
    assert torch.equal(method.prediction_structures(7)[:3], first) and torch.equal(method.prediction_structures(7)[3:], more)
    method.prepare_prediction(data)  # a new test pass: the same members, drawn from the setting's seed
    torch.manual_seed(123)  # whatever the global stream
    assert torch.equal(method.prediction_structures(3), first)


def test_data_parallel_ranks_predict_with_the_same_members():
    """Each data-parallel rank's random stream is its own (the seed is offset per rank), yet the
    fixed members (and their statistics) are the same on every rank: one ensemble scores the
    whole test set. Two ranks emulated by two copies of the trained method with different global
    streams."""
    data = _Images()
    ranks = []
    for rank in range(2):
        method = _method()
        torch.manual_seed(1000 + 104729 * rank)  # as Method.on_fit_start offsets ranks
        method.prepare_prediction(data)
        ranks.append(method._fixed_members(5))
    assert torch.equal(ranks[0][0], ranks[1][0])
    for name in ranks[0][1]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][1][name], ranks[1][1][name]))


def test_without_recalibration_every_call_draws_fresh_structures_with_running_statistics():
    method, data = _method(enabled=False), _Images()
    method.prepare_prediction(data)
    assert not torch.equal(method.prediction_structures(3), method.prediction_structures(3))
    x = torch.randn(4, 3, 16, 16)
    torch.manual_seed(5)
    members = method.stochastic_forward(x, 2)
    torch.manual_seed(5)
    alpha = method.prediction_structures(2)
    torch.testing.assert_close(members[1], method.net(x, alpha[1]))
