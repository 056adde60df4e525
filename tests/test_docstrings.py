"""Docstrings and comments under src/ read like the code's anchors, not its lab notebook: no date in any
docstring or comment (dated measurements belong in docs/performance.md or docs/results.md, history in
CHANGELOG.md), and no module docstring longer than `MODULE_DOCSTRING_LINES` (reference detail belongs in
docs/). Pure parsing, no import of dbsn: well under a second."""

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: a calendar date, YYYY-MM-DD
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
#: the most lines a module docstring may have (opening line to closing quotes)
MODULE_DOCSTRING_LINES = 25


def _docstrings(tree: ast.Module):
    """(line, text) of the module's, every class's and every function's docstring."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                yield (node.body[0].lineno, text)


def dated_lines(path: Path) -> list[str]:
    """`path:line: text` of every docstring or comment in `path` that holds a date."""
    source = path.read_text(encoding="utf-8")
    found = [(line, text) for line, text in _docstrings(ast.parse(source)) if DATE.search(text)]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and DATE.search(token.string):
            found.append((token.start[0], token.string))
    return [f"{path}:{line}: {DATE.search(text).group()}" for line, text in sorted(found)]


def module_docstring_lines(path: Path) -> int:
    """How many lines `path`'s module docstring has (0 without one)."""
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(text.splitlines()) if text else 0


def too_long(root: Path, limit: int = MODULE_DOCSTRING_LINES, allowed: dict[str, int] | None = None) -> list[str]:
    """`module: lines > limit` of every module under `root` whose docstring is over its limit."""
    allowed = allowed or {}
    over = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        lines, most = module_docstring_lines(path), allowed.get(name, limit)
        if lines > most:
            over.append(f"{name}: {lines} lines > {most}")
    return over


def test_no_date_in_a_docstring_or_comment():
    dated = [line for path in sorted(SRC.rglob("*.py")) for line in dated_lines(path)]
    assert not dated, (
        "a date in a docstring or comment: move the dated figure to docs/performance.md or docs/results.md "
        "and the history to CHANGELOG.md:\n" + "\n".join(dated)
    )


def test_module_docstrings_are_short():
    over = too_long(SRC)
    assert not over, (
        f"module docstrings over {MODULE_DOCSTRING_LINES} lines: say what "
        "and why, and move reference detail to docs/:\n" + "\n".join(over)
    )


def test_the_checks_catch_a_bad_module(tmp_path):
    bad = tmp_path / "pkg" / "bad.py"
    bad.parent.mkdir()
    long_doc = "\n".join(f"line {i}" for i in range(MODULE_DOCSTRING_LINES + 1))
    bad.write_text(
        f'"""A module.\n{long_doc}\n"""\n\n'
        "x = 1  # measured 2026-11-28 on the development machine\n\n\n"
        'def f():\n    """Took 3 s before 2026-11-27."""\n'
    )
    assert [line.split(": ")[-1] for line in dated_lines(bad)] == ["2026-11-28", "2026-11-27"]
    assert too_long(tmp_path, allowed={}) == [
        f"pkg/bad.py: {MODULE_DOCSTRING_LINES + 2} lines > {MODULE_DOCSTRING_LINES}"
    ]
    assert too_long(tmp_path, allowed={"pkg/bad.py": MODULE_DOCSTRING_LINES + 2}) == []
    good = tmp_path / "pkg" / "bad.py"
    good.write_text('"""A module.\n\nWhat and why (Eq. 3).\n"""\n\nx = 1  # a comment\n')
    assert dated_lines(good) == [] and too_long(tmp_path, allowed={}) == []
