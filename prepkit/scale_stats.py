"""Which E8M0 scale bytes a gpt-oss checkpoint holds, read without its weights.

The bundled kernel folds its upcast fix-up into the scale multiply when every E8M0 byte of a GEMM's
scales is at most 128 (scales <= 2; :func:`prepkit.kernels.mx.launch.upcast_id`). Whether the real
checkpoint qualifies is answered here from a shard's safetensors header and then only the byte
ranges of its ``*_scales`` tensors, read from a local file or from the hub by HTTP range requests
(a few hundred MB of a 4.8 GB shard), so no full download is needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from prepkit.checkpoint import MAX_HEADER_BYTES, check_safetensors_header
from prepkit.constants import INDEX_NAME
from prepkit.errors import CheckpointError, FetchError

SMALL_SCALE_MAX = 128  # the largest E8M0 byte (2^1) the folded upcast handles
SCALES_SUFFIX = "_scales"
# The expert roles (prepkit.layouts.base.SOURCE_ROLES) whose scales feed each GEMM of the kernel.
GEMM_OF_ROLE = {"gate_up_proj_scales": "gemm1", "down_proj_scales": "gemm2"}
CHUNK_BYTES = 16 * 1024 * 1024  # bytes per read: bounds memory and the size of one range request
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RangeReader(Protocol):
    """A file read by byte ranges: a local file, or a hub file through HTTP range requests."""

    @property
    def name(self) -> str:
        """How errors name the file."""
        ...

    @property
    def size(self) -> int: ...

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset`` (a CheckpointError naming the file if it ends sooner)."""
        ...


class LocalFile:
    """A local file read with ``pread``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = self.path.name
        try:
            self.size = self.path.stat().st_size
        except OSError as err:
            raise CheckpointError(f"{self.path}: cannot read ({err.strerror})") from err

    def read(self, offset: int, length: int) -> bytes:
        parts, done = [], 0
        try:
            with self.path.open("rb") as f:
                while done < length:
                    part = os.pread(f.fileno(), length - done, offset + done)
                    if not part:
                        break
                    parts.append(part)
                    done += len(part)
        except OSError as err:
            raise CheckpointError(f"{self.name}: cannot read ({err.strerror})") from err
        if done < length:
            raise CheckpointError(
                f"{self.name}: ends at byte {offset + done}, before {offset + length}", hint="re-download it"
            )
        return b"".join(parts)


class HubFile:
    """A file of a hub repo at one revision, read by HTTP range requests through huggingface_hub's
    ``HfFileSystem`` (which handles the token, the endpoint and the LFS redirect)."""

    def __init__(self, hub: HubRepo, filename: str) -> None:
        self.hub, self.filename = hub, filename
        self.name = f"{hub.repo_id}/{filename}"
        with hub.errors(filename):
            # No read-ahead: each read is one request for exactly the bytes asked for.
            self._file = hub.fs.open(self.name, "rb", revision=hub.revision, cache_type="none")
            self.size = int(self._file.size)

    def read(self, offset: int, length: int) -> bytes:
        with self.hub.errors(self.filename):
            self._file.seek(offset)
            data = bytes(self._file.read(length))
        if len(data) != length:  # a server that ignores the range answers with the whole file
            raise FetchError(
                f"{self.name}: asked {self.hub.endpoint} for {length} bytes at {offset}, got {len(data)}",
                hint="the server does not honour HTTP range requests; download the shard and pass its folder",
            )
        return data


class HubRepo:
    """One hub repo at one revision: its file list and :class:`HubFile` readers."""

    def __init__(self, repo_id: str, revision: str, *, endpoint: str | None = None, token: Any = None) -> None:
        from huggingface_hub import HfFileSystem

        self.repo_id, self.revision = repo_id, revision
        self.fs = HfFileSystem(endpoint=endpoint, token=token)
        self.endpoint = str(self.fs.endpoint).rstrip("/")

    def top_files(self) -> list[str]:
        """The names of the files at the repo's top level."""
        with self.errors(None):
            entries = self.fs.ls(self.repo_id, revision=self.revision, detail=True)
        files = [e for e in entries if isinstance(e, dict) and e.get("type") == "file"]
        return sorted(str(e["name"]).rsplit("/", 1)[-1] for e in files)

    def open(self, filename: str) -> HubFile:
        return HubFile(self, filename)

    @contextlib.contextmanager
    def errors(self, filename: str | None) -> Iterator[None]:
        """huggingface_hub's and the network's errors as FetchErrors naming the repo and file."""
        import httpx2

        from prepkit.fetch.hub import hub_errors
        from prepkit.fetch.source import Source

        what = f"{self.repo_id}/{filename}" if filename else self.repo_id
        with hub_errors(Source(self.repo_id, self.revision), self.endpoint, filename=filename):
            try:
                yield
            except FileNotFoundError as err:  # HfFileSystem's answer to a missing repo, revision or file
                raise FetchError(
                    f"{what} not found at revision {self.revision} on {self.endpoint}",
                    hint="check the repo id and the revision; if the repo is private or gated, set HF_TOKEN",
                ) from err
            except (httpx2.ConnectError, httpx2.TimeoutException) as err:  # hub_errors' hint is fetch's
                raise FetchError(
                    f"cannot reach {self.endpoint} for {what}: {err}",
                    hint="check the network and HF_ENDPOINT, or download the shards and read the local folder",
                ) from err


