"""dbsn: Deep Bayesian Structure Networks on PyTorch Lightning + Hydra."""

__version__ = "0.1.0"
