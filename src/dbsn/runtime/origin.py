"""Where a setting of a composed config came from: the user's command line, a preset
(`experiment=`, `field=`, `speed=`) or a group file (`conf/model/vogn.yaml`).

A refusal that blames the user for a key a preset or a model file set sends them looking in the
wrong place. Hydra knows the answer: its defaults list orders every config file that went into the
composition (a later file wins), and the command line comes after all of them. `origin_of` reads
the command line and that list from the composed config's `hydra` node, or from the running Hydra
job (`HydraConfig`), and returns the last source that sets the key; None where neither is there
(a config composed without Hydra's node, as most tests do) or nothing sets it.

The refusals built on it: `explain_unknown` (keys a constructor does not take, blamed on their
source: a preset that set them for another method, a method's file that set them for its own
network, saying which networks the method runs on), `malformed` (a group file of a user's
extension that holds a list or a string where a mapping belongs) and `set_by` (a note for any
other message).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dbsn.runtime.config_errors import ConfigError, UnknownKeysError, suggest

__all__ = ["PRESETS", "Origin", "explain_unknown", "group_origin", "malformed", "origin_of", "set_by"]

#: Config groups whose files are presets: `# @package _global_` overlays of a whole run.
PRESETS = ("experiment", "field", "budget", "speed")


@dataclass(frozen=True)
class Origin:
    """A setting's source: `kind` is "command line", "preset" or "file"; `file` the config file
    (None for the command line); `group` and `choice` the config group and option that chose the
    file (`experiment`, `quick`); `text` how a message names it."""

    kind: str
    text: str
    file: str | None = None
    group: str | None = None
    choice: str | None = None
    setting: str | None = None  # the command line's `key=value` that set it
    chooses: tuple[tuple[str, str], ...] = ()  # the file's own group choices, (("model/net", "structure_net"),)


def _hydra_node(cfg: DictConfig | None) -> Any:
    """The `hydra` node of a composed config (a sweep's job config, a test's compose with
    `return_hydra_config=True`), else the running job's, else None."""
    if cfg is not None and isinstance(cfg, DictConfig) and "hydra" in cfg:
        node = cfg._get_node("hydra")
        if isinstance(node, DictConfig) and "runtime" in node and "overrides" in node:
            return node
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _facts(cfg: DictConfig | None) -> tuple[str, tuple[str, ...], tuple[tuple[str, str, str], ...], dict] | None:
    node = _hydra_node(cfg)
    if node is None:
        return None
    try:
        overrides = tuple(str(o) for o in node.overrides.task)
        sources = tuple((str(s.provider), str(s.schema), str(s.path)) for s in node.runtime.config_sources)
        choices = {str(k): (None if v is None else str(v)) for k, v in node.runtime.choices.items()}
        name = str(node.job.config_name)
    except Exception:  # noqa: BLE001 - a hydra node without these facts: no origin
        return None
    return name, overrides, sources, choices


