"""Crash-safe output files under an output root: a streaming safetensors writer and the journal.

Every file goes through :func:`prepkit.fsutil.write_atomic` (temp name, fsync, rename, folder
fsync), and its sha256 is computed from the bytes as they are written (no second read). The
manifest is written last, so a folder without ``manifest.json`` is never mistaken for a finished
one; the journal, written first, marks the folder as prepkit's and records finished files so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prepkit.constants import JOURNAL_NAME
from prepkit.errors import OutputError
from prepkit.fsutil import HASH_WINDOW, crash_point, fsync_dir, json_bytes, make_dirs, sha256_file, write_atomic

ST_DTYPE = {
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.int64: "I64",
}


@dataclass(frozen=True)
class WrittenFile:
    path: str  # relative to the output root, POSIX separators
    sha256: str
    bytes: int


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def safetensors_header(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[str]]:
    """Header bytes (length prefix included) and the data order of a safetensors file.

    Larger element types first, then names: every tensor starts aligned to its element size,
    and the bytes depend on the tensors alone, so reruns are byte-identical.
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in ST_DTYPE:
            raise OutputError(f"{name}: dtype {t.dtype} cannot be stored")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-aligned
    return len(raw).to_bytes(8, "little") + raw, order


def write_output_file(root: Path, rel: str, chunks_fn: Any) -> WrittenFile:
    """Write ``chunks_fn()``'s byte chunks to ``root/rel`` with :func:`prepkit.fsutil.write_atomic`;
    returns the file named relative to ``root``. Raises OutputError (with the disk-full hint)."""
    final = root / rel
    try:
        sha256, total = write_atomic(final, chunks_fn())
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise OutputError(
                f"no space left on the device while writing {final}",
                hint="free disk space (prepare --dry-run shows the bytes needed) and rerun: finished files are kept",
            ) from err
        raise OutputError(f"cannot write {final}: {err.strerror}") from err
    return WrittenFile(rel, sha256, total)


def write_safetensors(
    root: Path, rel: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> WrittenFile:
    header, order = safetensors_header(tensors, metadata)

    def chunks() -> Any:
        yield header
        for name in order:
            data = _tensor_bytes(tensors[name])
            for start in range(0, len(data), HASH_WINDOW):
                yield data[start : start + HASH_WINDOW]

    return write_output_file(root, rel, chunks)


def write_output_json(root: Path, rel: str, payload: Any) -> WrittenFile:
    """:func:`prepkit.fsutil.json_bytes` of ``payload`` written by :func:`write_output_file`."""
    return write_output_file(root, rel, lambda: [json_bytes(payload)])


def link_or_copy(src: Path, dst: Path) -> str:
    """Share one file between rank folders: hard link, else relative symlink. Returns the method."""
    make_dirs(dst.parent)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        method = "hardlink"
    except OSError:
        os.symlink(os.path.relpath(src, dst.parent), dst)
        method = "symlink"
    crash_point()
    fsync_dir(dst.parent)
    return method


# --- journal ----------------------------------------------------------------------------------


@dataclass
class Journal:
    """Finished files of an interrupted run, valid only for the same plan fingerprint. ``plan``
    spells out what the fingerprint hashes (layout, options, split, sources), so a run of another
    plan can be told what differs."""

    root: Path
    fingerprint: str
    files: dict[str, WrittenFile] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path, fingerprint: str, plan: dict[str, Any] | None = None) -> Journal:
        path = root / JOURNAL_NAME
        journal = cls(root, fingerprint, plan=plan or {})
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
                if raw.get("fingerprint") == fingerprint:
                    for rel, info in raw.get("files", {}).items():
                        journal.files[rel] = WrittenFile(rel, str(info["sha256"]), int(info["bytes"]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                journal.files.clear()  # unreadable: start over, every file is rewritten
        return journal

    def is_done(self, rel: str) -> bool:
        """True when ``rel`` was finished by an earlier run and still has its recorded bytes."""
        entry = self.files.get(rel)
        if entry is None:
            return False
        path = self.root / rel
        try:
            if path.stat().st_size != entry.bytes:
                return False
        except OSError:
            return False
        return sha256_file(path) == entry.sha256

    def record(self, written: WrittenFile) -> None:
        self.files[written.path] = written
        self.save()

    def save(self) -> None:
        """Write the journal (atomically, folder synced). Saved before any output file, it is what
        makes a folder recognisably prepkit's from the first byte on."""
        payload = {
            "fingerprint": self.fingerprint,
            "plan": self.plan,
            "files": {k: {"sha256": v.sha256, "bytes": v.bytes} for k, v in sorted(self.files.items())},
        }
        write_output_json(self.root, JOURNAL_NAME, payload)

    def remove(self) -> None:
        (self.root / JOURNAL_NAME).unlink(missing_ok=True)
        fsync_dir(self.root)
