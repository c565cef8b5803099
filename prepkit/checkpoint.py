"""Read a gpt-oss checkpoint lazily and validate all of it before any work starts.

Every tensor is resolved through ``model.safetensors.index.json`` (a layer's tensors straddle
shard files in the real checkpoint). Validation reads only the safetensors headers, so it is
cheap on 65 GB, and it reports every problem at once, naming file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prepkit.constants import INDEX_NAME
from prepkit.errors import CheckpointError
from prepkit.layouts.base import SOURCE_ROLES, ExpertWeights, ModelDims
from prepkit.recipes import SAFETENSORS_DTYPES, Recipe, check_config, model_dims, shape_of

SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: torch.dtype | None
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute file offset of the tensor's first byte


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header dict and the data section's start offset; raises CheckpointError, naming the
    file, when it is shorter than its header says (a truncated download) or the header is malformed."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"{path.name}: file is {size} bytes, too short to be safetensors", hint="re-download it"
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path.name}: header length {header_len} does not fit a {size}-byte file",
                    hint="the file is truncated or not safetensors; re-download it",
                )
            header = json.loads(f.read(header_len))
    except OSError as err:
        raise CheckpointError(f"{path.name}: cannot read ({err.strerror})") from err
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path.name}: header is not valid JSON", hint="re-download it") from err
    data_start = 8 + header_len
    end = check_safetensors_header(path.name, header)
    if data_start + end > size:
        raise CheckpointError(
            f"{path.name}: truncated: holds {size} bytes, its header needs {data_start + end}",
            hint="re-download it (prepkit fetch verifies sha256 and resumes)",
        )
    return header, data_start


def check_safetensors_header(file: str, header: Any) -> int:
    """Check every entry's dtype, shape and offsets (so reads by them cannot go astray); returns
    the data section's length. ``file`` is how errors name the file."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: malformed safetensors header: {why}", hint="re-download it")

    if not isinstance(header, dict):
        raise bad("not a JSON object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad(f"{name} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad(f"{name} has no dtype")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"{name} has shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(f"{name} has data_offsets {offsets!r}")
        known = SAFETENSORS_DTYPES.get(dtype)
        if known is not None:
            need = math.prod(shape) * known.itemsize
            if offsets[1] - offsets[0] != need:
                raise bad(
                    f"{name} ({dtype} {shape}) needs {need} bytes, its data_offsets span {offsets[1] - offsets[0]}"
                )
        end = max(end, offsets[1])
    return end


class Checkpoint:
    """A checkpoint folder: config, index, headers. Tensors are read on demand."""

    def __init__(self, root: str | Path, recipe: Recipe) -> None:
        self.root = Path(root)
        self.recipe = recipe
        if not self.root.is_dir():
            raise CheckpointError(
                f"checkpoint folder {self.root} does not exist",
                hint=f"download it first: prepkit fetch --model {recipe.name}",
            )
        self.config = self._read_json("config.json")
        problems = check_config(recipe, self.config, "config.json")
        if problems:
            raise CheckpointError(
                "the model is not a gpt-oss MXFP4 checkpoint:\n  " + "\n  ".join(problems),
                hint="point --src at a gpt-oss checkpoint (openai/gpt-oss-120b or -20b layout)",
            )
        self.dims: ModelDims = model_dims(self.config)
        self.weight_map = self._read_weight_map()
        self.entries: dict[str, TensorEntry] = {}
        self._fds: dict[str, int] = {}

    # --- index and headers ----------------------------------------------------------------

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self.root / name
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing", hint=f"download the model: prepkit fetch --model {self.recipe.name}"
            )
        try:
            value = json.loads(path.read_bytes())
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read ({err.strerror})") from err
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(value, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        return value

    def _read_weight_map(self) -> dict[str, str]:
        if (self.root / INDEX_NAME).is_file():
            index = self._read_json(INDEX_NAME)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{self.root / INDEX_NAME} has no weight_map")
            for name, file in weight_map.items():
                if not isinstance(file, str) or not file:
                    raise CheckpointError(f"{self.root / INDEX_NAME}: {name} maps to {file!r}, not a file name")
            return dict(weight_map)
        if (self.root / SINGLE_FILE).is_file():
            header, _ = read_safetensors_header(self.root / SINGLE_FILE)
            return {k: SINGLE_FILE for k in header if k != "__metadata__"}
        raise CheckpointError(
            f"{self.root} holds neither {INDEX_NAME} nor {SINGLE_FILE}",
            hint=f"download the model: prepkit fetch --model {self.recipe.name}",
        )

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        table: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for layer in range(self.dims.num_layers):
            for rules in (self.recipe.layer_tensors, self.recipe.expert_tensors):
                for rule in rules.values():
                    table[rule.name(layer)] = (shape_of(rule, self.config), rule.dtype)
        for rule in self.recipe.global_tensors.values():
            table[rule.name()] = (shape_of(rule, self.config), rule.dtype)
        return table

    def validate(self) -> None:
        """Check files, names, dtypes and shapes of every tensor; raise once with every problem."""
        problems: list[str] = []
        headers: dict[str, tuple[dict[str, Any], int]] = {}
        for file in self.files:
            path = self.root / file
            if not path.is_file():
                names = sorted(n for n, f in self.weight_map.items() if f == file)
                problems.append(f"{file}: missing ({INDEX_NAME} puts {len(names)} tensors there, e.g. {names[0]})")
                continue
            try:
                headers[file] = read_safetensors_header(path)
            except CheckpointError as err:
                problems.append(str(err))
        expected = self.expected_tensors()
        for name, (shape, dtype) in expected.items():
            listed = self.weight_map.get(name)
            if listed is None:
                problems.append(f"{name}: not in {INDEX_NAME}")
                continue
            file = listed
            if file not in headers:
                continue
            info = _stored(headers[file][0], name)
            if info is None:
                problems.append(f"{file}: {name} is listed in {INDEX_NAME} but not stored in the file")
                continue
            got_dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            got_shape = tuple(info["shape"])
            if got_dtype != dtype:
                problems.append(f"{file}: {name} has dtype {info['dtype']}, expected {_st_name(dtype)}")
            if got_shape != shape:
                problems.append(f"{file}: {name} has shape {list(got_shape)}, expected {list(shape)}")
            lo, hi = info["data_offsets"]
            self.entries[name] = TensorEntry(
                name, file, got_dtype, info["dtype"], got_shape, hi - lo, headers[file][1] + lo
            )
        for name, file in self.weight_map.items():
            if name in expected or file not in headers:
                continue
            info = _stored(headers[file][0], name)
            if info is None:
                # every listed tensor is read (the non-expert ones are carried over), so each must be there
                problems.append(f"{file}: {name} is listed in {INDEX_NAME} but not stored in the file")
            else:
                lo, hi = info["data_offsets"]
                self.entries[name] = TensorEntry(
                    name,
                    file,
                    SAFETENSORS_DTYPES.get(info["dtype"]),
                    info["dtype"],
                    tuple(info["shape"]),
                    hi - lo,
                    headers[file][1] + lo,
                )
        if problems:
            shown = problems[:50]
            more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
            raise CheckpointError(
                f"checkpoint {self.root} has {len(problems)} problem(s):\n  " + "\n  ".join(shown) + more,
                hint="re-download the files named above (prepkit fetch verifies every file)",
            )

    # --- reading --------------------------------------------------------------------------

    def _entry(self, name: str) -> TensorEntry:
        if not self.entries:
            self.validate()  # reads go by the offsets validation takes from the headers
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{name}: not in {INDEX_NAME}")
        if entry.dtype is None:
            raise CheckpointError(f"{entry.file}: {name} has dtype {entry.dtype_name}, which prepkit cannot read")
        return entry

    def read(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        if not entry.shape:  # a scalar: one "row" of one element
            return self.read_rows(name, 0, 1).reshape(())
        return self.read_rows(name, 0, entry.shape[0])

    def read_experts(self, layer: int) -> ExpertWeights:
        """All experts of one layer in checkpoint form (about 1.75 GB for gpt-oss-120b)."""
        return ExpertWeights(**{role: self.read(self.recipe.expert_name(layer, role)) for role in SOURCE_ROLES})

    def read_rows(self, name: str, lo: int, hi: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of dim 0 of a validated tensor with one ``pread``.

        Plain reads instead of mmap: the bytes land in memory we own and free, so resident memory
        stays at what the pipeline holds, not at every page of the shards it has touched.
        """
        entry = self._entry(name)
        row_bytes = entry.nbytes // max(entry.shape[0], 1) if entry.shape else entry.nbytes
        count = (hi - lo) * row_bytes
        # A caller streaming many chunks passes a reused buffer: fresh memory costs a page fault
        # per 4 KiB on first touch.
        if buffer is not None and buffer.numel() >= count and buffer.dtype == torch.uint8:
            out = buffer[:count]
        else:
            out = torch.empty(count, dtype=torch.uint8)
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(self.root / entry.file, os.O_RDONLY)
        view = out.numpy().data.cast("B") if count else memoryview(b"")
        done = 0
        try:
            while done < count:
                n = os.preadv(fd, [view[done:]], entry.offset + lo * row_bytes + done)
                if n == 0:
                    raise CheckpointError(f"{entry.file}: ends inside {name}", hint="re-download the file")
                done += n
        except OSError as err:
            raise CheckpointError(f"{entry.file}: cannot read {name}: {err}", hint="re-download the file") from err
        if entry.dtype is None:
            raise CheckpointError(f"{entry.file}: {name} has dtype {entry.dtype_name}, which torch cannot hold")
        return out.view(entry.dtype).reshape((hi - lo, *entry.shape[1:]))

    def read_experts_range(
        self, layer: int, lo: int, hi: int, buffers: dict[str, torch.Tensor] | None = None
    ) -> ExpertWeights:
        """Experts ``[lo, hi)`` of one layer, reading only their bytes (into ``buffers[role]``
        when given: the result then aliases them and is only valid until the next read)."""
        tensors = {}
        for role in SOURCE_ROLES:
            name = self.recipe.expert_name(layer, role)
            tensors[role] = self.read_rows(name, lo, hi, (buffers or {}).get(role))
        return ExpertWeights(**tensors)

    def expert_names(self, layer: int) -> list[str]:
        return [self.recipe.expert_name(layer, role) for role in SOURCE_ROLES]

    def non_expert_names(self) -> list[str]:
        experts = {n for layer in range(self.dims.num_layers) for n in self.expert_names(layer)}
        return sorted(n for n in self.weight_map if n not in experts)

    def source_files(self) -> Iterable[Path]:
        for name in ("config.json", INDEX_NAME, *self.files):
            path = self.root / name
            if path.is_file():
                yield path

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stored(header: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The header entry of tensor ``name`` (``__metadata__`` is not a tensor)."""
    return None if name == "__metadata__" else header.get(name)


def _st_name(dtype: torch.dtype) -> str:
    for k, v in SAFETENSORS_DTYPES.items():
        if v == dtype:
            return k
    return str(dtype)
