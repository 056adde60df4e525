"""Cyclical stochastic-gradient MCMC (Zhang et al., ICLR 2020): the cyclical step size and its
stages (`schedule`), cSGHMC / cSGLD as an optimiser (`sgmcmc`), and the samples a chain keeps,
carried by checkpoints (`samples`). Knows nothing of networks: tensors in, tensors out."""

from dbsn.sampling.samples import SampleSet
from dbsn.sampling.schedule import CyclicalSchedule
from dbsn.sampling.sgmcmc import CyclicalSampler, CyclicalSGMCMC

__all__ = ["CyclicalSGMCMC", "CyclicalSampler", "CyclicalSchedule", "SampleSet"]
