"""The loaders' arguments, checked before any shard file is opened, each refusal naming the
argument and what it may be: a wrong value then reads as a wrong value, not as a damaged folder."""

from __future__ import annotations

from typing import Any

import torch

from prepkit.errors import DeviceError


def parse_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` this machine has.

    Raises:
        DeviceError: not a str or ``torch.device``, not a device torch knows, or CUDA asked where
            torch sees no CUDA device (or not that many).
    """
    if not isinstance(device, str | torch.device):
        raise DeviceError(
            f"device: expected a str or torch.device such as 'cuda' or 'cpu', got {device!r} ({type(device).__name__})"
        )
    try:
        target = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise DeviceError(
            f"device: {device!r} is not a torch device ({err})", hint="use 'cuda', 'cuda:N' or 'cpu'"
        ) from err
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device: {str(target)!r} was asked, but torch sees no CUDA device on this machine",
                hint="run on a machine with an NVIDIA GPU and a CUDA build of torch, or pass device='cpu'",
            )
        count = torch.cuda.device_count()
        if target.index is not None and target.index >= count:
            raise DeviceError(
                f"device: {str(target)!r} does not exist; torch sees {count} CUDA device(s)",
                hint=f"use cuda:0 .. cuda:{count - 1}",
            )
    return target
