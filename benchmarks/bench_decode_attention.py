"""Benchmark of the decode step's attention: the one-launch kernel against the step's torch path.

    python benchmarks/bench_decode_attention.py [--batches 1,4] [--positions 128,1024,4096]
        [--cache-len 8192] [--windows 0,128] [--dims 64,8,64] [--calls 50] [--sweep] [--json [PATH]]

Per batch, window (0: full attention) and position: median µs per call of
:func:`~prepkit.kernels.decode.attention.rope_cache_attend` (its default variant; with ``--sweep``
also every candidate, the fastest printed) and of the decode step's torch path (rotary,
``index_copy_``, the additive mask over the whole cache, ``attend``), each timed as a CUDA graph of
``--calls`` calls over enough copies of the caches that the slots a call reads come from memory,
not L2. ``read GB/s``: the bytes of the cache slots in use (keys and values) per call over the
kernel's time. ``err``: the kernel's largest difference from the torch path, relative to its
largest output. Without CUDA (e.g. ``TRITON_INTERPRET=1`` on the CPU) it runs each call a few
times untimed-quality, for a smoke check of the code path: use tiny ``--dims`` and ``--cache-len``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.kernels.decode.attention import rope_cache_attend  # noqa: E402
from prepkit.kernels.decode.attention_variants import (  # noqa: E402
    INPUT_NAMES,
    ROPE_CACHE_ATTEND,
    decode_step_attend,
    random_inputs,
)
from prepkit.kernels.decode.problems import attention_problem  # noqa: E402
from prepkit.kernels.decode.variants import DecodeVariant  # noqa: E402

# Enough bytes of slots in use over the copies of the caches that a graph of calls reads memory:
# several times an H100's 50 MB L2. At most this many bytes of cache copies in all.
ROTATION_BYTES = 256 * 2**20
MAX_COPY_BYTES = 8 * 2**30


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def time_us(calls: list[Callable[[], object]], cuda: bool, replays: int = 20) -> float:
    """Median µs per call: one CUDA graph runs every call of ``calls`` once (on the CPU: wall time
    of running them, only a smoke check)."""
    if not cuda:
        start = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    from benchmarks.bench_kernel import events_median

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile, allocate workspaces and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: its workspaces serve the capture
        for fn in calls:
            fn()
    return events_median(graph.replay, iters=replays, warmup=3) * 1e3 / len(calls)


def slots_read(batch: int, position: int, window: int | None) -> int:
    """Cache slots a call reads over all rows (no padding: each row from its first slot in use)."""
    lo = max(0, position - window + 1) if window else 0
    return batch * (position - lo + 1)


class Case:
    """One benchmark point's inputs, with the caches in as many copies as rotation needs."""

    def __init__(
        self, dims: tuple[int, int, int], batch: int, cache_len: int, position: int, window: int | None, calls: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        heads, kv_heads, head_dim = dims
        self.batch, self.position, self.window = batch, position, window
        self.base = random_inputs(
            batch, heads, kv_heads, head_dim, cache_len, position, [0] * batch, window, device, seed=position
        )
        self.read_bytes = slots_read(batch, position, window) * kv_heads * head_dim * 2 * 2
        cache_bytes = 2 * self.base["keys"].numel() * 2
        copies = min(calls, -(-ROTATION_BYTES // self.read_bytes), max(1, MAX_COPY_BYTES // cache_bytes))
        if device.type != "cuda":
            copies = 1
        self.copies = [self.base] + [self._copy() for _ in range(copies - 1)]
        self.calls = calls if device.type == "cuda" else 2

    def _copy(self) -> dict[str, Any]:
        return {**self.base, "keys": self.base["keys"].clone(), "values": self.base["values"].clone()}

    def rotation(self, fn: Callable[[dict[str, Any]], object]) -> list[Callable[[], object]]:
        return [partial(fn, self.copies[i % len(self.copies)]) for i in range(self.calls)]


def kernel_call(variant: DecodeVariant | None) -> Callable[[dict[str, Any]], torch.Tensor]:
    return lambda inputs: rope_cache_attend(**{n: inputs[n] for n in INPUT_NAMES}, variant=variant)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def run_case(case: Case, dims: tuple[int, int, int], cache_len: int, sweep: bool, cuda: bool) -> dict[str, Any]:
    heads, kv_heads, head_dim = dims
    problem = attention_problem(case.batch, heads, kv_heads, head_dim, case.position + 1, case.window, cache_len)
    default = ROPE_CACHE_ATTEND.default(problem)
    check = {**case.base, "keys": case.base["keys"].clone(), "values": case.base["values"].clone()}
    err = rel_err(kernel_call(default)(case._copy()), decode_step_attend(check))
    row: dict[str, Any] = {
        "batch": case.batch, "window": case.window or 0, "position": case.position, "cache_len": cache_len,
        "read_bytes": case.read_bytes, "variant": default.name(), "err": err,
        "kernel_us": time_us(case.rotation(kernel_call(default)), cuda),
        "torch_us": time_us(case.rotation(decode_step_attend), cuda),
    }  # fmt: skip
    if sweep:
        best = min(
            ((time_us(case.rotation(kernel_call(v)), cuda), v) for v in ROPE_CACHE_ATTEND.candidates(problem)),
            key=lambda tv: tv[0],
        )
        row["best_us"], row["best_variant"] = best[0], best[1].name()
    return row


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = ("B", "window", "pos", "slots KiB", "kernel us", "read GB/s", "torch us", "speedup", "err", "variant")
    table: list[tuple[str, ...]] = [head]
    for r in rows:
        line: tuple[str, ...] = (
            str(r["batch"]), str(r["window"] or "-"), str(r["position"]), f"{r['read_bytes'] / 2**10:.1f}",
            f"{r['kernel_us']:.1f}", f"{r['read_bytes'] / r['kernel_us'] / 1e3:.0f}", f"{r['torch_us']:.1f}",
            f"{r['torch_us'] / r['kernel_us']:.1f}x", f"{r['err']:.1e}", r["variant"],
        )  # fmt: skip
        if "best_us" in r:
            line = (*line, f"best {r['best_us']:.1f} us {r['best_variant']}")
        table.append(line)
    widths = [max(len(row[i]) for row in table if i < len(row)) for i in range(max(map(len, table)))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=ints, default=[1, 4])
    p.add_argument("--positions", type=ints, default=[128, 1024, 4096])
    p.add_argument("--cache-len", type=int, default=8192)
    p.add_argument("--windows", type=ints, default=[128, 0], help="sliding windows, 0 for full attention")
    p.add_argument("--dims", type=ints, default=[64, 8, 64], help="query heads, kv heads, head size")
    p.add_argument("--calls", type=int, default=50, help="calls per CUDA graph")
    p.add_argument("--sweep", action="store_true", help="also time every candidate variant")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the rows as JSON (stdout without a path)")
    args = p.parse_args(argv)
    if len(args.dims) != 3:
        p.error("--dims takes three numbers: query heads, kv heads, head size")
    dims = (args.dims[0], args.dims[1], args.dims[2])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}", file=sys.stderr)
    else:
        print("no CUDA: CPU run, times are not meaningful (a smoke check)", file=sys.stderr)
    rows = []
    for window in args.windows:
        for batch in args.batches:
            for position in args.positions:
                if position >= args.cache_len:
                    p.error(f"--positions: {position} is past the cache ({args.cache_len} slots)")
                case = Case(dims, batch, args.cache_len, position, window or None, args.calls, device)
                rows.append(run_case(case, dims, args.cache_len, args.sweep, cuda))
                print(f"done B={batch} window {window or '-'} position {position}", file=sys.stderr)
    if args.json == "-":
        print(json.dumps(rows, indent=1))
    else:
        print(format_rows(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
