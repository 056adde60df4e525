"""The tutorials' commands exist: every `python train.py` / `python evaluate.py` line of docs/tutorials/
composes from dbsn's configs (the config names and keys it sets are real), every option of a
`dbsn-compare` / `dbsn-report` line is one of the command's, and the extension package's files are the
ones the tests install. (docs/tutorials/score-predictions.md runs in tests/docs/test_python_api.py.)"""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest
from hydra import compose, initialize_config_dir

from dbsn import CONF_DIR
from tests.support.configs import ROOT

TUTORIALS = ROOT / "docs" / "tutorials"
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```$", re.S | re.M)


def commands(*programs: str) -> list[tuple[str, list[str]]]:
    """(page, words) of every command line in the tutorials' bash blocks that starts with one of `programs`."""
    found = []
    for page in sorted(TUTORIALS.glob("*.md")):
        for kind, block in FENCE.findall(page.read_text()):
            if kind != "bash":
                continue
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                words = shlex.split(line.split("  #")[0])
                if words and " ".join(words[:2]).startswith(programs):
                    found.append((page.name, words))
    return found


def composed(words: list[str]):
    """Hydra's composition of `python train.py|evaluate.py <overrides>`, a sweep at its first value."""
    overrides = [w.replace("<date>", "2026-01-01_00-00-00") for w in words[2:] if w != "-m"]
    overrides = [re.sub(r"^(seed=[^,]+),.*$", r"\1", w) for w in overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=words[1].removesuffix(".py"), overrides=overrides, return_hydra_config=True)


def test_every_train_and_evaluate_command_composes():
    lines = commands("python train.py", "python evaluate.py")
    assert len(lines) >= 10 and {page for page, _ in lines} >= {"reproduce.md"}
    for page, words in lines:
        cfg = composed(words)  # an unknown config name or key raises here
        assert cfg.hydra.job is not None, (page, words)
    slurm = [composed(words) for _, words in lines if "hydra/launcher=slurm" in words]
    assert slurm and all(cfg.hydra.launcher.partition == "gpu" for cfg in slurm)


def test_a_misspelled_override_does_not_compose():
    with pytest.raises(Exception, match="download_all"):
        composed(["python", "train.py", "experiment=cifar10_paper", "data.download_all=true"])


def _help(main) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return out.getvalue()


def test_every_option_of_a_compare_or_report_line_is_the_command_s():
    from dbsn.tools import compare, report

    helps = {"dbsn-compare": _help(compare.main), "dbsn-report": _help(report.main)}
    lines = commands("dbsn-compare", "dbsn-report")
    assert {words[0] for _, words in lines} == set(helps)
    for page, words in lines:
        for option in (w.split("=")[0] for w in words if w.startswith("--")):
            assert option in helps[words[0]], (page, option)
    methods = {m for _, words in lines if "--methods" in words for m in words[words.index("--methods") + 1].split(",")}
    assert "random_structures" in methods  # docs/extending.md's method, by name
    assert methods - {"random_structures"} <= set(compare.compared_methods())


def test_the_extension_package_is_the_one_the_tests_install():
    from tests.tools.test_extension_package import PYPROJECT

    blocks = dict((kind, block) for kind, block in FENCE.findall((TUTORIALS / "compare-a-method.md").read_text()))
    assert blocks["toml"] == PYPROJECT
    extending = (ROOT / "docs" / "extending.md").read_text()
    assert (
        "check_method(RandomStructures, train_samples=2)" in extending
        and "check_method(RandomStructures, train_samples=2)" in blocks["python"]
    )
