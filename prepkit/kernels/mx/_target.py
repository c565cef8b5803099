"""Where a launch runs: the one place the kernels' launchers read the device and the interpreter.

Two launch decisions depend on the GPU (programmatic dependent launch and the tensor memory
accelerator, both sm_90 and newer) and two on whether Triton interprets on the CPU (fp32 dots, no
inline PTX). Both questions are answered here, so an ahead-of-time compile
(:mod:`prepkit.kernels.compile_check`) can stand in a target GPU with :func:`pinned_capability`
while the tensors live on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

Capability = tuple[int, int]

# Set while an ahead-of-time compile decides launches as on a GPU of this capability.
_pinned: contextvars.ContextVar[Capability | None] = contextvars.ContextVar("prepkit_moe_target", default=None)


def interpreting() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter. The interpreter computes bf16 dots
    wrongly (torch CPU + numpy), so dots run in fp32 there, and it cannot run inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_capability(device: torch.device) -> Capability | None:
    """(major, minor) of the CUDA device a launch on ``device`` runs on, ``None`` off CUDA; the
    pinned capability for every device inside :func:`pinned_capability`."""
    pinned = _pinned.get()
    if pinned is not None:
        return pinned
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index or 0)


def current_stream(device: torch.device) -> int:
    """The raw handle of the current CUDA stream of ``device`` (what Triton launches on)."""
    return torch._C._cuda_getCurrentRawStream(device.index or 0)


def stream_key(device: torch.device) -> tuple[str, int, int]:
    """What keys per-stream buffers: the device and, on CUDA, its current stream (elsewhere one
    stream: the interpreter runs launches in order)."""
    stream = current_stream(device) if device.type == "cuda" else 0
    return device.type, device.index or 0, stream


@contextlib.contextmanager
def pinned_capability(capability: Capability) -> Iterator[None]:
    """Inside the block every launch decides as on a CUDA device of ``capability``, whatever device
    its tensors live on: for compiling ahead of time for a GPU this machine does not have."""
    token = _pinned.set(capability)
    try:
        yield
    finally:
        _pinned.reset(token)


@functools.cache
def _cuda_capability(device_index: int) -> Capability:
    return torch.cuda.get_device_capability(device_index)
