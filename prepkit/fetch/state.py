"""The resume state of a fetch (``.cache/prepkit/fetch-state.json`` in its target folder): the plan
of the latest fetch and every file verified since, so a rerun never hashes a file twice."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prepkit.fetch.cache import STATE_PATH
from prepkit.fetch.hashing import Digest, hash_matches
from prepkit.fetch.source import RemoteFile, Source
from prepkit.fsutil import write_json_atomic

logger = logging.getLogger(__name__)

STATE_FORMAT = "prepkit-fetch-state/1"


@dataclass
class FetchState:
    """The plan of the latest fetch into a folder and what has been verified since; rewritten after
    every verified file, so an interrupted run loses no verification work."""

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
        path = dest / STATE_PATH
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != STATE_FORMAT:
                return None
            return cls(
                dest=dest,
                repo_id=raw["repo_id"],
                revision=raw["revision"],
                commit=raw["commit"],
                include_original=bool(raw.get("include_original")),
                files=[RemoteFile.from_json(f) for f in raw["files"]],
                verified=dict(raw.get("verified", {})),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("ignoring unreadable %s", path)
            return None

    def matches(self, source: Source) -> bool:
        return self.repo_id == source.repo_id and source.revision in (self.revision, self.commit)

    def is_verified(self, remote: RemoteFile, st: os.stat_result) -> bool:
        entry = self.verified.get(remote.path)
        if not entry or entry.get("size") != st.st_size or entry.get("mtime_ns") != st.st_mtime_ns:
            return False
        return hash_matches(remote, entry.get("sha256"), entry.get("git_blob"))

    def mark(self, remote: RemoteFile, digest: Digest, st: os.stat_result) -> None:
        with self.lock:
            self.verified[remote.path] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "sha256": digest.sha256,
                "git_blob": digest.git_blob,
            }
            self.save()

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
