"""Methods: LightningModules that join a network with a distribution and own loss and optimisers."""

from dbsn.methods.base import ClassificationMethod, NonFiniteLossError, StructureOptimizer, WeightOptimizer
from dbsn.methods.dbsn import DBSN

__all__ = ["ClassificationMethod", "DBSN", "NonFiniteLossError", "StructureOptimizer", "WeightOptimizer"]