@functools.lru_cache(maxsize=16)
def _defaults(config_name: str, overrides: tuple[str, ...], sources: tuple[tuple[str, str, str], ...]):
    """Hydra's defaults list of this composition, and its config repository."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.types import RunMode

    search_path = ConfigSearchPathImpl()
    for provider, schema, path in sources:
        search_path.append(provider, f"{schema}://{path}")
    loader = ConfigLoaderImpl(config_search_path=search_path)
    defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults
    return [d for d in defaults if d.config_path and not (d.package or "").startswith("hydra")], loader.repository


def _file_of(config_path: str, sources: tuple[tuple[str, str, str], ...]) -> str:
    """The file of `config_path` (`model/vogn`), shortened to start at the working directory where
    it is below it; `<config_path>.yaml` where it is not a file (a package's config)."""
    for _, schema, path in sources:
        if schema == "file":
            file = Path(path) / f"{config_path}.yaml"
            if file.is_file():
                try:
                    return os.path.relpath(file) if file.resolve().is_relative_to(Path.cwd().resolve()) else str(file)
                except ValueError:
                    return str(file)
    return f"{config_path}.yaml"


_MISSING = object()


def _sets(config: Any, key: str) -> bool:
    if not key:
        return True
    if not isinstance(config, DictConfig):
        return False
    return OmegaConf.select(config, key, default=_MISSING, throw_on_missing=False) is not _MISSING


def _command_line(key: str, overrides: tuple[str, ...], choices: dict) -> str | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra accepted them; a parser that does not: no origin
        return None
    for override, text in reversed(list(zip(parsed, overrides))):
        name = override.get_key_element().lstrip("+~")
        if name in choices or "/" in name or override.type is OverrideType.DEL:
            continue  # a group's choice (model=vogn) chooses files; the files set the keys
        if key == name or key.startswith(name + "."):
            return text
    return None


def origin_of(cfg: DictConfig | None, key: str) -> Origin | None:
    """Where the value of `key` (a dotted path, e.g. `model.tau`) in the composed `cfg` came
    from, or None where that is not known (see the module docstring)."""
    facts = _facts(cfg)
    if facts is None:
        return None
    config_name, overrides, sources, choices = facts
    setting = _command_line(key, overrides, choices)
    if setting is not None:
        return Origin("command line", f"the command line ({setting})", setting=setting)
    try:
        defaults, repository = _defaults(config_name, overrides, sources)
    except Exception:  # noqa: BLE001 - a composition Hydra made once cannot be listed again: no origin
        return None
    for default in reversed(defaults):
        package = default.package or ""
        if package and not (key == package or key.startswith(package + ".")):
            continue
        try:
            loaded = repository.load_config(default.config_path)
        except Exception:  # noqa: BLE001
            continue
        if loaded is None or not _sets(loaded.config, key[len(package) + 1 :] if package else key):
            continue
        return _origin(default.config_path, default.primary, sources, choices, _chosen(default.config_path, loaded))
    return None


def group_origin(cfg: DictConfig | None, group: str) -> Origin | None:
    """The file that the choice of config group `group` (`model`, `model/net`) loaded, or None."""
    facts = _facts(cfg)
    if facts is None or not facts[3].get(group):
        return None
    _, _, sources, choices = facts
    return _origin(f"{group}/{choices[group]}", False, sources, choices)


def _chosen(config_path: str, loaded) -> tuple[tuple[str, str], ...]:
    """The group choices of a config file's own defaults list, by absolute group."""
    from hydra.core.default_element import GroupDefault

    base = config_path.rpartition("/")[0]
    found = []
    for default in getattr(loaded, "defaults_list", None) or []:
        if isinstance(default, GroupDefault) and isinstance(default.value, str):
            group = default.group[1:] if default.group.startswith("/") else f"{base}/{default.group}".strip("/")
            found.append((group, default.value))
    return tuple(found)


def _origin(config_path: str, primary: bool, sources, choices: dict, chooses=()) -> Origin:
    file = _file_of(config_path, sources)
    if primary:
        return Origin("file", file, file=file, chooses=chooses)
    top = config_path.split("/", 1)[0]
    if top in PRESETS:
        choice = config_path[len(top) + 1 :]
        return Origin(
            "preset", f"the preset {top}={choice} ({file})", file=file, group=top, choice=choice, chooses=chooses
        )
    group, _, choice = config_path.rpartition("/")
    chosen = choices.get(group)
    via = f"{group}={choice}" if chosen == choice else f"{group}={chosen}, which builds on {choice}"
    return Origin("file", f"{file} ({via})", file=file, group=group, choice=choice, chooses=chooses)


# ---------------------------------------------------------------------- refusals that name the origin
def _kind(value: Any) -> str:
    if isinstance(value, (ListConfig, list, tuple)):
        return "a list"
    if isinstance(value, (DictConfig, dict)):
        return "a mapping without _target_ (the class it builds)"
    if value is None:
        return "nothing"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({value!r})"


def malformed(cfg: DictConfig, key: str, value: Any, expected: str) -> ConfigError:
    """`key` holds `value` where `expected` belongs: named by the file that made it so, where that
    is known (a group file of a user's extension that holds a list or a string)."""
    group = key.replace(".", "/")
    origin, whole = origin_of(cfg, key), group_origin(cfg, group)
    if origin is not None and origin.kind == "command line":
        shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        return ConfigError(f"{key}={shown!r} (set on {origin.text}): expected {expected}, got {_kind(value)}.")
    if whole is not None and (origin is None or origin.file == whole.file):
        return ConfigError(
            f"{key}: {whole.text} holds {_kind(value)}, and {key} takes {expected}: a config file of "
            "this group is a YAML mapping of key: value lines."
        )
    if origin is not None:
        option = (
            f" (an option of the group {group} is chosen in the file's defaults list: - {key.rsplit('.', 1)[-1]}: "
            "<option>)"
            if whole is not None
            else ""
        )
        return ConfigError(f"{key}: {origin.text} sets it to {_kind(value)}, and {key} takes {expected}{option}.")
    return ConfigError(f"{key}: expected {expected}, got {_kind(value)}.")


def set_by(cfg: DictConfig, key: str) -> str:
    """ " (set on the command line (…))" / " (set by <file>)" for `key`, or "" where not known."""
    origin = origin_of(cfg, key)
    if origin is None:
        return ""
    return f" (set on {origin.text})" if origin.kind == "command line" else f" (set by {origin.text})"


def _section_choice(cfg: DictConfig, where: str) -> str | None:
    """`group=choice` of the config group whose file builds the node at `where` (`model/net=wrn28_10`)."""
    facts = _facts(cfg)
    if facts is None:
        return None
    group = where.replace(".", "/")
    choice = facts[3].get(group)
    return f"{group}={choice}" if choice else None


def _networks_of(model: DictConfig) -> tuple[str, str] | None:
    """(the method's name, the networks it trains on, in words) for a `model:` node."""
    from dbsn.methods.registry import built_class, field_backbones

    try:
        cls = built_class(OmegaConf.to_container(model, resolve=True))
    except Exception:  # noqa: BLE001 - a target that does not import: check_node names it
        return None
    networks = getattr(cls, "networks", "any")
    if networks == "cells":
        return cls.__name__, "DBSN's cell network only (model/net=structure_net)"
    if networks == "own":
        return cls.__name__, "its own network only (the one conf/model/ gives it)"
    return cls.__name__, f"any network ({', '.join(['structure_net', *field_backbones()])})"


def explain_unknown(err: UnknownKeysError, cfg: DictConfig) -> ConfigError:
    """`err` with where its keys came from: the user (the command line), a preset that set them
    for another method, or a method's file that set them for its own network."""
    origins = [origin_of(cfg, f"{err.where}.{key}") for key in err.keys]
    first = origins[0]
    if first is None:
        return err
    target = err.target.rsplit(".", 1)[-1]
    if first.kind == "command line":
        key = err.keys[0]
        return ConfigError(
            f"{err.where}: unknown key '{key}' for {err.target} (set on {first.text}).{suggest(key, err.accepted)} "
            f"Valid keys: {', '.join(sorted(err.accepted))}."
        )
    keys = [key for key, origin in zip(err.keys, origins) if origin == first]
    paths = [f"{err.where}.{key}" for key in keys]
    named = ", ".join(paths)
    one = len(keys) == 1
    no_such = "has no such setting" if one else "has no such settings"
    remove = " ".join(f"~{p}" for p in paths)
    them = "it" if one else "them"
    section = _section_choice(cfg, err.where)
    builds = f"{target} ({section})" if section else target
    group_of_where = err.where.replace(".", "/")
    chosen_there = dict(first.chooses).get(group_of_where)
    if first.kind == "preset":
        for_what = f" for {group_of_where}={chosen_there}" if chosen_there else ""
        keep = (
            f", or keep the preset's {group_of_where}={chosen_there}"
            if chosen_there and section and section != f"{group_of_where}={chosen_there}"
            else ""
        )
        return ConfigError(
            f"{named} {'was' if one else 'were'} set by {first.text}{for_what}, and {builds} {no_such}: "
            f"remove {them} on the command line with {remove}{keep}."
        )
    if err.where.endswith("net") and chosen_there:
        model = OmegaConf.select(cfg, err.where.rsplit(".", 1)[0]) if "." in err.where else None
        method = _networks_of(model) if isinstance(model, DictConfig) else None
        chosen_method = _section_choice(cfg, err.where.rsplit(".", 1)[0])
        name = f"{method[0]} ({chosen_method})" if method and chosen_method else (method[0] if method else "")
        runs = (
            f" {name} runs on {method[1]}; to run it on {target}, remove {them} with {remove}."
            if method
            else f" Remove {them} with {remove}."
        )
        settings = ", ".join(f"{k}={OmegaConf.select(cfg, p)}" for k, p in zip(keys, paths))
        return ConfigError(
            f"{err.where}: {first.text} sets {settings} for its own network {group_of_where}="
            f"{chosen_there}, and {builds} {no_such}.{runs}"
        )
    return ConfigError(
        f"{named} {'was' if one else 'were'} set by {first.text}, and {builds} {no_such}: remove {them} with {remove}."
    )
