"""The map_fixed model on digits that the post-hoc posteriors are fitted on (test_fixed.py,
test_laplace.py): made once for the package, as it was once for the module that held both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dbsn.data.base import in_memory_loader
from dbsn.data.digits import DigitsDataModule
from dbsn.methods import MAP
from dbsn.posthoc.fixed import FixedStructureNetwork
from dbsn.posthoc.laplace import head_features
from tests.support.netutil import tiny_structure_net


def _fit_head_by_logistic_regression(head: nn.Linear, features, labels, weight_decay: float = 0.0) -> None:
    """The head's optimum on fixed features (full-batch L-BFGS), so the Laplace approximation is
    taken at a mode, as after training; without weight decay it is overconfident on held-out
    data, as a network trained to a small loss is, which gives the prior search an optimum."""
    opt = torch.optim.LBFGS(head.parameters(), max_iter=60, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(head(features), labels) + weight_decay / 2 * sum(
            p.square().sum() for p in head.parameters()
        )
        loss.backward()
        return loss

    opt.step(closure)


@pytest.fixture(scope="package")
def digits_map():
    """A map_fixed model on 200 digits (100 for validation) whose head is fitted on the network's features."""
    torch.manual_seed(0)
    # the per-edge cell: the Laplace tests' scenarios (an interior optimum, the probit's other choice)
    # were found on this seed's random features, which the fused cell's initialisation draws in another order
    method = MAP(tiny_structure_net(cell="per_edge"), learn_structure=False, dataset_size=200).eval()
    dm = DigitsDataModule(num_workers=0, train_subset=200, val_size=100, batch_size=64, eval_batch_size=128)
    dm.setup("fit")
    network = FixedStructureNetwork.of(method)
    features, labels = head_features(network, in_memory_loader(dm, dm.train_set, train=False), dm.preprocess)
    _fit_head_by_logistic_regression(network.head, features, labels)
    return method, dm
