"""What a fetch has verified (``.cache/prepkit/fetch-state.json`` in its folder): the hub's file list
of the latest fetch and every file hashed since, so a rerun never hashes a file twice. One read of a
file gives its sha256 (the LFS oid, and what the record cites) and, for a small file stored in git,
its git blob sha1 (the oid the hub gives it)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prepkit.fetch.cache import STATE_PATH
from prepkit.fetch.source import RemoteFile, Source
from prepkit.fsutil import sha256_file, write_json_atomic

logger = logging.getLogger(__name__)

STATE_FORMAT = "prepkit-fetch-state/1"


def digest_file(path: Path, *, git_blob: bool) -> dict[str, str | None]:
    """sha256, and for a file stored in git its git blob id too, in one read."""
    if not git_blob:
        return {"sha256": sha256_file(path), "git_blob": None}
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    return {"sha256": sha256_file(path, blob), "git_blob": blob.hexdigest()}


def hash_matches(remote: RemoteFile, digest: dict[str, Any]) -> bool:
    if remote.sha256 is not None:
        return bool(digest.get("sha256") == remote.sha256)
    if remote.git_blob is not None:
        return bool(digest.get("git_blob") == remote.git_blob)
    return digest.get("sha256") is not None  # the hub gave no hash: the size check is all there is


@dataclass
class FetchState:
    dest: Path
    repo_id: str
    revision: str
    commit: str
    include_original: bool
    files: list[RemoteFile]
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, dest: Path) -> FetchState | None:
        try:
            raw = json.loads((dest / STATE_PATH).read_text())
            if raw.get("format") != STATE_FORMAT:
                return None
            files = [RemoteFile.from_json(f) for f in raw["files"]]
            keys = ("repo_id", "revision", "commit")
            return cls(dest, *(raw[k] for k in keys), bool(raw.get("include_original")), files, dict(raw["verified"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            logger.warning("ignoring unreadable %s", dest / STATE_PATH)
            return None

    def matches(self, source: Source) -> bool:
        return self.repo_id == source.repo_id and source.revision in (self.revision, self.commit)

    def is_verified(self, remote: RemoteFile) -> bool:
        """Hashed by an earlier run and not touched since (same size and mtime)."""
        entry = self.verified.get(remote.path)
        try:
            st = (self.dest / remote.path).stat()
        except OSError:
            return False
        same = entry is not None and (entry.get("size"), entry.get("mtime_ns")) == (st.st_size, st.st_mtime_ns)
        return same and st.st_size == remote.size and hash_matches(remote, entry or {})

    def check(self, remote: RemoteFile) -> bool:
        """Hash the file (when it has the hub's size) and record it when it matches the hub."""
        path = self.dest / remote.path
        try:
            st = path.stat()
            if st.st_size != remote.size:
                return False
            digest = digest_file(path, git_blob=remote.sha256 is None)
        except FileNotFoundError:
            return False
        if not hash_matches(remote, digest):
            return False
        with self.lock:
            self.verified[remote.path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, **digest}
            self.save()
        return True

    def save(self) -> None:
        payload = {
            "format": STATE_FORMAT,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "include_original": self.include_original,
            "files": [f.to_json() for f in self.files],
            "verified": self.verified,
        }
        write_json_atomic(self.dest / STATE_PATH, payload)
