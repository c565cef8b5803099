from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from prepkit import allocator
from prepkit.allocator import GLIBC_DEFAULT, KEEP_FREED, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory


class FakeMallopt:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_settings_are_restored_on_exit_and_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    fake = FakeMallopt()
    with keep_freed_memory(fake) as active:
        assert active and fake.calls == list(KEEP_FREED.items())
    assert fake.calls[2:] == [(M_MMAP_THRESHOLD, GLIBC_DEFAULT), (M_TRIM_THRESHOLD, GLIBC_DEFAULT)]
    fake.calls.clear()
    with pytest.raises(RuntimeError), keep_freed_memory(fake):
        raise RuntimeError("a failed run")
    assert fake.calls[2:] == [(M_MMAP_THRESHOLD, GLIBC_DEFAULT), (M_TRIM_THRESHOLD, GLIBC_DEFAULT)]
    assert allocator._active == 0


def test_nested_scopes_restore_once_when_the_last_one_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the process was started with its own value
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    fake = FakeMallopt()
    with keep_freed_memory(fake):
        with keep_freed_memory(fake):
            pass
        assert fake.calls == list(KEEP_FREED.items())  # the inner scope neither set again nor restored
    assert fake.calls[2:] == [(M_MMAP_THRESHOLD, 65536), (M_TRIM_THRESHOLD, GLIBC_DEFAULT)]


# Run in a fresh interpreter: a heap that earlier tests left with large free chunks serves a new
# large block from one of them whatever the threshold, so the answer depends on the heap's history.
_MMAP_PROBE = """
import ctypes
from prepkit.allocator import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Mallinfo2
size = 4 * 1024 * 1024  # above glibc's default threshold, below the scope's

def regions_for_one_block():
    libc.malloc_trim(0)  # hand free heap memory back, so the block needs new memory from the OS
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    try:
        return libc.mallinfo2().hblks - before
    finally:
        libc.free(block)

with keep_freed_memory() as active:
    inside = regions_for_one_block()
print(active, inside, regions_for_one_block())
"""


def test_glibc_serves_large_blocks_from_the_heap_only_inside_the_scope() -> None:
    if allocator.glibc_mallopt() is None:
        pytest.skip("not glibc")
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    run = subprocess.run([sys.executable, "-c", _MMAP_PROBE], capture_output=True, text=True, env=env, check=True)
    active, inside, after = run.stdout.split()
    assert active == "True"
    assert inside == "0"  # from the heap inside the scope
    assert after == "1"  # a fresh mmap once glibc's defaults are back
