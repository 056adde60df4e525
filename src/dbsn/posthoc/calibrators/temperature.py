"""Temperature scaling (Guo et al., ICML 2017), `posthoc=temperature`: the predictive log-probabilities
divided by one temperature T > 0 fitted by NLL on the validation split, softmax again. For an
ensemble or a Bayesian method the input is the log of the averaged probabilities. The scaler and
its fit are `dbsn.methods.temperature.TemperatureScaler`, the one a run trained with
`model.prediction.temperature_scaling=true` fits and applies itself; here it is one calibrator
among the others. Never changes the predicted class.
"""

from __future__ import annotations

from torch import Tensor

from dbsn.methods.temperature import TemperatureScaler
from dbsn.posthoc.calibrators.base import Calibrator

__all__ = ["TemperatureScaling"]


class TemperatureScaling(Calibrator):
    """log_softmax(log p / T), T fitted by L-BFGS on the validation NLL from T = 1
    (`TemperatureScaler.fit`). Applied in the predictive's own dtype, as a run's own temperature is."""

    name = "temperature"
    preserves_argmax = True

    def __init__(self) -> None:
        super().__init__()
        self.scaler = TemperatureScaler()

    def forward(self, log_probs: Tensor) -> Tensor:
        return self.scaler(log_probs)

    def transform(self, log_probs: Tensor) -> Tensor:
        return self.scaler(log_probs)

    def fit_map(self, log_probs: Tensor, targets: Tensor) -> None:
        self.scaler.fit(log_probs, targets)

    def label(self) -> str:
        return f"Temperature scaling (T = {self.scaler.temperature:.4f})"

    def settings(self) -> dict:
        return {"calibrator_temperature": self.scaler.temperature}
