"""Benchmark of the decode projections (prepkit.kernels.decode.gemv) against torch's F.linear path.

    python benchmarks/bench_decode_ops.py [--shapes qkv,o,router,lm_head] [--formats bf16,mxfp8,mxfp4]
        [--batches 1,4] [--calls 50] [--rounds 10] [--no-sweep] [--sweep-limit 24] [--variants NAME,...]
        [--apart] [--out PATH] [--tiny]

Each gpt-oss projection of a decode step runs as the op the step uses: qkv (N 5120, K 2880) and
lm_head (N 201088, K 2880) as ``norm_linear`` with the residual add (qkv with a bias), the router
(N 128, K 2880) as ``norm_linear`` handing the normed rows on, o (N 2880, K 4096) as
``linear_residual``. Per shape, weight format and rows: median µs per call (one CUDA graph of
``--calls`` calls cycling through enough weight copies that each call reads its weight from
memory, median over ``--rounds`` replays), the bytes a call moves (weight, scales, activations,
outputs) as GB/s and as a share of the device-to-device copy bandwidth measured in the same run;
the same op in torch (the eager modules' norm and add around ``F.linear`` on the bf16 weight,
MX weights dequantized to bf16) and ``F.linear`` alone; the relative error against the torch
reference; and, unless ``--no-sweep``, the fastest of the registered candidates (up to
``--sweep-limit``, the default first), or the variants ``--variants`` names (``n16-k512-w4-s1-p2``:
rows, K step, warps, K splits, stages). Each row's ``timed`` maps every variant timed to its µs.
``--out`` writes the rows as JSON.

Calls of one op back to back flatter a launch whose programs take more than one wave: with
programmatic dependent launch the next call's programs start on the SMs the last wave leaves idle.
In the decode step a small kernel follows each projection instead. ``--apart`` times every call
with a one-value kernel outside the chain after it (its own time, measured alone, taken off), so
a launch's last wave runs in the open as it does there.

Without CUDA (``TRITON_INTERPRET=1``) it runs tiny shapes on the CPU interpreter with wall-clock
timing: a smoke test of the script, not a measurement. ``--tiny`` does the same on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.kernels.decode import gemv  # noqa: E402
from prepkit.kernels.decode.gemv_registry import (  # noqa: E402
    EPS,
    linear_residual_reference,
    norm_linear_reference,
    relative_error,
)
from prepkit.kernels.decode.variants import KERNELS, DecodeProblem, DecodeVariant  # noqa: E402
from prepkit.kernels.mx.dense import DenseMxWeights  # noqa: E402
from prepkit.layouts import dense_mx  # noqa: E402
from prepkit.tune.decode_bench import separator  # noqa: E402
from prepkit.tune.dense_bench import weight_copies  # noqa: E402

# name -> (op, N, K, extras of the op's problem: which optional operands the step passes)
SHAPES: dict[str, tuple[str, int, int, tuple[tuple[str, int], ...]]] = {
    "qkv": ("norm_linear", 5120, 2880, (("add", 1), ("bias", 1), ("normed", 0))),
    "o": ("linear_residual", 2880, 4096, (("bias", 1),)),
    "router": ("norm_linear", 128, 2880, (("add", 1), ("bias", 1), ("normed", 1))),
    "lm_head": ("norm_linear", 201088, 2880, (("add", 1), ("bias", 0), ("normed", 0))),
}
TINY = {"qkv": (40, 96), "o": (24, 64), "router": (8, 96), "lm_head": (72, 96)}
FORMATS = ("bf16", "mxfp8", "mxfp4")


def synth_weight(n: int, k: int, fmt: str, g: torch.Generator, device: torch.device) -> gemv.Weight:
    """A random weight made on ``device``: bf16 values, or MX codes with gpt-oss-like scales."""
    if fmt == "bf16":
        return (torch.randn((n, k), generator=g, device=device) * 0.02).to(torch.bfloat16)
    f = dense_mx.mx_format(fmt)
    codes = torch.randint(0, 16 if fmt == "mxfp4" else 256, (n, k), generator=g, device=device, dtype=torch.uint8)
    if fmt == "mxfp8":
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)  # no NaN codes
    scales = torch.randint(119, 124 if fmt == "mxfp4" else 121, (k // 32, n), generator=g, device=device)
    return DenseMxWeights(dense_mx.codes_to_panels(codes, f), scales.to(torch.uint8), fmt)


def clone_weight(w: gemv.Weight) -> gemv.Weight:
    if isinstance(w, torch.Tensor):
        return w.clone()
    return DenseMxWeights(w.blocks.clone(), w.scales.clone(), w.fmt)


def weight_bytes(w: gemv.Weight) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.blocks.numel() + w.scales.numel()


def bf16_weight(w: gemv.Weight) -> torch.Tensor:
    """The weight as bf16 ``[N, K]`` (what torch's path multiplies)."""
    if isinstance(w, torch.Tensor):
        return w
    return dense_mx.dequantize_kernel_layout(w.blocks, w.scales, dense_mx.mx_format(w.fmt)).to(torch.bfloat16)


def make_inputs(op: str, extras: dict[str, int], n: int, k: int, batch: int, weight: gemv.Weight) -> dict[str, Any]:
    """The op's arguments around ``weight``: random rows, never zeros."""
    device = weight.device if isinstance(weight, torch.Tensor) else weight.blocks.device
    g = torch.Generator(device=device).manual_seed(batch)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device).to(dtype)

    bias = randn(n) * 0.1 if extras.get("bias", 1) else None
    if op == "linear_residual":
        return {"x": randn(batch, k), "weight": weight, "bias": bias, "residual": randn(batch, n)}
    return {
        "hidden": randn(batch, k),
        "add": randn(batch, k, dtype=torch.float32) if extras.get("add", 1) else None,
        "norm_weight": (torch.rand(k, generator=g, device=device) + 0.5).to(torch.bfloat16),
        "eps": EPS,
        "weight": weight,
        "bias": bias,
        "want_normed": bool(extras.get("normed", 0)),
    }