@dataclass(frozen=True)
class ScaleStats:
    """The E8M0 bytes of one ``*_scales`` tensor."""

    file: str
    tensor: str
    shape: tuple[int, ...]
    histogram: tuple[int, ...]  # 256 counts, one per byte value
    layer: int | None  # the decoder layer the name says, if any
    gemm: str | None  # "gemm1" (gate_up) or "gemm2" (down); None for other scales

    @property
    def count(self) -> int:
        return sum(self.histogram)

    @property
    def min(self) -> int | None:
        return next((b for b, n in enumerate(self.histogram) if n), None)

    @property
    def max(self) -> int | None:
        return next((255 - i for i, n in enumerate(reversed(self.histogram)) if n), None)

    @property
    def above(self) -> int:
        """Bytes above :data:`SMALL_SCALE_MAX` (scales > 2)."""
        return sum(self.histogram[SMALL_SCALE_MAX + 1 :])

    @property
    def small(self) -> bool:
        """Every byte is at most 128: the folded upcast applies (an empty tensor does not qualify,
        as :func:`prepkit.runtime.moe.scales_are_small` says)."""
        return self.count > 0 and self.above == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "tensor": self.tensor,
            "shape": list(self.shape),
            "layer": self.layer,
            "gemm": self.gemm,
            "count": self.count,
            "min": self.min,
            "max": self.max,
            "above_128": self.above,
            "small": self.small,
            "histogram": {str(b): n for b, n in enumerate(self.histogram) if n},
        }


def read_header(reader: RangeReader) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``reader`` and its data section's start, reading only the header.

    Raises:
        CheckpointError: the file is shorter than its header says, or the header is malformed
            (the message names the file).
    """
    if reader.size < 8:
        raise CheckpointError(f"{reader.name}: file is {reader.size} bytes, too short to be safetensors")
    (header_len,) = struct.unpack("<Q", reader.read(0, 8))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > reader.size:
        raise CheckpointError(
            f"{reader.name}: header length {header_len} does not fit a {reader.size}-byte file",
            hint="the file is truncated or not safetensors",
        )
    try:
        header = json.loads(reader.read(8, header_len))
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{reader.name}: header is not valid JSON") from err
    end = check_safetensors_header(reader.name, header)
    if 8 + header_len + end > reader.size:
        raise CheckpointError(
            f"{reader.name}: truncated: holds {reader.size} bytes, its header needs {8 + header_len + end}"
        )
    return header, 8 + header_len


def scale_tensors(header: Mapping[str, Any]) -> list[str]:
    """The names of the ``*_scales`` tensors of a safetensors header, in file order."""
    names = [n for n in header if n != "__metadata__" and n.endswith(SCALES_SUFFIX)]
    return sorted(names, key=lambda n: int(header[n]["data_offsets"][0]))


def scale_stats(
    reader: RangeReader, *, chunk_bytes: int = CHUNK_BYTES, on_tensor: Callable[[str, int], None] | None = None
) -> list[ScaleStats]:
    """Per ``*_scales`` tensor of one safetensors file: the histogram of its bytes. Reads the header
    and the scale tensors' bytes only, ``chunk_bytes`` at a time; ``on_tensor(name, nbytes)`` is
    told before each tensor is read.

    Raises:
        CheckpointError: a malformed or truncated file, or a scales tensor that is not U8 (named).
        FetchError: a hub read failed.
    """
    header, data_start = read_header(reader)
    out = []
    for name in scale_tensors(header):
        info = header[name]
        if info["dtype"] != "U8":
            raise CheckpointError(f"{reader.name}: {name} has dtype {info['dtype']}, E8M0 scales are U8")
        lo, hi = info["data_offsets"]
        if on_tensor:
            on_tensor(name, hi - lo)
        counts = np.zeros(256, dtype=np.int64)
        for start in range(lo, hi, chunk_bytes):
            data = reader.read(data_start + start, min(chunk_bytes, hi - start))
            counts += np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
        role = name.rsplit(".", 1)[-1]
        match = _LAYER.search(name)
        layer = int(match.group(1)) if match else None
        hist = tuple(int(n) for n in counts)
        out.append(ScaleStats(reader.name, name, tuple(info["shape"]), hist, layer, GEMM_OF_ROLE.get(role)))
    return out


def folded_everywhere(stats: Iterable[ScaleStats]) -> bool:
    """Whether every expert GEMM's scales among ``stats`` are small (False when there are none)."""
    experts = [s for s in stats if s.gemm is not None]
    return bool(experts) and all(s.small for s in experts)


