"""evaluate.py's inputs (dbsn.runtime.evaluation): the evaluations and OOD sets built from the
config; an evaluation checks every input before its first expensive step, downloads what it is
told to, and never writes into a file it did not create: the training run's files stay as they
were in every layout evaluate.py writes (a run's checkpoint, a list, a sweep, a post-hoc
posterior, output_dir).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dbsn.data.base import DatasetNotFoundError
from dbsn.evaluation.base import EvaluationError
from dbsn.runtime.config import ConfigError
from dbsn.runtime.evaluation import build_evaluator
from dbsn.runtime.run import train
from tests.support.configs import compose_config, evaluate_quietly, tiny_for
from tests.support.fakedata import dtd_images, write_dtd


def _ood_sets(cfg):
    return build_evaluator(cfg).evaluations[0].sets


def test_one_or_several_ood_sets_compose_by_name(tmp_path):
    one = compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=photos"], tmp_path)
    assert list(one.ood) == ["photos"] and list(_ood_sets(one)) == ["photos"]
    several = compose_config(
        "evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=[svhn,photos,noise]", "ood.noise.size=8"], tmp_path
    )
    sets = _ood_sets(several)
    assert list(sets) == ["svhn", "photos", "noise"] and sets["noise"].size == 8
    assert type(sets["svhn"]).__name__ == "SVHNDataModule"
    with pytest.raises(ConfigError, match=r"add evaluations=\[ood\]"):  # sets chosen, the evaluation not
        build_evaluator(compose_config("evaluate", ["ckpt_path=x", "ood=photos"], tmp_path))
    with pytest.raises(
        ConfigError, match=r"ood.noise: size must be >= 1, got 0"
    ):  # a set's own check, named by its key
        build_evaluator(
            compose_config("evaluate", ["ckpt_path=x", "evaluations=[ood]", "ood=noise", "ood.noise.size=0"], tmp_path)
        )
    for name in ("noise", "photos"):  # an impossible size: refused before anything is made, naming the memory
        with pytest.raises(
            ConfigError, match=rf"ood.{name}: size=100,000,000 needs about 1,536.0 GB .* choose a size up to"
        ):
            build_evaluator(
                compose_config(
                    "evaluate",
                    ["ckpt_path=x", "evaluations=[ood]", f"ood={name}", f"ood.{name}.size=100000000"],
                    tmp_path,
                )
            )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A folder of two finished runs: map_fixed with a validation split, and DBSN."""
    root = tmp_path_factory.mktemp("sweep")
    for name, model in (("0", "map_fixed"), ("1", "dbsn")):
        overrides = [
            "data=digits",
            "data.num_workers=0",
            "data.val_size=100",
            "data.train_subset=300",
            f"model={model}",
            *tiny_for(model),
            "trainer.max_epochs=1",
            "logger=csv",
        ]
        train(compose_config("train", overrides, root / name), root / name)
    return root


def checkpoint(run: Path) -> Path:
    return run / "checkpoints" / "last.ckpt"


def fingerprint(folder: Path, skip=("evaluation", "posthoc")) -> dict[str, str]:
    """Every file below `folder` but the evaluations' own folders, by path: its content's hash."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not set(p.relative_to(folder).parts[:1]) & set(skip)
    }


@pytest.mark.slow
def test_no_evaluation_writes_into_a_file_it_did_not_create(sweep, tmp_path):
    runs = [sweep / "0", sweep / "1"]
    before = {run: fingerprint(run) for run in runs}
    quick = ["n_samples=2"]
    evaluate_quietly(checkpoint(runs[0]), tmp_path / "a", quick)  # <run>/evaluation
    evaluate_quietly(checkpoint(runs[0]), tmp_path / "b", [*quick, "posthoc=temperature"])  # <run>/posthoc/temperature
    evaluate_quietly(f"[{checkpoint(runs[0])},{checkpoint(runs[0])}]", tmp_path / "c", quick)  # a list: Hydra's folder
    evaluate_quietly(sweep, tmp_path / "d", [*quick, "posthoc=temperature"])  # a sweep, again: replaced
    evaluate_quietly(checkpoint(runs[1]), tmp_path / "e", [*quick, f"output_dir={tmp_path / 'elsewhere'}"])
    for run in runs:
        assert fingerprint(run) == before[run], run  # the training runs' own files: untouched
    assert (tmp_path / "c" / "hydra" / "metrics.json").is_file() and (tmp_path / "elsewhere" / "metrics.json").is_file()
    posthoc = json.loads((runs[1] / "posthoc" / "temperature" / "metrics.json").read_text())
    assert posthoc["posthoc"] == "temperature"
    # folders an evaluation did not make, or made for another posterior, are refused before anything runs
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    for output_dir, extra, phrase in (
        (runs[0], [], "is a training run's folder"),
        (tmp_path / "notes", [], "holds files that no evaluation wrote"),
        (runs[0] / "evaluation", ["posthoc=temperature"], "another evaluation"),
    ):
        with pytest.raises(ConfigError, match=phrase):
            evaluate_quietly(checkpoint(runs[0]), tmp_path / "f", [*quick, *extra, f"output_dir={output_dir}"])
    for run in runs:
        assert fingerprint(run) == before[run], run


@pytest.mark.slow
def test_missing_ood_files_and_a_set_too_small_are_found_before_the_test_pass(sweep, tmp_path):
    run = sweep / "0"
    evaluate_quietly(checkpoint(run), tmp_path / "first", ["n_samples=2"])
    written = (run / "evaluation" / "metrics.json").stat().st_mtime_ns
    with pytest.raises(DatasetNotFoundError, match="ood.textures.download=true"):
        evaluate_quietly(
            checkpoint(run), tmp_path, ["evaluations=[ood]", "ood=textures", f"ood.textures.root={tmp_path}"]
        )
    write_dtd(tmp_path / "dtd_root", dtd_images())
    with pytest.raises(EvaluationError, match=r"ood.textures: ood.textures.size=1000 but .* has \d+ images"):
        evaluate_quietly(
            checkpoint(run),
            tmp_path,
            [
                "evaluations=[ood]",
                "ood=textures",
                f"ood.textures.root={tmp_path / 'dtd_root'}",
                "ood.textures.size=1000",
            ],
        )
    assert (run / "evaluation" / "metrics.json").stat().st_mtime_ns == written  # no test pass ran


@pytest.mark.slow
def test_ood_download_true_downloads_the_set(sweep, tmp_path, monkeypatch):
    """`ood.<set>.download=true` fetches the set before it is read (here a stand-in for torchvision's
    download that writes the files in the set's on-disk layout)."""
    from dbsn.data.ood_sets import TexturesDataModule

    fetched = []

    def stand_in(self):
        fetched.append(self.root)
        write_dtd(self.root, dtd_images())

    monkeypatch.setattr(TexturesDataModule, "download_files", stand_in)
    results = evaluate_quietly(
        checkpoint(sweep / "0"),
        tmp_path,
        [
            "n_samples=2",
            "evaluations=[ood]",
            "ood=textures",
            f"ood.textures.root={tmp_path / 'data'}",
            "ood.textures.download=true",
            f"output_dir={tmp_path / 'out'}",
        ],
    )
    assert fetched == [tmp_path / "data"] and 0 <= results["ood/textures/entropy/auroc"] <= 1


@pytest.mark.slow
def test_a_posterior_that_does_not_apply_is_refused_before_anything_is_fitted(sweep, tmp_path):
    with pytest.raises(
        ConfigError, match="posthoc=laplace works on a point-estimate classifier.*this checkpoint is DBSN"
    ):
        evaluate_quietly(checkpoint(sweep / "1"), tmp_path, ["posthoc=laplace"])
    assert not (sweep / "1" / "posthoc" / "laplace").exists()
    # in a sweep the runs it does not apply to are skipped, the others evaluated
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("evaluation", "posthoc", "report"))
    evaluate_quietly(copy, tmp_path / "hydra", ["posthoc=laplace", "n_samples=2"])
    assert (copy / "0" / "posthoc" / "laplace" / "metrics.json").is_file() and not (
        copy / "1" / "posthoc" / "laplace"
    ).exists()


