"""File helpers every writing command shares: free disk space, crash-safe writes, JSON bytes, and
byte counts for people. Standard library only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def free_bytes(path: Path) -> int:
    """Bytes free to this user on the file system that holds ``path`` (or would hold it, when the
    folder does not exist yet: its nearest existing parent is asked)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def temp_path(final: Path) -> Path:
    """Where ``final`` is written before it is renamed into place: unique to the process and
    thread, and matched by ``*.tmp-*`` so a killed run's leftovers are easy to find."""
    return final.with_name(f"{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def write_atomic(final: Path, chunks: Iterable[bytes | memoryview]) -> tuple[str, int]:
    """Write ``chunks`` to ``final`` through a temp file, fsync, rename; returns (sha256, bytes).

    A reader sees the old file or the whole new one, never a part. Raises OSError; the temp file
    is removed on any failure.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final)
    digest = hashlib.sha256()
    total = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
                total += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest(), total


def json_bytes(payload: Any, *, sort_keys: bool = True) -> bytes:
    """The one JSON spelling of prepkit's files: two-space indent, a final newline, and sorted keys
    (so the bytes, and their hash, depend on the content alone)."""
    return (json.dumps(payload, indent=2, sort_keys=sort_keys) + "\n").encode()


def write_json_atomic(path: Path, payload: Any, *, sort_keys: bool = True) -> tuple[str, int]:
    """:func:`json_bytes` written by :func:`write_atomic`; returns (sha256, bytes)."""
    return write_atomic(path, [json_bytes(payload, sort_keys=sort_keys)])


def format_bytes(n: float) -> str:
    """A byte count for people: ``512 B``, ``28.4 MiB``, ``75.0 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
