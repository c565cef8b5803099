"""File helpers every command shares: free disk space, the one crash-safe writer, the one file
hasher, JSON bytes, and byte counts (and durations) for people. Standard library only."""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

HASH_WINDOW = 64 * 1024 * 1024  # bytes hashed per mmap window; bounds resident memory while hashing


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


_TEMP_SUFFIX = re.compile(r"\.tmp-(\d+)(?:-\d+)?$")


def temp_writer_pid(path: Path) -> int | None:
    """The pid of the process that named ``path`` through :func:`temp_path` (None when the name
    is not a temp name)."""
    match = _TEMP_SUFFIX.search(path.name)
    return int(match.group(1)) if match else None


def fsync_dir(path: Path) -> None:
    """Make the names in ``path`` durable (a rename or a new entry survives a power loss only once
    its folder is synced). A file system that cannot sync folders is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose new folders are durable: each one created is synced into its parent."""
    missing = []
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        fsync_dir(folder.parent)


def write_atomic(final: Path, chunks: Iterable[bytes | memoryview]) -> tuple[str, int]:
    """Write ``chunks`` to ``final`` through a temp file, fsync, rename, fsync the folder; returns
    (sha256, bytes).

    A reader sees the old file or the whole new one, never a part. Raises OSError; the temp file
    is removed on any failure.
    """
    make_dirs(final.parent)
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
            crash_point()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    crash_point()
    fsync_dir(final.parent)
    return digest.hexdigest(), total


class HashLike(Protocol):
    """What :func:`sha256_file` feeds: any ``hashlib`` object."""

    def update(self, data: bytes | memoryview | mmap.mmap, /) -> None: ...


def sha256_file(path: Path, *also: HashLike) -> str:
    """sha256 of a file, hashed straight from the page cache through mmap windows: no copy into
    user memory, and resident memory bounded by one window. Each digest in ``also`` is fed the same
    bytes in the same pass (a caller that needs a second hash of the file reads it once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, HASH_WINDOW):
            length = min(HASH_WINDOW, size - offset)
            with mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=offset) as window:
                digest.update(window)
                for other in also:
                    other.update(window)
    return digest.hexdigest()


CRASH_AT_ENV = "PREPKIT_TEST_CRASH_AT"
STEP_DELAY_ENV = "PREPKIT_TEST_STEP_DELAY"
_crash_steps = itertools.count(1)


def crash_point() -> None:
    """Test hook, called before and after each write and rename of an output file. With
    ``PREPKIT_TEST_CRASH_AT=N`` set, the process SIGKILLs itself at the N-th call, so a test can kill
    a run at every step; ``PREPKIT_TEST_STEP_DELAY=S`` sleeps S seconds at each call, so a test can
    catch a run in the middle. Unset, it does nothing."""
    delay = os.environ.get(STEP_DELAY_ENV)
    if delay:
        time.sleep(float(delay))
    at = os.environ.get(CRASH_AT_ENV)
    if at and next(_crash_steps) == int(at):
        os.kill(os.getpid(), signal.SIGKILL)


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


def format_duration(seconds: float) -> str:
    """A duration for people: ``45 s``, ``12 min``, ``3 h 05 min``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
