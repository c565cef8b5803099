"""File verification against the hub: one read gives a file's sha256 (the LFS oid, and what the
record cites) and, for a small file stored in git, its git blob sha1 (the oid the hub gives it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from prepkit.fetch.source import RemoteFile
from prepkit.fsutil import sha256_file


@dataclass(frozen=True)
class Digest:
    sha256: str
    git_blob: str | None  # only for files stored in git (small): their oid on the hub


def digest_file(path: Path, *, git_blob: bool) -> Digest:
    """One read of ``path``: its sha256 (the LFS oid, and what the record cites), and for a small
    file stored in git also its git blob sha1 (the oid the hub gives for it)."""
    if not git_blob:
        return Digest(sha256=sha256_file(path), git_blob=None)
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    return Digest(sha256=sha256_file(path, blob), git_blob=blob.hexdigest())


def hash_matches(remote: RemoteFile, sha256: str | None, git_blob: str | None) -> bool:
    if remote.sha256 is not None:
        return sha256 == remote.sha256
    if remote.git_blob is not None:
        return git_blob == remote.git_blob
    return sha256 is not None  # the hub gave no hash: the size check is all there is


class HashMismatch(Exception):
    """A file whose bytes do not hash to what the hub lists (after its retry, when online)."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(f"{path}: expected {expected}, got {actual}")
        self.path = path
