"""How many GPU kernels one captured decode step launches, counted by the profiler.

A batch-1 decode step is a chain of small launches; the gaps between them cost time of their own,
so the count is reported next to the step's speed. Per layer it is the slope of two counts at
different layer counts (the embedding, head and sampler are a fixed part).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepKernels:
    """What one step put on the GPU: kernels, and memory operations (graph memset/memcpy nodes)."""

    kernels: int
    memory_ops: int
    names: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"kernels": self.kernels, "memory_ops": self.memory_ops}


def count_kernels(run: Callable[[], None], device: torch.device) -> StepKernels | None:
    """The kernels ``run`` (e.g. one graph replay) launches on ``device``; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    memory = [n for n in names if n.startswith(("Memcpy", "Memset"))]
    kernels = tuple(n for n in names if not n.startswith(("Memcpy", "Memset")))
    return StepKernels(len(kernels), len(memory), kernels)


def per_layer(counts: dict[int, int]) -> float | None:
    """Kernels per layer from step counts at two or more layer counts (their least-squares slope)."""
    if len(counts) < 2:
        return None
    xs, ys = list(counts), [float(v) for v in counts.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
