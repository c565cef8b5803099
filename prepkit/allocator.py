"""Keep freed memory in the C heap for the length of a run, then give glibc its defaults back.

The streaming pass allocates the same tensor sizes for every chunk. glibc serves blocks above its
mmap threshold from fresh mmaps, whose pages the kernel faults in and zeroes on every use.
Raising the threshold (and the trim threshold, so the heap is not handed back between chunks)
lets every chunk reuse the last one's memory.

glibc has no call that reads these settings back, so leaving the scope writes glibc's documented
defaults (128 KiB each), or the values set through the ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` environment variables when the process was started with them. One
difference remains: glibc starts with a threshold that moves up as large blocks are freed, and no
call turns that back on once a value was set, so a fixed threshold takes its place.
Other C libraries are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterator

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (glibc malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_FREED = {M_MMAP_THRESHOLD: 32 * 1024 * 1024, M_TRIM_THRESHOLD: 1024 * 1024 * 1024}
GLIBC_DEFAULT = 128 * 1024  # both thresholds
_ENV = {M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}

Mallopt = Callable[[int, int], int]

_lock = threading.Lock()
_active = 0  # runs inside the scope now: the settings are restored when the last one leaves


def glibc_mallopt() -> Mallopt | None:
    """glibc's ``mallopt``, or None under another C library."""
    try:
        mallopt: Mallopt = ctypes.CDLL("libc.so.6").mallopt
        return mallopt
    except (OSError, AttributeError):
        return None


def restored_value(param: int) -> int:
    """What leaving the scope sets ``param`` to: the environment's value if given, else glibc's default."""
    raw = os.environ.get(_ENV[param], "")
    return int(raw) if raw.isdigit() else GLIBC_DEFAULT


@contextlib.contextmanager
def keep_freed_memory(mallopt: Mallopt | None = None) -> Iterator[bool]:
    """Within the block, freed blocks of up to 32 MiB stay in the heap. Yields whether the setting
    took effect (False under a C library other than glibc). Nested and concurrent scopes share
    one setting, restored when the last of them ends."""
    global _active
    mallopt = mallopt or glibc_mallopt()
    if mallopt is None:
        yield False
        return
    with _lock:
        if _active == 0:
            for param, value in KEEP_FREED.items():
                mallopt(param, value)
        _active += 1
    try:
        yield True
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                for param in KEEP_FREED:
                    mallopt(param, restored_value(param))