def torch_op(op: str, inputs: dict[str, Any], w16: torch.Tensor) -> Any:
    """The op as the eager modules run it: torch's norm and adds around ``F.linear`` on ``w16``."""
    args = dict(inputs, weight=w16)
    if op == "linear_residual":
        return args["residual"] + torch.nn.functional.linear(args["x"], w16, args["bias"])
    hidden, add = args["hidden"], args["add"]
    summed = hidden if add is None else hidden + add.to(torch.bfloat16)
    x = summed.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args["eps"])
    normed = (args["norm_weight"] * x).to(torch.bfloat16)
    return summed, torch.nn.functional.linear(normed, w16, args["bias"]), normed


def moved_bytes(inputs: dict[str, Any], outputs: Any) -> int:
    """Bytes a call reads and writes: every tensor argument (the weight's blocks and scales) and output."""
    total = 0
    for v in list(inputs.values()) + list(outputs if isinstance(outputs, tuple) else (outputs,)):
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, DenseMxWeights):
            total += weight_bytes(v)
    return total


class Timer:
    """Median µs per call: a CUDA graph of the calls (GPU), or wall clock (the CPU interpreter)."""

    def __init__(self, cuda: bool, rounds: int) -> None:
        self.cuda, self.rounds = cuda, rounds

    def per_call_us(self, calls: list[Callable[[], object]]) -> float:
        if not self.cuda:
            times = []
            for _ in range(self.rounds):
                start = time.perf_counter()
                for fn in calls:
                    fn()
                times.append((time.perf_counter() - start) / len(calls))
            return statistics.median(times) * 1e6
        from benchmarks.bench_kernel import events_median

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls[:2]:  # compile and warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        return events_median(graph.replay, iters=self.rounds, warmup=2) * 1e3 / len(calls)

    def copy_gbs(self, device: torch.device, nbytes: int) -> float:
        """Device-to-device copy, GB/s counting bytes read plus bytes written."""
        if self.cuda:
            from benchmarks.bench_kernel import copy_bandwidth

            return copy_bandwidth(device, nbytes)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        us = self.per_call_us([lambda: dst.copy_(src)])
        return 2 * nbytes / us / 1e3


