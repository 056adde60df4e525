"""The structure distribution: the sharpened concrete posterior q(α | θ) over each edge's
operations, its uniform prior and the KL estimate (`concrete`), and the schedules of its
temperature τ and sharpening factor β (`schedules`). Knows nothing of networks."""

from dbsn.structure.concrete import SharpenedConcrete, StructureLogits, kl_estimate, uniform_prior

__all__ = ["SharpenedConcrete", "StructureLogits", "kl_estimate", "uniform_prior"]
