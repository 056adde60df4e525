"""What the config checks raise, below every module that checks (`dbsn.runtime.config`, its
origins, the trainer's settings): a `ConfigError` says what is wrong and what would be right;
`suggest` adds the likely intended key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "UnknownKeysError", "suggest"]


class ConfigError(ValueError):
    """A config that cannot run, with what is wrong and what would be right."""


def suggest(key: str, valid: Iterable[str]) -> str:
    """ " Did you mean '<key>'?" for the valid key closest to `key`, or ""."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


class UnknownKeysError(ConfigError):
    """Keys of a node that its constructor does not take: `where` (the node's path), `keys`, the
    `target` it builds and the keys it `accepted`. `validate_config` names where they came from."""

    def __init__(self, where: str, keys: list[str], target: str, accepted: set[str]) -> None:
        self.where, self.keys, self.target, self.accepted = where, keys, target, accepted
        key = keys[0]
        super().__init__(
            f"{where}: unknown key '{key}' for {target}.{suggest(str(key), accepted)} "
            f"Valid keys: {', '.join(sorted(accepted))}."
        )
