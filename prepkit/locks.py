"""One writer at a time: an exclusive lock file that a second process is refused at once, with
the pid of the holder in the message. Used for output folders, fetch folders and tactics DBs.

The lock is an advisory ``flock`` through ``filelock`` (it disappears with the process, so a killed
run never leaves a stale lock); the holder writes its pid into the lock file for the message.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import filelock

from prepkit.errors import PrepkitError

PROBE_GRACE_S = 0.1

ErrorT = TypeVar("ErrorT", bound=PrepkitError)


def busy_error(
    error: type[ErrorT], pid: int | None, *, command: str, target: Path | str, hint: str, detail: str = ""
) -> ErrorT:
    """The one spelling of "another process is writing this": which command holds ``target``, with
    its pid when the lock file names one. ``error`` keeps each caller's exit code."""
    holder = f" (pid {pid})" if pid else ""
    return error(f"another {command}{holder} is writing {target}{detail}", hint=hint)


def holder_pid(lock_path: Path) -> int | None:
    """The pid the holder wrote into the lock file, if it can be read."""
    try:
        return int(lock_path.read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def is_held(lock_path: Path) -> bool:
    """True when some process holds ``lock_path`` now. Writes and creates nothing (a dry run may ask)."""
    if not lock_path.is_file():
        return False
    lock = filelock.FileLock(str(lock_path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return True
    lock.release()
    return False


@contextmanager
def exclusive(
    lock_path: Path,
    *,
    busy: Callable[[int | None], PrepkitError],
) -> Iterator[None]:
    """Hold ``lock_path`` for the block; if another process holds it, raise ``busy(pid)`` at once.

    Raises:
        PrepkitError: whatever ``busy`` returns, when the lock is held elsewhere.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path), thread_local=False)
    try:
        # A moment's grace: an is_held() probe holds the lock for microseconds, and must not make
        # a starting run refuse itself.
        lock.acquire(timeout=PROBE_GRACE_S, poll_interval=0.01)
    except filelock.Timeout:
        raise busy(holder_pid(lock_path)) from None
    try:
        # filelock opens without truncating, so a refused contender never erases this pid
        try:
            with open(lock_path, "r+") as fh:
                fh.truncate(0)
                fh.write(f"{os.getpid()}\n")
        except OSError:  # a full disk: the pid only names the holder in a busy message
            pass
        yield
    finally:
        lock.release()
