"""model.execution.channels_last=true: the same numbers as the contiguous layout, and every convolution
really sees channels-last input (no silent conversion back to NCHW inside the network).

Compared: one training step's loss, every gradient (θ's included) and the BatchNorm running
statistics, with T structures grouped and in chunks, and the Bayes ensemble's members. Methods
with point weights: stochastic weights draw their noise in memory order, so the same seed gives
other (equally valid) noise in another layout.
"""

from __future__ import annotations

import pytest
import torch
from steputil import assert_same, prediction, step_state
from torch import nn

from dbsn.methods import DBSN, MAP, Execution, Prediction
from dbsn.methods.tasks import Segmentation
from dbsn.nets import DBSNSegNet, FCDenseNet, StructureNet
from dbsn.nets.ops import memory_format

TINY_NET = dict(num_classes=5, num_nodes=3, cells_per_stage=2, num_stages=2, growth=4, stem_channels=8)


def _pair(make):
    """The same method (same initial weights and θ) built twice: contiguous and channels-last."""
    torch.manual_seed(3)
    plain = make(False)
    torch.manual_seed(3)
    last = make(True)
    last.load_state_dict(plain.state_dict())
    return plain, last


def _non_channels_last_conv_inputs(method, run) -> list[str]:
    """Names of the convolutions that received an input not laid out channels-last."""
    seen: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: seen.append(name) if memory_format(args[0])
                                         != torch.channels_last and min(args[0].shape[-2:]) > 1 else None)
             for name, m in method.net.named_modules() if isinstance(m, nn.Conv2d)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


CLASSIFIERS = {
    "dbsn_grouped": lambda cl: DBSN(StructureNet(**TINY_NET), train_samples=3, prediction=Prediction(n_samples=4, samples_per_forward=3),
                                    dataset_size=50, theta_init_std=1.0, execution=Execution(channels_last=cl)),
    "dbsn_chunked": lambda cl: DBSN(StructureNet(**TINY_NET), train_samples=3, prediction=Prediction(n_samples=4, samples_per_forward=3),
                                    dataset_size=50, theta_init_std=1.0, train_samples_per_forward=2,
                                    execution=Execution(channels_last=cl)),
    "map": lambda cl: MAP(StructureNet(**TINY_NET), learn_structure=True, theta_init_std=1.0, dataset_size=50,
                          execution=Execution(channels_last=cl)),
    "map_fixed": lambda cl: MAP(StructureNet(**TINY_NET), learn_structure=False, dataset_size=50,
                                execution=Execution(channels_last=cl)),
}


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_channels_last_step_and_prediction_equal_the_contiguous_layout(name):
    plain, last = _pair(CLASSIFIERS[name])
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    reference = step_state(plain, x, y)
    kinds = assert_same(reference, step_state(last, x, y), rtol=1e-4, atol=1e-5)
    assert kinds["weight gradients"] > 20 and kinds["running statistics"] > 10
    assert kinds["theta gradient"] == (0 if name == "map_fixed" else 1)
    torch.testing.assert_close(prediction(last, x, 4), prediction(plain, x, 4), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["dbsn_grouped", "dbsn_chunked"])
def test_every_convolution_runs_channels_last(name):
    _, last = _pair(CLASSIFIERS[name])
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
    assert _non_channels_last_conv_inputs(last, lambda: step_state(last, x, y)) == []
    assert _non_channels_last_conv_inputs(last, lambda: prediction(last, x, 4)) == []
    plain, _ = _pair(CLASSIFIERS[name])  # the check sees a contiguous network
    assert len(_non_channels_last_conv_inputs(plain, lambda: step_state(plain, x, y))) > 20


SEGMENTERS = {
    "fcdensenet": lambda cl: MAP(FCDenseNet(num_classes=5, first_channels=8, growth=4, layers_per_block=2, num_down=2),
                                 learn_structure=False, dataset_size=20, task=Segmentation(ignore_index=4),
                                 execution=Execution(channels_last=cl)),
    "dbsn_seg": lambda cl: DBSN(DBSNSegNet(num_classes=5, first_channels=8, growth=4, num_down=2, num_nodes=3),
                                train_samples=2, prediction=Prediction(n_samples=2, samples_per_forward=2), dataset_size=20,
                                theta_init_std=1.0, task=Segmentation(ignore_index=4), execution=Execution(channels_last=cl)),
}


@pytest.mark.parametrize("name", list(SEGMENTERS))
def test_segmentation_networks_equal_in_channels_last(name):
    plain, last = _pair(SEGMENTERS[name])
    for method in (plain, last):  # no dropout noise: deterministic forwards in both layouts
        for m in method.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 20, 24), torch.randint(0, 5, (2, 20, 24))
    kinds = assert_same(step_state(plain, x, y), step_state(last, x, y), rtol=1e-4, atol=1e-5)
    assert kinds["weight gradients"] > 20
    assert _non_channels_last_conv_inputs(last, lambda: step_state(last, x, y)) == []
