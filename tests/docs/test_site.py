"""The documentation site (`make docs`): mkdocs.yml builds in strict mode, with the API reference rendered
from the docstrings, and a strict build fails on a broken link, a broken anchor, a reference to an object
that does not exist and a docstring that does not parse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.configs import ROOT

for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
    pytest.importorskip(module, reason="the docs extra is not installed (pip install -e '.[docs]'; dev installs it)")

CONFIG = ROOT / "mkdocs.yml"


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=config.parent,
    )


def test_the_site_builds_strict_with_the_api_reference(tmp_path):
    done = _build(CONFIG, tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "WARNING" not in done.stderr
    page = (tmp_path / "site" / "reference" / "stats" / "index.html").read_text()
    for name in ("metric_intervals", "ce2_paired_test", "seed_level"):  # rendered from dbsn.api.stats' docstrings
        assert f'id="dbsn.api.stats.{name}"' in page
    assert 'id="dbsn.testing.check_method"' in (tmp_path / "site" / "reference" / "testing" / "index.html").read_text()
    extending = (tmp_path / "site" / "extending" / "index.html").read_text()
    assert '<span class="filename">myext/random_structures.py</span>' in extending  # a file= fence, titled
    assert "<p>```" not in extending
    for tutorial in ("reproduce", "compare-a-method", "score-predictions"):
        assert (tmp_path / "site" / "tutorials" / tutorial / "index.html").is_file()


def test_make_docs_builds_strict():
    target = (ROOT / "Makefile").read_text().split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "$(STAMP)" in target and "mkdocs build --strict" in target


BROKEN = {
    "link": "See [a page that is not there](missing.md).\n",
    "anchor": "## A heading\n\nSee [a heading that is not there](#no-such-heading).\n",
    "reference": "::: dbsn.api.stats.no_such_function\n",
    "docstring": "::: brokendoc\n",
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_a_strict_build_fails_on(fault, tmp_path):
    """The site's own settings (mkdocs.yml without its nav) on one page that holds the fault."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Page\n\n" + BROKEN[fault])
    # an Args entry naming two parameters at once: the google parser cannot read it
    (tmp_path / "brokendoc.py").write_text(
        '"""A module."""\n\n\ndef f(a: int, b: int) -> int:\n'
        '    """Sum.\n\n    Args:\n        a, b: two numbers.\n    """\n'
        '    return a + b\n'
    )
    settings = CONFIG.read_text().split("\nnav:")[0]
    settings = settings.replace("paths: [src]", f"paths: [{ROOT / 'src'}, {tmp_path}]")
    settings = settings.replace("- docs/hooks/", f"- {ROOT / 'docs' / 'hooks'}/")
    assert str(tmp_path) in settings and str(ROOT / "docs" / "hooks") in settings
    config = tmp_path / "mkdocs.yml"
    config.write_text(settings)
    done = _build(config, tmp_path / "site")
    assert done.returncode != 0, done.stderr[-3000:]
    expected = {
        "link": "missing.md",
        "anchor": "no-such-heading",
        "reference": "no_such_function",
        "docstring": "brokendoc.py",
    }[fault]
    assert re.search(rf"(WARNING|ERROR).*{re.escape(expected)}", done.stderr), done.stderr[-3000:]
