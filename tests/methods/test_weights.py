"""Weight posteriors (dbsn.methods.weights): MC dropout's placements, its test-time noise, and the
mc_dropout config's default.
"""

from __future__ import annotations

import pytest
import torch

from dbsn.methods import MAP, MCDropoutWeights, Prediction
from dbsn.nets import StructureNet
from tests.support.configs import compose_config, small_model


def _dropout_net(p=0.2, test_time=True, placement="node_outputs"):
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    return MAP(
        net,
        weights=MCDropoutWeights(p=p, test_time=test_time, placement=placement),
        learn_structure=False,
        prediction=Prediction(n_samples=5, samples_per_forward=5),
        dataset_size=10,
    )


def test_mc_dropout_inserts_dropout_after_every_convolution():
    method = _dropout_net(placement="every_conv")
    convs = [m for m in method.net.modules() if isinstance(m, torch.nn.Conv2d)]
    dropouts = [m for m in method.net.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(convs) == len(dropouts) > 10
    for m in method.net.modules():
        if isinstance(m, torch.nn.Sequential) and len(m) == 2 and isinstance(m[0], torch.nn.Conv2d):
            assert isinstance(m[1], torch.nn.Dropout) and m[1].p == 0.2


def test_mc_dropout_is_stochastic_at_test_and_deterministic_without_it():
    x = torch.randn(3, 3, 16, 16)
    method = _dropout_net()
    method.eval()
    method.weights.enable_test_noise(method.net)  # what on_test_model_eval adds to eval()
    with torch.no_grad():
        members = method.stochastic_forward(x, 5)
        assert not torch.allclose(members[0], members[1])  # each member its own masks
        assert not torch.allclose(method.predict_log_probs(x), method.predict_log_probs(x))

    method = _dropout_net(test_time=False)
    assert not method.is_stochastic
    method.eval()
    method.weights.enable_test_noise(method.net)
    with torch.no_grad():
        first, second = method.predict_log_probs(x), method.predict_log_probs(x)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_mc_dropout_existing_placement_reuses_the_networks_dropout_layers():
    from torch import nn

    from dbsn.methods import MCDropoutWeights

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5), nn.Conv2d(4, 4, 3))
    prepared = MCDropoutWeights(p=0.2, placement="existing").prepare(net)
    dropouts = [m for m in prepared.modules() if isinstance(m, nn.Dropout)]
    assert len(dropouts) == 1 and dropouts[0].p == 0.2  # none inserted, the rate set
    with pytest.raises(ValueError, match="no dropout layers"):
        MCDropoutWeights(placement="existing").prepare(nn.Sequential(nn.Conv2d(3, 4, 3)))
    with pytest.raises(ValueError, match="placement"):
        MCDropoutWeights(placement="nodes")


def test_mc_dropout_node_outputs_placement_puts_dropout_on_every_cell():
    from torch import nn

    from dbsn.methods import MCDropoutWeights
    from dbsn.nets import StructureNet
    from dbsn.nets.cell import CellBase as Cell

    torch.manual_seed(0)
    net = StructureNet(5, num_nodes=3, cells_per_stage=2, growth=4, stem_channels=8)
    weights = MCDropoutWeights(p=0.3, placement="node_outputs")
    weights.prepare(net)
    cells = [m for m in net.modules() if isinstance(m, Cell)]
    dropouts = [m for m in net.modules() if isinstance(m, nn.Dropout)]
    assert len(cells) == 6 and all(isinstance(c.node_output, nn.Dropout) and c.node_output.p == 0.3 for c in cells)
    assert len(dropouts) == 6  # nothing after the convolutions
    x, alpha = torch.randn(4, 3, 16, 16), torch.full((1, net.num_edges, net.num_ops), 1 / net.num_ops)
    net.eval()
    with torch.no_grad():
        deterministic = net(x, alpha)
        weights.enable_test_noise(net)  # MC dropout: kept on at test time
        assert not torch.allclose(net(x, alpha), deterministic)
    with pytest.raises(ValueError, match="no cells"):
        MCDropoutWeights(placement="node_outputs").prepare(nn.Sequential(nn.Conv2d(3, 4, 3)))


def _dropout_calls(method, x):
    """Dropout modules of the network and how often each ran in one forward of x."""
    calls = {}
    dropouts = [m for m in method.net.modules() if isinstance(m, torch.nn.Dropout)]
    hooks = [m.register_forward_hook(lambda m, i, o: calls.__setitem__(m, calls.get(m, 0) + 1)) for m in dropouts]
    with torch.no_grad():
        method.net(x, method.prediction_structures(1))
    for h in hooks:
        h.remove()
    return dropouts, calls


def test_mc_dropout_default_is_map_with_dropout_on_every_node_output(tmp_path):
    """The research code's baseline, which produced the paper's numbers: learned θ, dropout on
    each node's output (once per node and cell), none inside the ops."""
    from dbsn.nets.cell import CellBase as Cell
    from dbsn.runtime.build import build_model

    cfg = compose_config("train", small_model("mc_dropout"), tmp_path)
    method = build_model(cfg.model, num_classes=10)
    assert method.learn_structure and method.structure_parameters() == [method.theta] and method.is_stochastic
    cells = [m for m in method.net.modules() if isinstance(m, Cell)]
    dropouts, calls = _dropout_calls(method, torch.randn(2, 3, 16, 16))
    assert len(cells) == 3 and {id(d) for d in dropouts} == {id(c.node_output) for c in cells}
    assert all(d.p == 0.2 for d in dropouts)
    assert [calls[c.node_output] for c in cells] == [c.num_nodes for c in cells] == [3, 3, 3]

    # the paper's text: after every convolution, four times inside each separable op
    method = build_model(
        compose_config("train", small_model("mc_dropout", "model.weights.placement=every_conv"), tmp_path).model,
        num_classes=10,
    )
    convs = [m for m in method.net.modules() if isinstance(m, torch.nn.Conv2d)]
    dropouts = [m for m in method.net.modules() if isinstance(m, torch.nn.Dropout)]
    wrapped = [
        m
        for m in method.net.modules()
        if isinstance(m, torch.nn.Sequential)
        and len(m) == 2
        and isinstance(m[0], torch.nn.Conv2d)
        and isinstance(m[1], torch.nn.Dropout)
    ]
    assert len(convs) == len(dropouts) == len(wrapped) > 10 and method.learn_structure
    assert all(isinstance(c.node_output, torch.nn.Identity) for c in method.net.modules() if isinstance(c, Cell))
    # the segmentation baseline keeps the FC-DenseNet's own dropout layers
    assert compose_config("train", ["model=fcdensenet67_mc_dropout"], tmp_path).model.weights.placement == "existing"
