"""docs/extending.md cannot rot: its files are copied into a package outside src/ and its commands
run on digits through train.py and evaluate.py (a method, a backbone, a dataset, a post-hoc
posterior, an evaluation and an OOD score, each only in that package)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.configs import ROOT
from tests.support.fakedata import write_image_folder
from tests.support.scripts import run_python

pytestmark = pytest.mark.slow


PAGE = ROOT / "docs" / "extending.md"
BLOCK = re.compile(r"^```\w+ file=(\S+)\n(.*?)^```$", re.S | re.M)


def page_files() -> dict[str, str]:
    """The page's files by path: every fenced block whose info string names a `file=`."""
    return {path: text for path, text in BLOCK.findall(PAGE.read_text())}


def test_the_page_names_a_file_for_each_door():
    files = page_files()
    assert {
        "myext/random_structures.py",
        "myext/small_cnn.py",
        "myext/image_folder.py",
        "myext/last_layer_noise.py",
        "myext/misclassification.py",
        "myext/class_cosine.py",
    } <= set(files)
    for kind in (
        "model/random_structures",
        "model/net/small_cnn",
        "data/image_folder",
        "posthoc/last_layer_noise",
        "evaluations/misclassification",
        "ood_score/class_cosine",
    ):
        assert f"myext/conf/{kind}.yaml" in files


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The page's package in a folder of its own, with an image folder of digits beside it."""
    where = tmp_path_factory.mktemp("user")
    for path, text in page_files().items():
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_text(text)
    (where / "myext" / "__init__.py").touch()
    write_image_folder(where / "images")
    return where


