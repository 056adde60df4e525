"""Compose the real Hydra configs for tests, as train.py would, minus Hydra's runtime; small
model overrides; a method's optimisers as configured."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from dbsn import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]  # the repository: train.py, evaluate.py
CONF = CONF_DIR  # the package's config tree (src/dbsn/conf/)

# A tiny DBSN that trains in seconds on CPU.
TINY = [
    "model.net.num_nodes=3",
    "model.net.cells_per_stage=1",
    "model.net.growth=4",
    "model.net.stem_channels=8",
    "model.train_samples=2",
    "model.prediction.n_samples=4",
    "model.prediction.samples_per_forward=2",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "trainer.log_every_n_steps=1",
]


def tiny_for(model: str) -> list[str]:
    """TINY for `model=...`: T exists only where structures are sampled (dbsn, fbn); NEK-FAC's
    VGG16-BN is made tiny by width (and refreshes its Kronecker factors every 2 steps)."""
    tiny = [o for o in TINY if model in ("dbsn", "fbn") or not o.startswith("model.train_samples")]
    if model == "nekfac":
        tiny = [o for o in tiny if not o.startswith("model.net.")] + [
            "model.net.width=0.25",
            "model.nekfac.cov_update_every=2",
        ]
    return tiny


def compose_config(name: str, overrides: list[str], output_dir: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=[*overrides, f"paths.output_dir={output_dir}"])


# an in-process evaluation on the CPU without progress bars
QUIET = ["trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "~callbacks.progress_bar"]


def evaluate_quietly(ckpt, tmp_path: Path, extra=()) -> dict:
    """`evaluate.py ckpt_path=<ckpt> *extra` in this process (`dbsn.runtime.run.evaluate`), its
    Hydra folder under `tmp_path`."""
    from dbsn.runtime.run import evaluate

    cfg = compose_config("evaluate", [f"ckpt_path={ckpt}", *QUIET, *extra], tmp_path / "hydra")
    return evaluate(cfg, tmp_path / "hydra")


def evaluate_the_whole_suite(ckpt, out: Path, tmp_path: Path, extra=()) -> dict:
    """`evaluate_quietly` with OOD detection (every default score), dataset shift on generated
    corruptions, conformal sets and the adversarial attacks, all at test size (the post-hoc OOD scores
    on the first 2 members, the test images in batches of 256); asserts that each ran."""
    results = evaluate_quietly(
        ckpt,
        out,
        [
            *extra,
            "evaluations=[ood,shift,conformal,adversarial]",
            "ood=[photos,noise]",
            "ood.photos.size=32",
            "ood.noise.size=32",
            "evaluations.ood.fit_images=64",
            "evaluations.ood.members=2",
            "ood_score.knn.k=5",
            "batch_size=256",
            "ood_score.odin.batch_size=256",
            "statistics.resamples=100",
            f"evaluations.shift.root={tmp_path / 'digits-C'}",
            "evaluations.shift.generate=true",
            "evaluations.shift.corruptions=[gaussian_noise]",
            "evaluations.shift.severities=[3]",
            "evaluations.adversarial.epsilons=[0.0,0.1]",
            "evaluations.adversarial.attack_samples=2",
            "evaluations.adversarial.eval_samples=2",
            "evaluations.adversarial.max_examples=20",
            "evaluations.adversarial.batch_size=20",
            "evaluations.conformal.levels=[0.9]",
        ],
    )
    for score in ("max_logit", "energy", "mahalanobis", "gda", "knn", "vim", "odin"):
        assert 0 <= results[f"ood/noise/{score}/auroc"] <= 1, score
    assert 0 <= results["test/error"] <= 1 and results["adversarial/fgsm/accuracy@0.1"] <= 1
    assert any(key.startswith("shift/") for key in results) and any(key.startswith("conformal/") for key in results)
    return results


def small_model(model: str, *extra: str) -> list[str]:
    """`model=...` on a small network: 3 nodes and 3 cells (NEK-FAC: VGG16-BN at width 0.25)."""
    if model == "nekfac":
        return [f"model={model}", "model.net.width=0.25", *extra]
    prefix = "model.member.net" if model == "deep_ensemble" else "model.net"
    return [f"model={model}", f"{prefix}.num_nodes=3", f"{prefix}.cells_per_stage=1", *extra]


def configured_optimizers(model_cfg):
    """The method and what its configure_optimizers returns, under a stand-in trainer."""
    from types import SimpleNamespace

    from dbsn.runtime.build import build_model

    method = build_model(model_cfg, num_classes=10)
    method.dataset_size = 100  # read from the data module in on_fit_start (natgrad: in configure_optimizers)
    method._trainer = SimpleNamespace(max_epochs=4, world_size=1, precision="32-true", datamodule=None)
    optimizers, schedules = method.configure_optimizers()
    return method, optimizers, schedules
