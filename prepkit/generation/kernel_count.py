"""How many GPU kernels one captured decode step launches, counted by the profiler.

A batch-1 decode step is a chain of small launches; the gaps between them cost time of their own,
so the count is reported next to the step's speed. Per layer it is the slope of two counts at
different layer counts (the embedding, head and sampler are a fixed part).

Where the step's time goes is each kernel's share of the chain: how far its end moved the end of
everything before it. With programmatic dependent launch a kernel starts while the one before it
runs and waits, so its own start-to-end time counts that wait too; the shares add up to the
step's span instead.
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
    shares_us: tuple[float, ...] = ()  # per kernel of ``names``: its share of the chain (chain_shares)

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
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    memory = [e for e in events if e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    shares = chain_shares([(e.time_range.start, e.time_range.end) for e in kernels])
    return StepKernels(len(kernels), len(memory), tuple(e.name for e in kernels), tuple(shares))


def chain_shares(spans: list[tuple[float, float]]) -> list[float]:
    """Each ``(start, end)`` span's share of the chain, in the spans' order (by start): how far its
    end lies past the latest end before it; after an idle gap, its whole length (the gap belongs
    to no kernel). A span that ends before an earlier one gets 0."""
    shares: list[float] = []
    reached: float | None = None
    for start, end in spans:
        if reached is None or start >= reached:
            shares.append(end - start)
        else:
            shares.append(max(0.0, end - reached))
        reached = end if reached is None else max(reached, end)
    return shares


def per_layer(counts: dict[int, int]) -> float | None:
    """Kernels per layer from step counts at two or more layer counts (their least-squares slope)."""
    if len(counts) < 2:
        return None
    xs, ys = list(counts), [float(v) for v in counts.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
