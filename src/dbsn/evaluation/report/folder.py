"""The report's folder: the report writes only files it made.

Every file the report writes is listed, with its sha256, in the folder's manifest (`MANIFEST`),
which is written before the first file and kept up to date as each is written. A report may write
into a folder that does not exist, an empty one, or one it made before whose files are its own
and unchanged: those are replaced, and the ones the new report does not write again are removed
(a section that has no runs now leaves no page of the last report). A folder holding anything
else (a file the manifest does not list, or one changed since the report wrote it) is refused in
one line before anything is read or written (`ReportFolder.check`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dbsn.evaluation.base import EvaluationError

__all__ = ["MANIFEST", "ReportError", "ReportFolder"]

#: the list of files a report wrote into its folder: {"written_by": "dbsn report", "files": {name: sha256}}
MANIFEST = "report_files.json"
_WRITER = "dbsn report"


class ReportError(EvaluationError):
    """The report cannot be written as asked: the message says what is wrong and how to fix it."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _listing(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


@dataclass
class ReportFolder:
    """The report's output folder; `choose`: how the caller's user picks another one (the end of
    a refusal, e.g. "choose a new folder with --out")."""

    path: Path
    choose: str = "choose a new or empty folder"
    previous: dict[str, str | None] = field(default_factory=dict)  # the last report's files, by name
    written: dict[str, str | None] = field(default_factory=dict)  # this report's, by name (None: being written)

    def check(self) -> ReportFolder:
        """Refuse, naming the files, a folder that holds anything this report did not write."""
        out = Path(self.path)
        if out.exists() and not out.is_dir():
            raise ReportError(f"{out} is a file, not a folder: the report writes a folder of files; {self.choose}.")
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if not entries:
            return self
        manifest = self._manifest()
        if manifest is None:
            raise ReportError(
                f"{out} holds files the report did not write ({_listing(entries)}): the report never "
                f"writes over them; {self.choose}."
            )
        files = manifest["files"]
        foreign = [name for name in entries if name != MANIFEST and name not in files]
        if foreign:
            raise ReportError(
                f"{out} holds files the report did not write ({_listing(foreign)}) beside an earlier "
                f"report: the report never writes over them; move them away, or {self.choose}."
            )
        changed = [
            name
            for name in entries
            if name != MANIFEST
            and files.get(name) is not None
            and ((out / name).is_dir() or _sha256(out / name) != files[name])
        ]
        if changed:
            raise ReportError(
                f"{out} holds an earlier report whose files were changed since it wrote them "
                f"({_listing(changed)}): the report never writes over them; move them away, or "
                f"{self.choose}."
            )
        self.previous = {name: files[name] for name in entries if name in files}
        return self

    def _manifest(self) -> dict | None:
        try:
            found = json.loads((Path(self.path) / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if (
            not isinstance(found, dict)
            or found.get("written_by") != _WRITER
            or not isinstance(found.get("files"), dict)
        ):
            return None
        return found

    def begin(self) -> None:
        """Make the folder and write the manifest, listing the last report's files still there."""
        Path(self.path).mkdir(parents=True, exist_ok=True)
        self._save()

    def claim(self, name: str) -> None:
        """List `name` before it is written (a report stopped mid-file leaves it listed)."""
        self.written[name] = None
        self._save()

    def record(self, path: Path) -> None:
        """List the written file `path` with its digest."""
        path = Path(path)
        if path.is_file():
            self.written[path.name] = _sha256(path)
            self._save()

    def finish(self) -> None:
        """Remove the last report's files this one did not write again; the manifest lists this report's."""
        for name in sorted(set(self.previous) - set(self.written)):
            (Path(self.path) / name).unlink(missing_ok=True)
        self.previous = {}
        self._save()

    def _save(self) -> None:
        files = {**self.previous, **self.written}
        path = Path(self.path) / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"written_by": _WRITER, "files": dict(sorted(files.items()))}, indent=1) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
