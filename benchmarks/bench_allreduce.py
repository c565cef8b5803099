"""Microseconds per all-reduce of the decode step's size (one row of gpt-oss's hidden size, 2,880
bf16 values), eager and inside a CUDA graph, for NCCL, torch's symmetric-memory one-shot
all-reduce and the project's one-kernel sum over symmetric memory (``lamport``), through the
collectives the model's ranks use (:mod:`prepkit.distributed.collectives`).

    torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py [--numel 2880] [--per-graph 72] [--json out.json]

The graph holds ``--per-graph`` all-reduces (72: two per layer of gpt-oss-120b's 36), replayed
``--replays`` times; its figure is the replay time over the all-reduces in it. Each transport's
sum is checked against the expected one before it is timed. The one-kernel sum is timed in the
graph alone: the collectives send its eager calls to NCCL, which launches faster. On the CPU
(gloo) only the eager figure is measured, as a smoke test of the script. Rank 0 prints one line
per transport and mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.distributed.collectives import Collectives  # noqa: E402
from prepkit.distributed.session import leave, start  # noqa: E402

HIDDEN = 2880  # gpt-oss's hidden size: one decode row's o-projection or MoE output


def check_sum(comm: Collectives, x: torch.Tensor) -> None:
    """The transport's sum against the expected one (each rank adds rank + 1): eagerly, and on CUDA
    inside a captured graph too (the one-kernel sum serves captured calls; eager ones go to NCCL)."""
    src = x * (comm.rank + 1)
    want = x.float() * sum(range(1, comm.world_size + 1))
    results = {"eager": comm.all_reduce(src)}
    if x.is_cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results["graph"] = comm.all_reduce(src)
        graph.replay()
        torch.cuda.synchronize()
    for mode, got in results.items():
        if not torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2):
            err = (got.float() - want).abs().max()
            raise SystemExit(f"{comm.transport} ({mode}): the all-reduce's sum is wrong (max error {err})")


def eager_us(comm: Collectives, x: torch.Tensor, iters: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(x.device)
        began = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x)
        sync(x.device)
        out.append((time.perf_counter() - began) / iters * 1e6)
    return out


def graph_us(comm: Collectives, x: torch.Tensor, per_graph: int, replays: int, repeats: int) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as capture asks
        for _ in range(3):
            comm.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            comm.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_evt.record()
        for _ in range(replays):
            graph.replay()
        end_evt.record()
        torch.cuda.synchronize()
        out.append(start_evt.elapsed_time(end_evt) * 1e3 / (replays * per_graph))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=HIDDEN)
    parser.add_argument("--per-graph", type=int, default=72)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda (nccl, symmetric memory) or cpu (gloo, eager)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file (rank 0)")
    args = parser.parse_args(argv)

    group = start(args.device)
    if group is None:
        raise SystemExit("start it with torchrun --nproc-per-node N (N >= 2)")
    device = group.device
    torch.manual_seed(0)  # the same input on every rank: the expected sum is known
    x = torch.randn(args.numel, device=device).to(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    kinds = [("nccl", False), ("symmetric", True), ("lamport", True)] if device.type == "cuda" else [("gloo", False)]
    for name, symmetric in kinds:
        comm = Collectives(device, symmetric=symmetric, kind=name if symmetric else None)
        if comm.transport != name:
            rows.append({"transport": name, "mode": "-", "us": None, "note": "unavailable here"})
            continue
        check_sum(comm, x)
        # The one-kernel sum's eager calls go to NCCL: only its graph figure is its own.
        modes = {"eager": eager_us(comm, x, args.iters, args.repeats)} if name != "lamport" else {}
        if device.type == "cuda":
            modes["graph"] = graph_us(comm, x, args.per_graph, args.replays, args.repeats)
        for mode, values in modes.items():
            rows.append({
                "transport": name, "mode": mode, "us": statistics.median(values), "min_us": min(values),
                "numel": args.numel, "ranks": group.world_size,
            })  # fmt: skip
    if group.rank == 0:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"all-reduce of {args.numel} bf16 values over {group.world_size} ranks ({device_name})")
        for row in rows:
            us = f"{row['us']:.2f} us (min {row['min_us']:.2f})" if row["us"] is not None else row["note"]
            print(f"  {row['transport']:<10} {row['mode']:<6} {us}")
        if args.json is not None:
            args.json.write_text(json.dumps({"device": device_name, "rows": rows}, indent=2) + "\n")
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
