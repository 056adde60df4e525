"""A point-estimate method as a network with a fixed structure (dbsn.posthoc.fixed): the function
the post-hoc posteriors see.
"""

from __future__ import annotations

import torch

from dbsn.methods import MAP
from dbsn.posthoc.fixed import FixedStructureNetwork
from tests.support.netutil import tiny_structure_net


def test_the_method_sees_f_of_x_at_the_maps_structure(digits_map):
    """f(x) = net(x, α) is the method's own prediction, and the features φ(x) are the head's input."""
    method, dm = digits_map
    network = FixedStructureNetwork.of(method)
    x = dm.preprocess(dm.val_set.images[:6])
    with torch.no_grad():
        logits = network(x)
        features, same = network.features(x)
        torch.testing.assert_close(logits.log_softmax(-1), method.predict_log_probs(x))
        torch.testing.assert_close(same, logits)
        torch.testing.assert_close(network.head(features), logits)


def test_a_learned_structure_is_held_at_softmax_theta():
    """map: laplace-torch's f(x) uses α = softmax(θ), the structure MAP predicts with."""
    torch.manual_seed(1)
    method = MAP(tiny_structure_net(num_classes=4), dataset_size=10).eval()
    with torch.no_grad():
        method.theta.normal_()
    network = FixedStructureNetwork.of(method)
    torch.testing.assert_close(network.alpha[0], torch.softmax(method.theta, -1))
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(network(x).log_softmax(-1), method.predict_log_probs(x))
