"""A run folder holds one run.

Every training run (train.py, a sweep's job, a SLURM job, each method of `dbsn-compare`) starts
through `claim_run_folder`, before its data or network is built:

- **One process.** The folder is locked (`LOCK_FILE`, an `flock` that the kernel releases when the
  process ends, so a crash or `kill -9` never leaves it stuck). A second process in a folder that a
  live run holds is refused in one line naming the holder.
- **One run.** A folder that holds a run (its `run.json`, or the files of a run written before runs
  named themselves) is continued only by `resume=true` (or `ckpt_path=` one of its own
  checkpoints); any other start there is refused, as is a folder of files that are not a run's.
- **Files that name their run.** `RunFolder.begin` writes `run.json`: the run's id (also in every
  checkpoint and in metrics.json), its status (running, finished, failed, interrupted), the digest
  of `resolved_config.yaml` and the history of its starts, resumes and ends. Nothing (Hydra's
  `.hydra/` files and the log included) is written before the claim and the start's checks pass,
  so a refused start leaves every byte of the folder as it was.

`check_run_folder` is the same decision without the lock, for a command line that has not made
its folders yet: `RunFolderCheck` (a Hydra callback, conf/train.yaml) runs it before Hydra makes the
run folder, and the sweep launchers run it for every job before the first one starts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from dbsn import __version__
from dbsn.evaluation.runs import CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE, RUN_FILE, read_run_record
from dbsn.runtime.config import ConfigError

__all__ = [
    "LOCK_FILE",
    "RunFolder",
    "RunFolderCheck",
    "check_run_folder",
    "check_writable",
    "claim_run_folder",
    "config_digest",
    "write_record",
]

LOCK_FILE = ".dbsn.lock"
#: what marks a folder as a run's when it has no run.json (runs written before runs named themselves)
LEGACY_RUN_FILES = (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR)
#: the format of the run's log file (Hydra's own file handler's)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def config_digest(path: Path) -> str:
    """sha256 of a file's bytes (run.json's `config_sha256` of resolved_config.yaml)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_record(folder: Path, record: dict) -> None:
    """Write run.json atomically: a temporary file beside it, fsync, rename."""
    path = Path(folder) / RUN_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_writable(folder: Path, where: str) -> None:
    """Refuse, before anything is made, a run folder that cannot be written: its nearest existing
    folder is on a read-only file system or not writable by this user."""
    folder = Path(folder).absolute()
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"{where}={folder}: {existing} is a file, not a folder; choose another folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "is on a read-only file system" if _read_only(existing) else "is not writable by this user"
        raise ConfigError(
            f"{where}={folder}: {existing} {reason}, so the run could not write its checkpoints; "
            f"choose a writable folder ({where}=...)."
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _holder(folder: Path) -> str:
    """Who holds the folder's lock, from what the holder wrote into the lock file."""
    try:
        facts = json.loads((Path(folder) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        facts = {}
    if not facts:
        return "another process"
    return f"pid {facts.get('pid')} on {facts.get('host')}, started {facts.get('started')}"


def _held(folder: Path) -> bool:
    """Whether a live process holds the folder's lock (probed without taking it)."""
    import fcntl

    path = Path(folder) / LOCK_FILE
    if not path.is_file():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # locks unsupported here: nobody can hold one
        return False
    finally:
        os.close(fd)


def _continues_itself(folder: Path, ckpt_path: Any) -> bool:
    """Whether `ckpt_path` is one of the folder's own checkpoints (the run continues itself)."""
    if not ckpt_path:
        return False
    try:
        return Path(str(ckpt_path)).expanduser().resolve().parent == (Path(folder) / CHECKPOINT_DIR).resolve()
    except OSError:
        return False


def _contents(folder: Path) -> list[str]:
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE) if folder.is_dir() else []


def _describe(record: dict | None) -> str:
    if record is None:
        return "a run written before runs named themselves"
    return f"run {record['run_id'][:8]} ({record.get('status', 'unknown')})"


def check_run_folder(folder: Path, *, resume: bool, ckpt_path: Any = None, where: str = "hydra.run.dir") -> str:
    """What a start in `folder` would do: "new" (empty or not there) or "continue" (it holds a run
    and `resume=true` or `ckpt_path=` one of its checkpoints continues it). Raises `ConfigError`,
    naming `where` (the setting that chose the folder) and the fix, when it may not start there:
    a live run holds it, it holds a run and this start does not continue it, or it holds files
    that are not a run's."""
    folder = Path(folder)
    check_writable(folder, where)
    if _held(folder):
        raise ConfigError(
            f"{where}={folder} is in use by a live run ({_holder(folder)}): wait for it to end, or "
            f"choose another folder."
        )
    return _decide(folder, resume, ckpt_path, where)


def _decide(folder: Path, resume: bool, ckpt_path: Any, where: str) -> str:
    """`check_run_folder`'s decision from what the folder holds (its lock aside)."""
    contents = _contents(folder)
    if not contents:
        return "new"
    record = read_run_record(folder)
    is_run = record is not None or any(name in contents for name in LEGACY_RUN_FILES)
    if not is_run:
        shown = ", ".join(contents[:4]) + (", ..." if len(contents) > 4 else "")
        raise ConfigError(
            f"{where}={folder} holds files that are not a run's ({shown}): a run starts in a new or "
            f"empty folder; choose another one."
        )
    if resume or _continues_itself(folder, ckpt_path):
        return "continue"
    raise ConfigError(
        f"{where}={folder} holds {_describe(record)}: continue it with resume=true, or start the new "
        f"run in a new folder (leave {where} unset for a new timestamped one)."
    )


@dataclass
class RunFolder:
    """A claimed run folder: this process holds its lock until `release`. `mode`: "new" or
    "continue"; `record`: its run.json (written by `begin`)."""

    path: Path
    mode: str
    record: dict | None
    created: bool = False  # this process made the folder
    begun: bool = False  # run.json written for this start
    _lock_fd: int | None = None
    _log_handler: logging.Handler | None = field(default=None, repr=False)

    @property
    def run_id(self) -> str | None:
        return None if self.record is None else self.record["run_id"]

    def begin(self, changes: list | None = None, continued_from: str | None = None) -> dict:
        """Write run.json for the start (after resolved_config.yaml is written and every check
        passed): a new run gets its id, a continued one a "resumed" event with the settings it
        changed (`changes`); `continued_from`: another run's checkpoint this new run continues."""
        config = self.path / CONFIG_FILE
        digest = config_digest(config) if config.is_file() else None
        facts = {
            "status": "running",
            "updated": _now(),
            "dbsn_version": __version__,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "config_sha256": digest,
        }
        if self.record is None or self.mode == "new":
            # a folder of a run written before runs named themselves is adopted: its earlier files name no run
            event = "started" if self.mode == "new" else "adopted"
            self.record = {
                "run_id": uuid.uuid4().hex,
                "created": _now(),
                **facts,
                "history": [
                    {"event": event, "at": _now(), **({"continues": continued_from} if continued_from else {})}
                ],
            }
        else:
            event = {"event": "resumed", "at": _now(), **({"changes": changes} if changes else {})}
            self.record = {**self.record, **facts, "history": [*self.record.get("history", []), event]}
        write_record(self.path, self.record)
        self.begun = True
        return self.record

    def end(self, status: str, **facts) -> None:
        """Mark the run `status` (finished, failed, interrupted) in run.json; nothing for a start that
        was refused before `begin` (a continued run's record stays as it was)."""
        if not self.begun:
            return
        self.record = {
            **self.record,
            "status": status,
            "updated": _now(),
            "history": [*self.record.get("history", []), {"event": status, "at": _now(), **facts}],
        }
        try:
            write_record(self.path, self.record)
        except OSError as err:  # a full disk must not hide the error that ended the run
            print(f"Could not mark {self.path / RUN_FILE} {status}: {err}", file=sys.stderr, flush=True)

    def log_to_file(self, name: str) -> None:
        """The run's log messages into `<folder>/<name>.log` with their times (what Hydra's file
        handler does, here after the claim)."""
        handler = logging.FileHandler(self.path / f"{name}.log")
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(handler)
        self._log_handler = handler

    def release(self) -> None:
        """Close the log file and give the lock back."""
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None


def _lock(folder: Path, where: str) -> int | None:
    """Take the folder's lock and write who holds it; None where the file system has no locks."""
    import fcntl

    fd = os.open(Path(folder) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{where}={folder} is in use by a live run ({_holder(folder)}): wait for it to end, or "
            f"choose another folder."
        ) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        os.close(fd)
        print(
            f"Note: {folder} is on a file system without locks; nothing stops a second process there.",
            file=sys.stderr,
            flush=True,
        )
        return None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}).encode())
    return fd


