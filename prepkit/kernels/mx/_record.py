"""Every kernel launch of the layer goes through :func:`launch`, so that a launch plan
(:mod:`prepkit.kernels.mx.plan`) can record what one call launched and replay it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Launch:
    """One launch as the launcher made it: the jit function, its grid, its arguments, and the
    compiled kernel Triton ran (``None`` in the interpreter)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    compiled: Any


@dataclass(frozen=True)
class Zeroing:
    """A tensor the launcher zeroed before the launches (atomics count into it)."""

    tensor: Any


_recording: contextvars.ContextVar[list[Launch | Zeroing] | None] = contextvars.ContextVar(
    "prepkit_moe_recording", default=None
)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``, recorded when a plan is being made."""
    compiled = kernel[grid](*args, **kwargs)
    steps = _recording.get()
    if steps is not None:
        steps.append(Launch(kernel, grid, args, kwargs, compiled))
    return compiled


def zero(tensor: Any) -> Any:
    """``tensor.zero_()``, recorded when a plan is being made."""
    tensor.zero_()
    steps = _recording.get()
    if steps is not None:
        steps.append(Zeroing(tensor))
    return tensor


@contextlib.contextmanager
def recording() -> Iterator[list[Launch | Zeroing]]:
    """Collect the launches and zeroings made inside the block, in order."""
    steps: list[Launch | Zeroing] = []
    token = _recording.set(steps)
    try:
        yield steps
    finally:
        _recording.reset(token)
