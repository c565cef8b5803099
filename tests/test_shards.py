from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prepkit import fsutil, shards


@pytest.mark.parametrize("size", [0, 1, mmap.ALLOCATIONGRANULARITY, 3 * mmap.ALLOCATIONGRANULARITY + 17])
def test_sha256_file_equals_hashlib_across_windows(tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsutil, "HASH_WINDOW", mmap.ALLOCATIONGRANULARITY)
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    # a second digest fed in the same pass sees every byte too (fetch's git blob id)
    blob = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    assert fsutil.sha256_file(path, blob) == hashlib.sha256(data).hexdigest()
    want_blob = hashlib.sha1(f"blob {size}\0".encode() + data, usedforsecurity=False)
    assert blob.hexdigest() == want_blob.hexdigest()


def test_streamed_safetensors_read_back_equal_and_hash_matches(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.u8": torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8, generator=g),
        "a.f32": torch.randn(4, 3, generator=g),
        "c.bf16": torch.randn(6, generator=g).to(torch.bfloat16),
    }
    written = shards.write_safetensors(tmp_path, "x/t.safetensors", tensors, {"k": "v"})
    path = tmp_path / "x" / "t.safetensors"
    back = load_file(str(path))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    assert written.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert written.bytes == path.stat().st_size
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert (8 + header_len) % 8 == 0 and header["__metadata__"] == {"k": "v"}
    assert not list(tmp_path.glob("**/*.tmp-*"))
