"""What a run prints: each message once, and nothing the user cannot act on.

Hydra sends every log record to the console (the message alone: `conf/hydra/default.yaml`'s
`brief` format) and to the run's log file (`<run>/<train|evaluate>.log`, with time and logger).
`quiet_console()`, called when a command starts, takes away what would repeat or distract:

- Lightning's own console handlers (the `lightning` loggers print their records themselves and
  pass them on to Hydra's, so every INFO line appeared twice);
- Lightning's advertisements for its cloud products ("💡 Tip: ... litlogger / litmodels");
- the deprecation warning Lightning's own `_pytree` module raises on every fit (a Lightning
  matter, nothing in this project or a user's run can change it).
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_console"]

LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class _NoTips(logging.Filter):
    """Drops Lightning's "💡 Tip: ..." records."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_console() -> None:
    """Each Lightning message once (through the handlers Hydra configured), no product tips, no
    `_pytree` deprecation warning. Without handlers on the root logger (no Hydra: tests, a
    notebook) Lightning keeps its own, so its messages still show. Calling it again changes nothing."""
    import lightning.pytorch  # noqa: F401 - its import adds the handlers taken away here

    if logging.getLogger().handlers:
        for name in LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in tips.filters):
        tips.addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")
