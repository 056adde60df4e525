"""MAP (dbsn.methods.map): with a fixed structure, α is uniform and not trained."""

from __future__ import annotations

import torch

from dbsn.methods import MAP
from dbsn.nets import StructureNet


def test_map_fixed_alpha_is_uniform_and_not_trained():
    torch.manual_seed(0)
    net = StructureNet(num_classes=4, num_nodes=3, cells_per_stage=1, growth=4, stem_channels=8)
    method = MAP(net, learn_structure=False, dataset_size=10)
    assert torch.allclose(method.alpha(), torch.full((3, 4), 0.25))
    assert method.structure_parameters() == []
    assert not hasattr(method, "theta") and len(list(method.parameters())) == len(list(net.parameters()))
