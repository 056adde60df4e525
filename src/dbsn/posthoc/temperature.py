"""Temperature scaling as a post-hoc posterior (`posthoc=temperature`): the finished method with one
temperature fitted on the validation split (Guo et al., 2017; the scaler and its fit live with the
methods, `dbsn.methods.temperature`, because a method trained with `temperature_scaling=true` fits
and applies it too)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from dbsn.methods.base import Method
from dbsn.methods.temperature import require_validation
from dbsn.posthoc.base import PosthocError, PosthocPosterior, use_samples

__all__ = ["TemperatureScaling"]


class TemperatureScaling(PosthocPosterior):
    """Every prediction of the method (each member too, for the uncertainty decomposition)
    divided by one temperature T fitted by NLL on the validation split; S stays the method's
    unless `n_samples` says. Applies to every classifier, ensembles and Bayesian methods
    included (their log of averaged probabilities is scaled)."""

    name = "temperature"

    def why_not(self, method: Method, checkpoint: dict[str, Any]) -> str | None:
        if not method.task.keeps_test_outputs:
            return "posthoc=temperature is defined for classifiers; this is a segmentation model"
        return None

    def check(self, method: Method, datamodule, checkpoint: dict[str, Any]) -> None:
        if method.temperature_scaling:
            raise PosthocError("posthoc=temperature: this run already fitted a temperature (it trained with "
                               "temperature_scaling=true); evaluate it without posthoc")
        require_validation(datamodule)

    def fit(self, method: Method, datamodule, checkpoint: dict[str, Any], n_samples: int | None = None) -> Method:
        use_samples(method, n_samples)  # every method inside too: an ensemble's members
        datamodule.setup("fit")
        method.temperature_scaling = True
        temperature = method.fit_temperature(datamodule)
        Console().print(f"Temperature fitted on the validation split: T = {temperature:.4f}")
        return method