def claim_run_folder(folder: Path, *, resume: bool, ckpt_path: Any = None, where: str = "hydra.run.dir") -> RunFolder:
    """Lock `folder` (made if needed) and decide, as `check_run_folder` does, whether this start is a
    new run or continues the one there; raises `ConfigError` (and leaves nothing behind) otherwise.
    Writes nothing but the lock; `RunFolder.begin` writes run.json once the start's checks passed."""
    folder = Path(folder)
    check_writable(folder, where)
    existed = folder.is_dir()
    had_lock = (folder / LOCK_FILE).exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _lock(folder, where)
    except OSError as err:
        raise ConfigError(f"{where}={folder}: cannot write there ({err.strerror}); choose a writable folder.") from err
    try:
        mode = _decide(folder, resume, ckpt_path, where)
    except BaseException:
        if fd is not None:
            os.close(fd)
        if not had_lock:
            (folder / LOCK_FILE).unlink(missing_ok=True)
        if not existed:
            _remove_empty(folder)
        raise
    return RunFolder(
        folder, mode, read_run_record(folder) if mode == "continue" else None, created=not existed, _lock_fd=fd
    )


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def write_hydra_files(folder: Path, task_cfg) -> None:
    """Hydra's record of the composition, `.hydra/{config,hydra,overrides}.yaml`, as Hydra writes it
    (conf/train.yaml sets `hydra.output_subdir: null`: written here, after the claim, so that a
    refused start never replaces another run's). Kept from the first start of a continued run."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return
    out = Path(folder) / ".hydra"
    if out.exists():
        return
    out.mkdir()
    hydra_cfg = HydraConfig.instance().cfg
    OmegaConf.save(task_cfg, out / "config.yaml")
    OmegaConf.save(hydra_cfg, out / "hydra.yaml")
    OmegaConf.save(hydra_cfg.hydra.overrides.task, out / "overrides.yaml")


class RunFolderCheck(Callback):
    """Hydra callback (conf/train.yaml's `hydra.callbacks`): `check_run_folder` on `hydra.run.dir`
    before Hydra makes the folder, and on a sweep's folder before any job starts, so that a start
    that may not run there is refused in one line and leaves no folder (the lock in
    `claim_run_folder` still decides between two processes that start together)."""

    def on_run_start(self, config, **kwargs: Any) -> None:
        from dbsn.runtime.errors import one_line_errors
        from dbsn.runtime.rank import is_rank_zero

        if is_rank_zero():  # every task of a multi-node SLURM run starts train.py in the same folder
            one_line_errors(self._check_run)(config)

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        from dbsn.runtime.errors import one_line_errors

        one_line_errors(self._check_sweep)(config)

    @staticmethod
    def _check_run(config) -> None:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)  # ${hydra:...} in the folder's name resolves as in the job
        check_run_folder(
            Path(str(config.hydra.run.dir)),
            resume=bool(config.get("resume")),
            ckpt_path=config.get("ckpt_path"),
            where="hydra.run.dir",
        )

    @staticmethod
    def _check_sweep(config) -> None:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)
        folder = Path(str(config.hydra.sweep.dir))
        check_sweep_folder(folder, resume=bool(config.get("resume")))
        if not folder.exists():
            _NEW_SWEEP_FOLDERS.add(folder.absolute())


SWEEP_FILE = "multirun.yaml"
_NEW_SWEEP_FOLDERS: set[Path] = set()  # sweep folders this process is about to make (RunFolderCheck)


def remove_new_sweep_folder(folder: Path) -> None:
    """Remove a refused sweep's folder if this process made it and it holds only Hydra's multirun.yaml."""
    folder = Path(folder)
    if (
        folder.absolute() in _NEW_SWEEP_FOLDERS
        and folder.is_dir()
        and {p.name for p in folder.iterdir()} <= {SWEEP_FILE}
    ):
        (folder / SWEEP_FILE).unlink(missing_ok=True)
        _remove_empty(folder)


def check_sweep_folder(folder: Path, *, resume: bool, where: str = "hydra.sweep.dir") -> None:
    """A sweep starts in a new folder, or continues the sweep there with resume=true."""
    folder = Path(folder)
    check_writable(folder, where)
    if (folder / SWEEP_FILE).is_file() and not resume:
        raise ConfigError(
            f"{where}={folder} holds another sweep ({SWEEP_FILE}): continue its jobs with resume=true, "
            f"or choose a new folder (leave {where} unset for a new timestamped one)."
        )
