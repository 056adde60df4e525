"""A comparison's folder (`dbsn-compare --out DIR`) holds one comparison.

`check_output` runs before any method trains. A new or empty `--out` starts a comparison; one that
already holds a comparison is refused unless `--resume` continues it: each method's folder is then
kept if its run finished with the settings this comparison gives it (`finished_run`), continued
from its last checkpoint if it did not, and started if it is not there, so that a comparison killed
after its third method loses nothing and mixes no two runs in one folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from dbsn.evaluation.runs import (
    CONFIG_FILE,
    METRICS_FILE,
    OUTSIDE_THE_RUN,
    flatten_config,
    load_run_config,
    read_run_record,
    under,
)
from dbsn.runtime.config import ConfigError

__all__ = ["COMPARISON_FILES", "check_output", "finished_run", "finished_tuning_run", "validated"]

#: what dbsn-compare writes into --out beside the methods' folders
COMPARISON_FILES = frozenset({"comparison.md", "comparison.json", "report", "tune"})


def check_output(output_dir: Path, methods, known_methods, resume: bool) -> None:
    """Refuse (`ConfigError`, one line) an `--out` this comparison may not write into: one holding a
    comparison without `--resume`, files that are not a comparison's, or a method folder that a
    live run holds or that is not a run."""
    from dbsn.runtime.folder import check_run_folder, check_writable

    output_dir = Path(output_dir)
    check_writable(output_dir, "--out")
    entries = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() else []
    if not entries:
        return
    foreign = [e for e in entries if e not in COMPARISON_FILES and e not in set(known_methods)]
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise ConfigError(
            f"--out {output_dir} holds files that are not a comparison's ({shown}): choose a new or empty --out."
        )
    found = [e for e in entries if e not in COMPARISON_FILES]
    if not resume:
        raise ConfigError(
            f"--out {output_dir} holds a comparison already ({', '.join(found) or 'its tables'}): "
            "continue it with --resume (finished methods are kept, unfinished ones continue from their "
            "checkpoints), or choose a new --out."
        )
    for method in found:
        check_run_folder(output_dir / method, resume=True, where=f"--out {output_dir}: the method folder")


def finished_run(run_dir: Path, config: dict) -> dict | None:
    """The metrics.json of the run in `run_dir` if it finished with `config` (the resolved config this
    comparison gives it); None if it did not finish (it is continued); `ConfigError` if it ran with
    other settings (naming the first difference; keys `OUTSIDE_THE_RUN` may differ)."""
    record = read_run_record(run_dir)
    if record is None and (Path(run_dir) / METRICS_FILE).is_file() and (Path(run_dir) / CONFIG_FILE).is_file():
        record = {"status": "finished"}  # a run written before runs named themselves
    if record is None or record.get("status") != "finished" or not (Path(run_dir) / METRICS_FILE).is_file():
        return None
    saved, ours = flatten_config(load_run_config(run_dir)), flatten_config(json.loads(json.dumps(config)))
    keys = sorted(
        k
        for k in saved.keys() | ours.keys()
        if not any(under(k, p) for p in OUTSIDE_THE_RUN) and saved.get(k, "<absent>") != ours.get(k, "<absent>")
    )
    if keys:
        key = keys[0]
        raise ConfigError(
            f"{run_dir} holds a finished run with other settings ({key}: {saved.get(key, '<absent>')} "
            f"there, {ours.get(key, '<absent>')} here{f', and {len(keys) - 1} more' if len(keys) > 1 else ''}"
            "): choose a new --out for this comparison."
        )
    return json.loads((Path(run_dir) / METRICS_FILE).read_text())


def finished_tuning_run(run_dir: Path) -> bool:
    """Whether a learning-rate search's run (`DIR/tune/<method>/lr_<rate>`) finished: it is then kept."""
    record = read_run_record(run_dir)
    return record is not None and record.get("status") == "finished"


def validated(cfg) -> dict:
    """The resolved config `train` would record for `cfg` (its checks applied to a copy)."""
    import copy

    from dbsn.runtime.config import to_plain, validate_config

    cfg = copy.deepcopy(cfg)
    validate_config(cfg)
    return to_plain(cfg)
