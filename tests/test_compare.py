"""The all-methods comparison on digits runs end to end and tabulates every method."""

from __future__ import annotations

import json

import pytest

from configs import compose_config

from dbsn.compare import METHODS, main, method_overrides, run_comparison
from dbsn.config import validate_config


def test_each_method_gets_its_schedule_compression_and_valid_overrides(tmp_path):
    for method in METHODS:
        overrides = method_overrides(method, epochs=10, steps_per_epoch=21)
        has_tau = any(o.startswith("model.tau.decay=") for o in overrides)
        assert has_tau == (method in ("dbsn", "fbn", "vogn_fbn"))
        warmup = [o for o in overrides if o.startswith("model.vogn.kl_warmup_steps=")]
        assert warmup == (["model.vogn.kl_warmup_steps=21"] if method.startswith("vogn") else [])  # 10 % of 210
        validate_config(compose_config("train", overrides, tmp_path))  # every key exists for that method
    tau = next(o for o in method_overrides("dbsn", 10, 21) if o.startswith("model.tau.decay="))
    assert abs(3.0 * 2.718281828 ** (-float(tau.split("=")[1]) * 210) - 1.0) < 1e-3  # tau hits 1 at the end


def test_unknown_method_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["--methods", "dbsn,vgon"])
    assert "unknown method(s) ['vgon']" in capsys.readouterr().err


@pytest.mark.slow
def test_comparison_runs_every_method(tmp_path):
    results = run_comparison(METHODS, epochs=1, output_dir=tmp_path, n_samples=3,
                             extra=["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                                    "trainer.limit_train_batches=2", "trainer.limit_test_batches=1"],
                             net_overrides=["num_nodes=3", "growth=4", "stem_channels=8"])
    assert list(results) == list(METHODS)
    table = (tmp_path / "comparison.md").read_text()
    for method in METHODS:
        assert f"| {method} |" in table
        assert {"test/error", "test/nll", "test/ece"} <= set(results[method])
        assert results[method]["train_seconds"] > 0
    assert json.loads((tmp_path / "comparison.json").read_text())["results"] == results