def per_call_us(timer: Timer, calls: list[Callable[[], object]], apart: Callable[[], object] | None) -> float:
    """Median us per call of ``calls``; with ``apart``, each call followed by it, less its own
    time measured in a graph of its own."""
    if apart is None:
        return timer.per_call_us(calls)
    both = timer.per_call_us([c for call in calls for c in (call, apart)]) * 2
    return both - timer.per_call_us([apart] * len(calls))


def rotated_calls(
    fn: Callable[[dict[str, Any]], object], inputs: dict[str, Any], weights: list[Any], calls: int
) -> list[Callable[[], object]]:
    """``calls`` calls of ``fn``, call i on weight copy ``i % len(weights)``."""
    sets = [dict(inputs, weight=weights[i % len(weights)]) for i in range(calls)]
    return [functools.partial(fn, s) for s in sets]


def programs(n: int, variant: DecodeVariant) -> int:
    """Programs one launch of ``variant`` runs over ``n`` output rows."""
    blocks, splits = gemv.launch_grid(n, variant)
    return blocks * splits


def run_case(
    name: str, fmt: str, batch: int, n: int, k: int, timer: Timer, args: argparse.Namespace, copy_gbs: float,
    device: torch.device, log: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    op, _, _, extras_t = SHAPES[name]
    extras = dict(extras_t)
    g = torch.Generator(device=device).manual_seed(0)
    weight = synth_weight(n, k, fmt, g, device)
    copies = weight_copies(weight_bytes(weight)) if timer.cuda else 1
    weights = [weight] + [clone_weight(weight) for _ in range(copies - 1)]
    w16 = bf16_weight(weight)
    w16s = [w16] + [w16.clone() for _ in range(weight_copies(weight_bytes(w16)) - 1 if timer.cuda else 0)]
    inputs = make_inputs(op, extras, n, k, batch, weight)
    impl = KERNELS[op]
    problem = DecodeProblem(op, n, k, batch, fmt, extras_t)
    default = impl.default(problem)
    launch = gemv.norm_linear if op == "norm_linear" else gemv.linear_residual
    reference = norm_linear_reference if op == "norm_linear" else linear_residual_reference

    def kernel(v: DecodeVariant) -> Callable[[dict[str, Any]], object]:
        return lambda s: launch(**s, variant=v)

    apart = separator(device) if args.apart else None
    out = kernel(default)(inputs)
    err = relative_error(out, reference(**inputs))
    moved = moved_bytes(inputs, out)
    us = per_call_us(timer, rotated_calls(kernel(default), inputs, weights, args.calls), apart)
    torch_calls = rotated_calls(lambda s: torch_op(op, s, s["weight"]), inputs, w16s, args.calls)
    torch_us = per_call_us(timer, torch_calls, apart)
    x = inputs["x"] if op == "linear_residual" else inputs["hidden"]
    linear_moved = weight_bytes(w16) + 2 * batch * (k + n)  # the bf16 weight, x and the output
    linear_calls = rotated_calls(
        lambda s: torch.nn.functional.linear(x, s["weight"], s["bias"]), inputs, w16s, args.calls
    )
    linear_us = per_call_us(timer, linear_calls, apart)
    row: dict[str, Any] = {
        "shape": name, "op": op, "n": n, "k": k, "batch": batch, "weights": fmt, "variant": default.name(),
        "programs": programs(n, default), "apart": args.apart,
        "us": us, "gbs": moved / us / 1e3, "copy_frac": moved / us / 1e3 / copy_gbs, "moved_bytes": moved,
        "rel_err": err, "torch_us": torch_us, "torch_linear_us": linear_us,
        "torch_linear_copy_frac": linear_moved / linear_us / 1e3 / copy_gbs,
    }  # fmt: skip
    timed = {default.name(): us}
    row["timed"] = timed
    if not args.no_sweep:
        best, best_us = default, us
        cands = args.variants or impl.candidates(problem)[: args.sweep_limit]
        if timer.cuda:
            from benchmarks.bench_kernel import precompile

            precompile([functools.partial(kernel(v), inputs) for v in cands])
        for v in cands:
            if v == default:
                continue
            try:
                v_us = per_call_us(timer, rotated_calls(kernel(v), inputs, weights, max(args.calls // 2, 1)), apart)
            except Exception as exc:  # a variant that fails to compile or run here is reported and skipped
                log(f"    {v.name()}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
                continue
            timed[v.name()] = v_us
            if v_us < best_us:
                best, best_us = v, v_us
        best_err = relative_error(kernel(best)(inputs), reference(**inputs))
        row.update(
            best_variant=best.name(), best_programs=programs(n, best), best_us=best_us,
            best_copy_frac=moved / best_us / 1e3 / copy_gbs,
            best_rel_err=best_err,
        )  # fmt: skip
    log(
        f"{name:8s} B={batch} {fmt:5s} {op:15s} {default.name():18s} ({row['programs']} programs) {us:9.1f} us "
        f"{row['gbs']:7.0f} GB/s "
        f"({100 * row['copy_frac']:5.1f}% copy) err {err:.1e} | torch {torch_us:.1f} us, F.linear {linear_us:.1f} us "
        f"({100 * row['torch_linear_copy_frac']:.1f}% copy)"
        + (
            f" | best {row['best_variant']} ({row['best_programs']}) {row['best_us']:.1f} us"
            if "best_us" in row
            else ""
        )
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--calls", type=int, default=50, help="calls per CUDA graph")
    parser.add_argument("--rounds", type=int, default=10, help="graph replays; the median is reported")
    parser.add_argument("--no-sweep", action="store_true", help="time the default variant only")
    parser.add_argument("--sweep-limit", type=int, default=24, help="most candidates timed per case")
    parser.add_argument("--variants", help="time these variants (comma-separated names) instead of the candidates")
    parser.add_argument(
        "--apart", action="store_true", help="a small kernel outside the launch chain after every call (as in the step)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--out", help="write the rows as JSON to this path")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_decode_ops needs a CUDA device, or TRITON_INTERPRET=1 for a CPU smoke run", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    unknown = [s for s in names if s not in SHAPES] + [f for f in formats if f not in FORMATS]
    if unknown:
        print(f"unknown shapes or formats: {unknown}", file=sys.stderr)
        return 2
    try:
        args.variants = [DecodeVariant.parse(v.strip()) for v in (args.variants or "").split(",") if v.strip()]
    except ValueError as err:
        print(f"--variants: {err}", file=sys.stderr)
        return 2
    tiny = args.tiny or not cuda
    if not cuda:
        args.calls, args.rounds = min(args.calls, 2), min(args.rounds, 2)
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda, args.rounds)

    def log(msg: str) -> None:
        print(msg, flush=True)

    name_of_device = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    copy_gbs = timer.copy_gbs(device, 2**30 if cuda else 2**24)
    log(f"{name_of_device}: copy {copy_gbs:.0f} GB/s" + (" (tiny shapes: a smoke test)" if tiny else ""))
    rows = []
    for name in names:
        n, k = TINY[name] if tiny else SHAPES[name][1:3]
        for fmt in formats:
            for batch in batches:
                rows.append(run_case(name, fmt, batch, n, k, timer, args, copy_gbs, device, log))
                if cuda:
                    torch.cuda.empty_cache()
    log(
        "| shape | op | B | weights | variant | µs | GB/s | % copy BW | torch µs | F.linear µs | F.linear % copy "
        "| best variant | best µs | best % copy |"
    )
    log("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        best = (
            f"{r['best_variant']} | {r['best_us']:.1f} | {100 * r['best_copy_frac']:.1f}"
            if "best_us" in r
            else "- | - | -"
        )
        log(
            f"| {r['shape']} | {r['op']} | {r['batch']} | {r['weights']} | {r['variant']} | {r['us']:.1f} | "
            f"{r['gbs']:.0f} | {100 * r['copy_frac']:.1f} | {r['torch_us']:.1f} | {r['torch_linear_us']:.1f} | "
            f"{100 * r['torch_linear_copy_frac']:.1f} | {best} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": name_of_device, "copy_gbs": copy_gbs, "tiny": tiny, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
