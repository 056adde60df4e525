"""What a run prints (dbsn.runtime.console): each Lightning message once, no product tips."""

from __future__ import annotations

import logging

from dbsn.runtime.console import LIGHTNING_LOGGERS, quiet_console


def test_lightning_messages_reach_the_console_once_and_tips_not_at_all(capfd):
    import lightning.pytorch  # noqa: F401 - adds Lightning's own console handlers

    root = logging.getLogger()
    handler = logging.StreamHandler()  # stands in for the console handler Hydra configures
    root.addHandler(handler)
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate) for name in LIGHTNING_LOGGERS}
    try:
        quiet_console()
        quiet_console()  # twice changes nothing
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        rank_zero.warning("GPU available: False, used: False")
        rank_zero.warning("💡 Tip: For seamless cloud logging, try litlogger")
        err = capfd.readouterr().err
        assert err.count("GPU available: False, used: False") == 1
        assert "💡" not in err and "litlogger" not in err
        assert sum(type(f).__name__ == "_NoTips" for f in rank_zero.filters) == 1
    finally:
        root.removeHandler(handler)
        for name, (handlers, propagate) in saved.items():
            logging.getLogger(name).handlers[:] = handlers
            logging.getLogger(name).propagate = propagate
