"""The loaders' arguments, checked before any shard file is opened, each refusal naming the
argument and what it may be: a wrong value then reads as a wrong value, not as a damaged folder."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from prepkit.errors import DeviceError, LayoutError, RecipeError


def _index(value: Any) -> int | None:
    """``value`` as an int when it is one (numpy and 0-d torch ints too), else None: a bool, a
    float such as ``1.0`` or a string is not an index."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_rank(rank: Any) -> int:
    """``rank`` as an int. Whether the shard set holds it is the manifest's to say.

    Raises:
        RecipeError: not an int (a bool or a float such as ``1.0`` is refused, not rounded).
    """
    index = _index(rank)
    if index is None:
        raise RecipeError(f"rank: expected an int, got {rank!r} ({type(rank).__name__})")
    return index


def check_layer_list(layers: Any) -> list[int] | None:
    """``layers`` as a list of ints (None: every layer). Whether they exist is :func:`check_layers_in`'s.

    Raises:
        RecipeError: not a list (or tuple, range) of ints.
    """
    if layers is None:
        return None
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
        raise RecipeError(
            f"layers: expected a list of layer indexes such as [0, 1], got {layers!r} ({type(layers).__name__})"
        )
    out = []
    for item in layers:
        index = _index(item)
        if index is None:
            raise RecipeError(f"layers: expected ints, got {item!r} ({type(item).__name__}) in {list(layers)!r}")
        out.append(index)
    return out


def check_layers_in(layers: list[int], num_layers: int, where: str) -> None:
    """Refuse a layer index the shard set at ``where`` does not have.

    Raises:
        LayoutError: naming the first such layer and the valid range.
    """
    for index in layers:
        if not 0 <= index < num_layers:
            raise LayoutError(
                f"layers: layer {index} does not exist: {where} holds {num_layers} layers (0..{num_layers - 1})"
            )


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
