"""Schema check for composed Hydra configs, run before anything is built.

Hydra already rejects an unknown group choice (`model=dbsnn` lists the valid options) and an
override of a key that does not exist. What it cannot see is a misspelled key that a YAML
file or a `+key=value` override *adds* to a node that `hydra.utils.instantiate` will pass to a
constructor: that would fail much later, deep inside instantiate, or worse, be swallowed by a
`**kwargs`. `validate_config` walks every node with a `_target_`, imports the target and checks
each key against the constructor's signature, naming the valid keys and the likely intended one.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}

# Keys a node may carry without being constructor arguments: values supplied by train.py at
# build time (e.g. a network's `num_classes` comes from the data module).
RUNTIME_KEYS = {"num_classes", "net", "member"}

TOP_LEVEL_KEYS = {
    "data", "model", "trainer", "logger", "callbacks", "paths", "hydra", "seed", "ckpt_path", "init_from",
    "test", "task_name", "tags", "n_samples", "print_config",
}


class ConfigError(ValueError):
    """A config that cannot run, with what is wrong and what would be right."""


def _suggest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _accepted_keys(target: Any) -> tuple[set[str], bool]:
    """Parameter names of `target`'s constructor, and whether it takes **kwargs."""
    sig = inspect.signature(target.__init__ if inspect.isclass(target) else target)
    names = {n for n, p in sig.parameters.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, takes_kwargs


def _check_node(node: DictConfig, where: str) -> None:
    target_name = node.get("_target_")
    if target_name is not None:
        try:
            target = get_object(target_name)
        except Exception as err:
            raise ConfigError(f"{where}._target_: cannot import '{target_name}' ({err}).") from err
        accepted, takes_kwargs = _accepted_keys(target)
        if not takes_kwargs:
            for key in node.keys():
                if key in HYDRA_KEYS or key in accepted or key in RUNTIME_KEYS:
                    continue
                raise ConfigError(
                    f"{where}: unknown key '{key}' for {target_name}.{_suggest(str(key), accepted)} "
                    f"Valid keys: {', '.join(sorted(accepted))}."
                )
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _check_node(child, f"{where}.{key}")
        elif isinstance(child, ListConfig):
            for i, item in enumerate(child):
                if isinstance(item, DictConfig):
                    _check_node(item, f"{where}.{key}[{i}]")


def validate_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` for unknown top-level keys or keys no constructor accepts."""
    for key in cfg.keys():
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(
                f"Unknown top-level config key '{key}'.{_suggest(str(key), TOP_LEVEL_KEYS)} "
                f"Valid keys: {', '.join(sorted(TOP_LEVEL_KEYS))}."
            )
    for section in ("data", "model", "trainer", "logger", "callbacks"):
        node = cfg.get(section)
        if isinstance(node, DictConfig):
            _check_node(node, section)


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain dicts and lists (safe to store in a checkpoint)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]
