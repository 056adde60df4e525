"""Extensions: packages outside dbsn whose config groups every tool reads beside dbsn's own.

An extension is a package of yours with a folder of config groups laid out as dbsn's
(`model/`, `model/net/`, `data/`, `posthoc/`, `evaluations/`, `ood_score/`, ...). It declares
itself once, either installed, through an entry point in its pyproject.toml:

    [project.entry-points."dbsn.extensions"]
    myext = "myext.conf"         # the importable package that is that folder

or without installing, through the search-path setting `DBSN_CONFIG_PATH` (folders separated
by `os.pathsep`). Hydra then finds the configs in train.py, evaluate.py and every tool's compose
(dbsn's search-path plugin, `hydra_plugins.dbsn_searchpath`), and the method registry, compare,
the report, the dashboard and the command line's option lists find their names through
`config_dirs` (`dbsn.conf_choices`), as if they were dbsn's own.

A config of an extension may not share a name with one of dbsn's or of another extension in
the same group: Hydra would read only the first, so the other would be recorded and ignored.
Such a clash is refused (`ExtensionError`, one line naming both files).

It sits at the bottom of dbsn's layers (it imports only the standard library): every layer
may ask it.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points
from pathlib import Path

__all__ = ["ENTRY_POINT_GROUP", "SEARCH_PATH_VARIABLE", "ExtensionError", "config_dirs", "extension_dirs"]

#: the entry-point group an installed extension declares its config package in
ENTRY_POINT_GROUP = "dbsn.extensions"
#: the environment variable naming extension config folders without installing them
SEARCH_PATH_VARIABLE = "DBSN_CONFIG_PATH"
#: dbsn's own config tree (`dbsn.CONF_DIR` is this folder)
DBSN_CONF_DIR = Path(__file__).resolve().parent / "conf"


class ExtensionError(ValueError):
    """An extension that cannot be read: its package does not import, its folder does not exist,
    or one of its configs has the name of another's."""


def _entry_point_dirs() -> list[tuple[str, Path]]:
    found = []
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        owner = f"the {ENTRY_POINT_GROUP} entry point {point.name!r}" + (
            f" of the installed package {point.dist.name}" if getattr(point, "dist", None) else ""
        )
        if ":" in point.value:
            raise ExtensionError(
                f"{owner} names {point.value!r}: it must name a package (the config folder), "
                f"e.g. {point.value.split(':')[0]!r}"
            )
        try:
            module = importlib.import_module(point.value)
        except Exception as err:  # noqa: BLE001 - any failure of a user's package is reported, in one line
            raise ExtensionError(
                f"{owner} names the package {point.value!r}, which does not import "
                f"({type(err).__name__}: {err}); fix or uninstall that package"
            ) from err
        paths = list(getattr(module, "__path__", None) or [])
        if not paths:
            raise ExtensionError(
                f"{owner} names {point.value!r}, a module, not a package: point it at the "
                f"package that holds the config groups (a folder with an __init__.py)"
            )
        found.append((owner, Path(paths[0]).resolve()))
    return found


def _variable_dirs() -> list[tuple[str, Path]]:
    found = []
    for text in os.environ.get(SEARCH_PATH_VARIABLE, "").split(os.pathsep):
        if not text:
            continue
        folder = Path(text).expanduser().resolve()
        if not folder.is_dir():
            raise ExtensionError(
                f"{SEARCH_PATH_VARIABLE} names {text!r}, which is not a folder: set it to the "
                f"folder that holds the extension's config groups (model/, data/, ...)"
            )
        found.append((f"{SEARCH_PATH_VARIABLE}={text}", folder))
    return found


def _configs(folder: Path) -> set[Path]:
    return {path.relative_to(folder) for path in folder.rglob("*.yaml")}


def extension_dirs(conf_dir: Path | None = None) -> list[Path]:
    """The config folders of the installed extensions (entry points, by name) and of
    `DBSN_CONFIG_PATH` (in its order), each once. Refuses a config that has the relative path
    of one in `conf_dir` (dbsn's own, by default) or in an earlier extension."""
    conf_dir = DBSN_CONF_DIR if conf_dir is None else conf_dir
    seen = {path: "dbsn" for path in _configs(Path(conf_dir))}
    dirs: list[Path] = []
    for owner, folder in _entry_point_dirs() + _variable_dirs():
        if folder in dirs or folder == Path(conf_dir).resolve():
            continue
        for path in sorted(_configs(folder)):
            if path in seen:
                raise ExtensionError(
                    f"{owner}: its config {path} ({folder / path}) has the name of one of "
                    f"{seen[path]}'s, which Hydra would read instead; rename it"
                )
            seen[path] = owner
        dirs.append(folder)
    return dirs


def config_dirs() -> list[Path]:
    """Every folder of config groups: dbsn's own (`dbsn.CONF_DIR`), then the extensions'."""
    return [DBSN_CONF_DIR, *extension_dirs(DBSN_CONF_DIR)]
