"""The sha256 record, ``prepkit-fetch.json``: written once every file is verified, cited by ``prepare``.
While a fetch runs, the record of the files verified so far is its resume state: a rerun hashes no
file twice (an unchanged size and mtime tell it was not touched since)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from prepkit.constants import FETCH_RECORD
from prepkit.errors import FetchError
from prepkit.fetch.source import RemoteFile, Source
from prepkit.fsutil import sha256_file, write_json_atomic

RECORD_FORMAT = "prepkit-fetch/1"
STATE_PATH = Path(".cache") / "prepkit" / "fetch-state.json"


@dataclass(frozen=True)
class RecordFile:
    path: str
    size: int
    sha256: str
    lfs: bool
    git_blob: str | None = None  # small files only: their id on the hub
    mtime_ns: int | None = None

    def matches(self, remote: RemoteFile) -> bool:
        """The bytes the hub lists, by the hash it gives (sha256 for LFS files, else the git blob id)."""
        if self.size != remote.size:
            return False
        return self.sha256 == remote.sha256 if remote.sha256 else remote.git_blob in (None, self.git_blob)


@dataclass(frozen=True)
class FetchRecord:
    path: Path
    repo_id: str
    revision: str
    commit: str
    endpoint: str
    recipe: str | None
    include_original: bool
    fetched_at: str
    prepkit_version: str
    entries: tuple[RecordFile, ...]

    @property
    def files(self) -> list[RemoteFile]:
        return [RemoteFile(e.path, e.size, e.sha256 if e.lfs else None, e.git_blob) for e in self.entries]

    def matches(self, source: Source) -> bool:
        return self.repo_id == source.repo_id and source.revision in (self.revision, self.commit)

    def save(self) -> None:
        head = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("path", "entries")}
        files = [{k: v for k, v in asdict(e).items() if v is not None} for e in self.entries]
        total = sum(e.size for e in self.entries)
        write_json_atomic(self.path, {"format": RECORD_FORMAT, **head, "total_bytes": total, "files": files})


def read_record(path: Path) -> FetchRecord | None:
    """The record at ``path``; None when there is none, FetchError when it is not one."""
    hint = "run `prepkit fetch` again to rewrite it"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise FetchError(f"{path} is unreadable: {err}", hint=hint) from err
    try:
        if raw.get("format") != RECORD_FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, expected {RECORD_FORMAT!r}")
        known = {f.name for f in fields(RecordFile)}
        entries = tuple(RecordFile(**{k: v for k, v in f.items() if k in known}) for f in raw["files"])
        head = {f.name: raw.get(f.name) for f in fields(FetchRecord) if f.name not in ("path", "entries")}
        if not all(isinstance(head[k], str) for k in ("repo_id", "revision", "commit")):
            raise ValueError("repo_id, revision and commit must be strings")
        return FetchRecord(path=path, **head, entries=entries)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise FetchError(f"{path} is not a prepkit fetch record: {err}", hint=hint) from err


def read_fetch_record(model_dir: str | Path) -> FetchRecord | None:
    """The record of a folder a fetch completed, or None."""
    return read_record(Path(model_dir) / FETCH_RECORD)


def verify_file(dest: Path, remote: RemoteFile) -> RecordFile | None:
    """Hash the file in one read (with its git blob id, for a small one): its entry when it matches."""
    path = dest / remote.path
    try:
        st = path.stat()
        if st.st_size != remote.size:
            return None
        blob = None if remote.sha256 else hashlib.sha1(f"blob {st.st_size}\0".encode(), usedforsecurity=False)
        sha256 = sha256_file(path, *([blob] if blob else []))
    except FileNotFoundError:
        return None
    git_blob = blob.hexdigest() if blob else None
    entry = RecordFile(remote.path, st.st_size, sha256, bool(remote.sha256), git_blob, st.st_mtime_ns)
    return entry if entry.matches(remote) else None