@dataclass(frozen=True)
class ShardSet:
    """The safetensors shards of a checkpoint (a local folder or file, or a hub repo)."""

    where: str  # the folder, file or ``repo@revision``, for messages
    shards: tuple[str, ...]
    index: Mapping[str, Any] | None  # model.safetensors.index.json, where there is one
    opener: Callable[[str], RangeReader]

    def open(self, shard: str) -> RangeReader:
        return self.opener(shard)

    def default_shard(self) -> str:
        """The first shard the index says holds expert scales (the first shard without an index)."""
        weight_map = (self.index or {}).get("weight_map") or {}
        holding = sorted({f for n, f in weight_map.items() if n.rsplit(".", 1)[-1] in GEMM_OF_ROLE})
        return holding[0] if holding else self.shards[0]

    def pick(self, names: Iterable[str] = (), *, every: bool = False) -> list[str]:
        """``names`` (each checked), every shard, or the default one.

        Raises:
            CheckpointError: a name that is not one of the shards.
        """
        names = list(names)
        if unknown := [n for n in names if n not in self.shards]:
            raise CheckpointError(
                f"{self.where} has no shard {', '.join(unknown)}", hint=f"its shards: {', '.join(self.shards)}"
            )
        return list(self.shards) if every else names or [self.default_shard()]


def local_shards(path: str | Path) -> ShardSet:
    """The shards of a local checkpoint folder (by its index, else its ``.safetensors`` files), or
    one ``.safetensors`` file.

    Raises:
        CheckpointError: no such file or folder, a malformed index, or no shards.
    """
    root = Path(path)
    if root.is_file():
        return ShardSet(str(root), (root.name,), None, lambda name: LocalFile(root))
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such file or folder")
    index = _read_index(LocalFile(root / INDEX_NAME)) if (root / INDEX_NAME).is_file() else None
    names = [p.name for p in root.iterdir() if p.is_file()]
    return ShardSet(str(root), _shard_names(index, names, str(root)), index, lambda name: LocalFile(root / name))


def hub_shards(repo_id: str, revision: str, *, endpoint: str | None = None, token: Any = None) -> ShardSet:
    """The shards of a hub repo at ``revision``: the top-level file list and the index only.

    Raises:
        FetchError: the hub cannot be reached, or the repo, revision or a file is not there.
        CheckpointError: a malformed index, or no shards.
    """
    repo = HubRepo(repo_id, revision, endpoint=endpoint, token=token)
    names = repo.top_files()
    index = _read_index(repo.open(INDEX_NAME)) if INDEX_NAME in names else None
    where = f"{repo_id}@{revision}"
    return ShardSet(where, _shard_names(index, names, where), index, repo.open)


def _shard_names(index: Mapping[str, Any] | None, names: Iterable[str], where: str) -> tuple[str, ...]:
    if index is not None:
        weight_map = index.get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(f, str) for f in weight_map.values())
        ):
            raise CheckpointError(f"{where}: {INDEX_NAME} has no weight_map of tensor names to files")
        return tuple(sorted(set(weight_map.values())))
    shards = tuple(sorted(n for n in names if n.endswith(".safetensors")))
    if not shards:
        raise CheckpointError(f"{where} holds no .safetensors file")
    return shards


def _read_index(reader: RangeReader) -> dict[str, Any]:
    try:
        value = json.loads(reader.read(0, reader.size))
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{reader.name} is not valid JSON") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{reader.name} must hold a JSON object")
    return value


def folded_upcast(model: Any) -> dict[str, Any]:
    """Which loaded MoE layers have small scales (every E8M0 byte <= 128) for GEMM1 and GEMM2, so
    that the kernel runs its folded upcast there (with a variant whose upcast is ``asm``).

    ``model``: a transformers model whose decoder layers' ``mlp.moe_layer`` are
    :class:`~prepkit.runtime.moe.MoeLayer`, or a mapping of layer index to MoeLayer (as
    :func:`~prepkit.runtime.moe.load_moe_layers` returns). Reads the flags the layers computed at load.
    """
    if isinstance(model, Mapping):
        layers = sorted(model.items())
    else:
        decoder = getattr(getattr(model, "model", model), "layers", [])
        found = ((i, getattr(getattr(layer, "mlp", None), "moe_layer", None)) for i, layer in enumerate(decoder))
        layers = [(i, moe) for i, moe in found if moe is not None]
    wide: dict[str, list[int]] = {"gemm1": [], "gemm2": []}
    for index, moe in layers:
        for gemm, small in zip(("gemm1", "gemm2"), moe.small_scales, strict=True):
            if not small:
                wide[gemm].append(index)
    return {
        "layers": len(layers),
        "gemm1_small": len(layers) - len(wide["gemm1"]),
        "gemm2_small": len(layers) - len(wide["gemm2"]),
        "wide": wide,
        "every_gemm": bool(layers) and not wide["gemm1"] and not wide["gemm2"],
    }