def test_a_posthoc_given_by_value_is_refused_naming_every_posterior_of_conf():
    from omegaconf import OmegaConf

    from dbsn.runtime.config import CONF_DIR, ConfigError
    from dbsn.runtime.evaluation import build_posterior

    with pytest.raises(ConfigError) as refused:
        build_posterior(OmegaConf.create({"posthoc": "x"}))
    names = sorted(path.stem for path in (CONF_DIR / "posthoc").glob("*.yaml"))
    assert "snapshot_ensemble" in names and f"lists them: {', '.join(names)})" in str(refused.value)


@pytest.mark.slow
def test_the_freed_host_memory_goes_back_after_the_test_pass_and_each_evaluation(sweep, tmp_path, monkeypatch):
    """evaluate.py hands what each step freed back to the system (`release_freed_memory`, glibc's
    malloc_trim) after the test pass and after each evaluation, so that the next step does not start
    on top of the heap the earlier ones kept."""
    import dbsn.runtime.evaluation as runtime_evaluation
    import dbsn.runtime.memory as memory

    steps = []
    monkeypatch.setattr(
        runtime_evaluation,
        "release_freed_memory",
        lambda: steps.append(sorted(p.name for p in (tmp_path / "hydra").iterdir())) or memory.release_freed_memory(),
    )
    evaluate_quietly(
        checkpoint(sweep / "0"),
        tmp_path,
        [
            "n_samples=2",
            "ablation.sizes=[]",
            "evaluations=[ood,conformal]",
            "ood=noise",
            "ood.noise.size=16",
            "evaluations.ood.members=1",
            f"output_dir={tmp_path / 'hydra'}",
        ],
    )
    assert len(steps) == 3  # the test pass, ood, conformal
    assert "metrics.json" in steps[0] and "ood" not in steps[0]
    assert "ood" in steps[1] and "conformal" not in steps[1] and "conformal" in steps[2]


def test_the_evaluation_s_forward_bounds_reach_every_member_of_an_ensemble():
    from omegaconf import OmegaConf

    from dbsn.methods import MAP, DeepEnsemble, Prediction
    from dbsn.nets import StructureNet
    from dbsn.runtime.evaluation import apply_overrides, check_prediction_overrides

    net = dict(num_classes=3, num_nodes=2, cells_per_stage=1, num_stages=1, growth=4, stem_channels=4)
    members = [
        MAP(StructureNet(**net), learn_structure=False, prediction=Prediction(samples_per_forward=2)) for _ in range(2)
    ]
    ensemble = DeepEnsemble(members)
    apply_overrides(ensemble, OmegaConf.create({"samples_per_forward": 3, "rows_per_forward": 16}))
    assert [(m.samples_per_forward, m.prediction.rows_per_forward) for m in members] == [(3, 16), (3, 16)]
    apply_overrides(ensemble, OmegaConf.create({"rows_per_forward": None}))  # null: as in the run
    assert [m.prediction.rows_per_forward for m in members] == [16, 16]
    for key in ("rows_per_forward", "samples_per_forward", "n_samples"):
        with pytest.raises(ConfigError, match=f"^{key} must be >= 1"):
            check_prediction_overrides(OmegaConf.create({key: 0}))