def run(package: Path, script: str, *overrides: str) -> subprocess.CompletedProcess:
    """`python <script> hydra.searchpath=[file://<package>/myext/conf] ...` with the package on PYTHONPATH."""
    return run_python(
        ROOT / script,
        f"hydra.searchpath=[file://{package}/myext/conf]",
        "trainer.enable_progress_bar=false",
        *overrides,
        cwd=package,
        env={"PYTHONPATH": str(package), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
    )


TINY_NET = ["model.net.num_nodes=3", "model.net.cells_per_stage=1", "model.net.growth=4", "model.net.stem_channels=8"]


def test_the_method_trains_and_predicts_with_random_structures(package):
    out = package / "random"
    run(
        package,
        "train.py",
        "model=random_structures",
        "data=digits",
        "trainer=cpu",
        "trainer.max_epochs=1",
        *TINY_NET,
        "model.train_samples=2",
        "model.prediction.n_samples=4",
        "model.prediction.samples_per_forward=2",
        "callbacks.structure_posterior.save_figures=false",
        f"hydra.run.dir={out}",
    )
    record = json.loads((out / "metrics.json").read_text())
    assert record["n_samples"] == 4 and 0 <= record["metrics"]["test/error"] < 0.9
    assert record["metrics"]["test/mutual_information"] > 0  # the members' structures differ
    assert "_target_: myext.random_structures.RandomStructures" in (out / "resolved_config.yaml").read_text()


@pytest.fixture(scope="module")
def backbone_run(package):
    """map_fixed on the page's backbone and dataset (the digits as an image folder)."""
    out = package / "cnn"
    run(
        package,
        "train.py",
        "model=map_fixed",
        "model/net=small_cnn",
        "model.net.width=8",
        "data=image_folder",
        f"data.root={package / 'images'}",
        "data.val_size=40",
        "trainer=cpu",
        "trainer.max_epochs=3",
        "data.batch_size=32",
        f"hydra.run.dir={out}",
    )
    return out


def test_the_backbone_and_the_dataset_train_a_baseline(backbone_run):
    record = json.loads((backbone_run / "metrics.json").read_text())
    assert record["metrics"]["test/error"] < 0.9  # better than chance on 10 classes after 3 epochs
    config = (backbone_run / "resolved_config.yaml").read_text()
    assert "myext.small_cnn.SmallCNN" in config and "myext.image_folder.ImageFolderDataModule" in config


def test_the_posterior_and_the_evaluation_run_through_evaluate_and_reach_the_report(package, backbone_run):
    run(
        package,
        "evaluate.py",
        f"ckpt_path={backbone_run / 'checkpoints' / 'last.ckpt'}",
        "posthoc=last_layer_noise",
        "posthoc.n_samples=5",
        "evaluations=[misclassification]",
        "trainer.accelerator=cpu",
    )
    folder = backbone_run / "posthoc" / "last_layer_noise"
    record = json.loads((folder / "metrics.json").read_text())
    assert record["posthoc"] == "last_layer_noise" and record["n_samples"] == 5
    assert record["metrics"]["test/mutual_information"] > 0  # noisy heads disagree
    summary = json.loads((folder / "evaluation" / "misclassification" / "summary.json").read_text())["metrics"]
    assert 0 <= summary["misclassification/predictive_entropy/auroc"] <= 1
    from dbsn.evaluation.report import build_report

    report = build_report([backbone_run], package / "report")
    assert {r.method for r in report.with_status("ok")} == {"map_fixed", "map_fixed+last_layer_noise"}
    text = (package / "report" / "report.md").read_text()
    assert "## Evaluation: misclassification" in text and "misclassification/predictive_entropy/auroc" in text


def test_the_ood_score_is_a_column_of_the_ood_evaluation(package, backbone_run):
    run(
        package,
        "evaluate.py",
        f"ckpt_path={backbone_run / 'checkpoints' / 'last.ckpt'}",
        "evaluations=[ood]",
        "ood=noise",
        "ood.noise.size=64",
        "ood_score=[energy,class_cosine]",
        "ablation.sizes=[]",
        "trainer.accelerator=cpu",
    )
    record = json.loads((backbone_run / "evaluation" / "ood" / "noise" / "metrics.json").read_text())
    assert list(record["scores"])[3:] == ["energy", "class_cosine"]  # after the predictive's own three
    assert record["computed_on"]["class_cosine"] == "members' mean feature"
    assert record["detection"]["scores"]["class_cosine"] == {
        "class": "myext.class_cosine.ClassCosine",
        "members": "pooled",
    }
    summary = json.loads((backbone_run / "evaluation" / "ood" / "summary.json").read_text())["metrics"]
    assert summary["ood/noise/class_cosine/auroc"] == record["scores"]["class_cosine"]["auroc"]
    assert summary["ood/noise/class_cosine/auroc"] > 0.5  # noise is far from every digit class


def test_an_unchosen_option_of_the_page_s_evaluation_is_refused_in_one_line(package, backbone_run):
    done = run_python(
        ROOT / "evaluate.py",
        f"hydra.searchpath=[file://{package}/myext/conf]",
        f"ckpt_path={backbone_run / 'checkpoints' / 'last.ckpt'}",
        "evaluations.misclassification.scores=[mutual_information]",
        cwd=package,
        env={"PYTHONPATH": str(package)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "add it to evaluations=[...]" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_calibrator_runs_through_evaluate_and_gets_its_column_in_the_report(package, backbone_run, tmp_path):
    import shutil

    from dbsn.evaluation.report import build_report

    assert {"myext/label_prior.py", "myext/conf/posthoc/label_prior.yaml"} <= set(page_files())
    copy = tmp_path / "run"  # a copy of the run: the report of the posterior's test sees that posterior alone
    shutil.copytree(backbone_run, copy, ignore=shutil.ignore_patterns("evaluation", "posthoc"))
    run(
        package,
        "evaluate.py",
        f"ckpt_path={copy / 'checkpoints' / 'last.ckpt'}",
        "posthoc=label_prior",
        "trainer.accelerator=cpu",
    )
    record = json.loads((copy / "posthoc" / "label_prior" / "metrics.json").read_text())
    assert record["posthoc"] == record["calibrator"] == "label_prior" and record["label_prior_smoothing"] == 1.0
    assert record["calibrator_examples"] == 40 and 0 <= record["calibrator_argmax_changed"] <= 1
    build_report([copy], tmp_path / "report")
    text = (tmp_path / "report" / "calibrators.md").read_text()
    assert "| method | none | label_prior |" in text and "| map_fixed |" in text
