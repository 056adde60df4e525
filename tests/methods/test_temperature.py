"""Temperature scaling (dbsn.methods.temperature): recovers a known miscalibration, leaves a
calibrated model alone, never looks at anything but the validation data it is given, and is
fitted in training and reloaded with the calibrated checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dbsn.data import DigitsDataModule
from dbsn.methods.temperature import NoValidationSplitError, TemperatureScaler, fit_temperature, require_validation
from dbsn.runtime.run import evaluate, train
from tests.support.configs import compose_config, tiny_for

NUM_CLASSES, DIM = 10, 8


def well_specified(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs x (n, DIM), their true logits x @ W (fixed W), and labels drawn from
    softmax(true logits): a model predicting the true logits is calibrated by construction."""
    weight = torch.randn(DIM, NUM_CLASSES, generator=torch.Generator().manual_seed(0)) * 0.6
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=generator)
    logits = x @ weight
    y = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
    return x, logits, y


def nll(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    return F.nll_loss(log_probs, y).item()


@pytest.mark.parametrize("scale", [5.0, 0.3])
def test_recovers_the_miscalibration_and_helps_on_held_out_data(scale):
    _, val_logits, val_y = well_specified(6000, seed=1)
    _, test_logits, test_y = well_specified(6000, seed=2)
    scaler = TemperatureScaler()
    temperature = scaler.fit(scale * val_logits, val_y)

    assert temperature == pytest.approx(scale, rel=0.1)
    assert scaler.temperature == temperature
    assert scaler.nll_after < scaler.nll_before
    assert scaler.nll_before == pytest.approx(nll((scale * val_logits).log_softmax(-1), val_y), rel=1e-5)
    assert scaler.nll_after == pytest.approx(nll(scaler(scale * val_logits), val_y), rel=1e-5)
    # The fitted temperature carries over to independent data from the same distribution.
    with torch.no_grad():
        assert nll(scaler(scale * test_logits), test_y) < nll((scale * test_logits).log_softmax(-1), test_y)


def test_calibrated_model_is_a_fixed_point():
    _, logits, y = well_specified(6000, seed=3)
    assert TemperatureScaler().fit(logits, y) == pytest.approx(1.0, rel=0.04)


def test_forward_is_log_softmax_of_scaled_logits_and_keeps_the_prediction():
    logits = torch.randn(7, 4, 5)
    scaler = TemperatureScaler(temperature=2.5)
    out = scaler(logits)
    torch.testing.assert_close(out, (logits / 2.5).log_softmax(-1))
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(7, 4))
    assert torch.equal(out.argmax(-1), logits.argmax(-1))
    # At T = 1 an ensemble's log of averaged probabilities passes through unchanged.
    log_mean_probs = torch.logsumexp(torch.randn(3, 6, 5).log_softmax(-1), dim=0) - math.log(3)
    torch.testing.assert_close(TemperatureScaler()(log_mean_probs), log_mean_probs)
    # log T is state (saved, loaded) but not a parameter an optimiser would pick up.
    assert list(scaler.parameters()) == []
    restored = TemperatureScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.temperature == pytest.approx(2.5)


def test_fit_is_deterministic_restarts_from_one_and_sends_no_gradient():
    _, logits, y = well_specified(2000, seed=4)
    logits = (3 * logits).requires_grad_()
    first = TemperatureScaler(temperature=7.0)
    t1 = first.fit(logits, y)
    t2 = first.fit(logits, y)  # a second fit starts from T = 1 again, not from t1
    t3 = TemperatureScaler().fit(logits, y)
    assert t1 == t2 == t3
    assert logits.grad is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_logits_raise(bad):
    logits = torch.randn(20, 3)
    logits[5, 1] = bad
    with pytest.raises(ValueError, match="non-finite"):
        TemperatureScaler().fit(logits, torch.zeros(20, dtype=torch.long))


def test_bad_shapes_and_labels_raise():
    scaler = TemperatureScaler()
    with pytest.raises(ValueError, match="targets must have shape"):
        scaler.fit(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="0..2"):
        scaler.fit(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="temperature"):
        TemperatureScaler(temperature=0.0)


class ForbiddenLoader:
    """A loader that fails the test if anything iterates it."""

    def __init__(self):
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        raise AssertionError("the test loader was iterated")


def test_fit_temperature_only_sees_the_validation_loader():
    x, _, y = well_specified(3000, seed=5)
    weight = torch.randn(DIM, NUM_CLASSES, generator=torch.Generator().manual_seed(0)) * 0.6
    val_batches = [(x[i : i + 500], y[i : i + 500]) for i in range(0, 3000, 500)]
    test_loader = ForbiddenLoader()
    seen = []

    def model_fn(inputs):
        seen.append(inputs)
        assert not torch.is_grad_enabled()
        return 5 * inputs @ weight

    scaler = fit_temperature(model_fn, val_batches, device="cpu")

    assert test_loader.iterations == 0
    assert torch.equal(torch.cat(seen), x)  # every validation input once, in order, and nothing else
    assert scaler.temperature == pytest.approx(5.0, rel=0.15)
    assert scaler.nll_after < scaler.nll_before


def test_fit_temperature_without_validation_batches_raises():
    with pytest.raises(NoValidationSplitError, match="held-out validation split"):
        fit_temperature(lambda x: x, [], device="cpu")


def test_require_validation_on_digits():
    with pytest.raises(NoValidationSplitError):  # known from the config alone, before setup
        require_validation(DigitsDataModule(val_size=0, num_workers=0))

    without = DigitsDataModule(val_size=0, num_workers=0)
    without.setup("fit")
    with pytest.raises(NoValidationSplitError) as error:
        require_validation(without)
    message = str(error.value)
    for part in ("val_size=0", "data.val_size=5000", "never fitted on the test set"):
        assert part in message
    assert isinstance(error.value, ValueError)

    rounds_to_zero = DigitsDataModule(val_size=1e-5, num_workers=0)
    rounds_to_zero.setup("fit")
    with pytest.raises(NoValidationSplitError, match="empty"):
        require_validation(rounds_to_zero)

    with_val = DigitsDataModule(val_size=100, num_workers=0)
    with_val.setup("fit")
    require_validation(with_val)
    assert len(with_val.val_set) == 100


# ---------------------------------------------------------------------- fitted in training (model.prediction.temperature_scaling)


def _digits_overrides(*extra):
    return [
        "model=map_fixed",
        "data=digits",
        "data.batch_size=128",
        *tiny_for("map_fixed"),
        "trainer.max_epochs=1",
        "model.prediction.temperature_scaling=true",
        *extra,
    ]


def test_temperature_scaling_refuses_without_a_validation_split(tmp_path):
    from dbsn.methods.temperature import NoValidationSplitError

    cfg = compose_config("train", _digits_overrides("data.val_size=0"), tmp_path)
    with pytest.raises(NoValidationSplitError, match="val_size"):
        train(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # refused before any training


@pytest.mark.slow
def test_temperature_scaling_fits_on_validation_and_is_reloaded(tmp_path, monkeypatch):
    from dbsn.data import DigitsDataModule

    test_batches = []
    original = DigitsDataModule.test_dataloader
    monkeypatch.setattr(DigitsDataModule, "test_dataloader", lambda self: test_batches.append(1) or original(self))
    cfg = compose_config("train", _digits_overrides("data.val_size=200"), tmp_path)
    metrics = train(cfg, tmp_path)
    assert len(test_batches) == 1  # the test split was only touched by the final test
    state = torch.load(tmp_path / "checkpoints" / "calibrated.ckpt", weights_only=False)["state_dict"]
    temperature = float(state["temperature.log_temperature"].exp())
    assert temperature != pytest.approx(1.0, abs=1e-3)

    eval_dir = tmp_path / "eval"
    cfg = compose_config(
        "evaluate", [f"ckpt_path={tmp_path / 'checkpoints' / 'calibrated.ckpt'}", "trainer.accelerator=cpu"], eval_dir
    )
    assert evaluate(cfg, eval_dir)["test/nll"] == pytest.approx(metrics["test/nll"], rel=1e-5)
