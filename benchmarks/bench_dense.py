"""Benchmark of the dense MX linear against cuBLAS bf16 at gpt-oss's dense shapes.

    python benchmarks/bench_dense.py [--tokens 1,2,4,8,64] [--shapes qkv,o,lm_head]
        [--formats mxfp8,mxfp4] [--activations bf16,mxfp8] [--sweep] [--json [PATH]]

Per shape (fused qkv N 5120 K 2880, o N 2880 K 4096, lm_head N 201088 K 2880) and token count:
median µs per call (CUDA graph over enough copies of the weights that each call reads its weight
from memory, not L2), the bytes a call must move (weight, scales, activations, output) as GB/s
and as a fraction of the device-to-device copy bandwidth measured in the same run, for
``F.linear`` on the bf16 weight and ``mx_linear`` on mxfp8 and mxfp4 weights with each listed
activation policy, each with its default variant. ``--sweep`` also times every variant of
``prepkit.kernels.variants.dense_sweep_space`` and prints the fastest per shape, tokens, format
and policy (what a default should become). ``--json`` writes the rows (to stdout without a path).
Weights are random codes with gpt-oss-like scales, made on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernel import copy_bandwidth, events_median, precompile  # noqa: E402
from prepkit.kernels.activations import check_policy  # noqa: E402
from prepkit.kernels.device import DeviceInfo  # noqa: E402
from prepkit.kernels.tactic import GemmTactic  # noqa: E402
from prepkit.kernels.variants import dense_invalid_reason, dense_sweep_space  # noqa: E402
from prepkit.layouts import dense_mx  # noqa: E402
from prepkit.tune.dense_bench import weight_copies  # noqa: E402

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096), "lm_head": (201088, 2880)}
TOKENS = (1, 2, 4, 8, 64)


def synth_mx(n: int, k: int, fmt: str, g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(blocks, scales)`` of random codes with scales near gpt-oss's (2^-8 .. 2^-4)."""
    f = dense_mx.mx_format(fmt)
    codes = torch.randint(0, 16 if fmt == "mxfp4" else 256, (n, k), generator=g, device=device, dtype=torch.uint8)
    if fmt == "mxfp8":
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)  # no NaN codes
    scales = torch.randint(119, 124 if fmt == "mxfp4" else 121, (k // 32, n), generator=g, device=device)
    return dense_mx.codes_to_panels(codes, f), scales.to(torch.uint8)


def graph_us(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median µs per call: one CUDA graph runs every call of ``calls`` once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return events_median(graph.replay, iters=replays, warmup=3) * 1e3 / len(calls)


class Shape:
    """One dense shape's weights in every format, in as many copies as rotation needs."""

    def __init__(self, name: str, n: int, k: int, formats: list[str], device: torch.device) -> None:
        from prepkit.kernels.mx import DenseMxWeights

        self.name, self.n, self.k = name, n, k
        g = torch.Generator(device=device).manual_seed(0)
        self.bias = (torch.randn(n, generator=g, device=device) * 0.1).to(torch.bfloat16)
        self.mx: dict[str, list[DenseMxWeights]] = {}
        self.bytes: dict[str, int] = {"bf16": n * k * 2}
        first = None
        for fmt in formats:
            blocks, scales = synth_mx(n, k, fmt, g, device)
            w = DenseMxWeights(blocks, scales, fmt)
            self.bytes[fmt] = blocks.numel() + scales.numel()
            copies = weight_copies(self.bytes[fmt])
            self.mx[fmt] = [w] + [DenseMxWeights(blocks.clone(), scales.clone(), fmt) for _ in range(copies - 1)]
            if first is None:
                first = dense_mx.dequantize_kernel_layout(blocks, scales, dense_mx.mx_format(fmt)).to(torch.bfloat16)
        dense = (
            first if first is not None else (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
        )
        copies = weight_copies(self.bytes["bf16"])
        self.bf16 = [dense] + [dense.clone() for _ in range(copies - 1)]

    def moved_bytes(self, kind: str, tokens: int) -> int:
        return self.bytes[kind] + tokens * (self.k + self.n) * 2


def time_cublas(shape: Shape, x: torch.Tensor) -> float:
    outs = [torch.empty((x.shape[0], shape.n), dtype=torch.bfloat16, device=x.device) for _ in shape.bf16]
    return graph_us(
        [lambda w=w, o=o: torch.addmm(shape.bias, x, w.t(), out=o) for w, o in zip(shape.bf16, outs, strict=True)]
    )


def time_mx(shape: Shape, fmt: str, x: torch.Tensor, activations: str, tactic: GemmTactic) -> float:
    from prepkit.kernels.mx import mx_linear

    outs = [torch.empty((x.shape[0], shape.n), dtype=torch.bfloat16, device=x.device) for _ in shape.mx[fmt]]
    return graph_us(
        [
            lambda w=w, o=o: mx_linear(x, w, shape.bias, activations=activations, tactic=tactic, out=o)  # type: ignore[arg-type]
            for w, o in zip(shape.mx[fmt], outs, strict=True)
        ]
    )


def check_once(shape: Shape, fmt: str, x: torch.Tensor, activations: str, tactic: GemmTactic) -> float:
    """Relative error of the kernel against the dequantized weight (activations quantized the same way)."""
    from prepkit.kernels.mx import mx_linear
    from prepkit.kernels.reference import dense_reference

    w = shape.mx[fmt][0]
    ref_w = dense_mx.dequantize_kernel_layout(w.blocks, w.scales, dense_mx.mx_format(fmt))
    ref = dense_reference(x, ref_w, shape.bias, activations)  # type: ignore[arg-type]
    y = mx_linear(x, w, shape.bias, activations=activations, tactic=tactic)  # type: ignore[arg-type]
    return float((y.float() - ref).abs().max() / ref.abs().max())


def sweep(
    shape: Shape, fmt: str, x: torch.Tensor, activations: str, info: DeviceInfo, log: Callable[[str], None]
) -> tuple[GemmTactic | None, float, int]:
    """(fastest variant, its µs, variants timed) of the sweep space at this shape and token count."""
    from prepkit.kernels.mx import mx_linear

    space = dense_sweep_space(fmt, info, x.shape[0], shape.n, shape.k, activations)  # type: ignore[arg-type]
    w = shape.mx[fmt][0]
    precompile([lambda t=t: mx_linear(x, w, shape.bias, activations=activations, tactic=t) for t in space])  # type: ignore[misc]
    best: tuple[GemmTactic | None, float] = (None, float("inf"))
    timed = 0
    for t in space:
        try:
            us = time_mx(shape, fmt, x, activations, t)
        except Exception as exc:  # a variant that does not compile or run here is skipped
            log(f"    {t.key()}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        timed += 1
        if us < best[1]:
            best = (t, us)
    return best[0], best[1], timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--formats", default="mxfp8,mxfp4")
    parser.add_argument("--activations", default="bf16", help="comma-separated policies for mx_linear")
    parser.add_argument("--sweep", action="store_true", help="time every dense variant and print the fastest")
    parser.add_argument("--json", dest="json_out", nargs="?", const="-", help="write the rows (stdout: no path)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dense needs a CUDA device", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    policies = [check_policy(p.strip()) for p in args.activations.split(",") if p.strip()]
    unknown = [s for s in names if s not in SHAPES] + [f for f in formats if f not in dense_mx.MX_FORMATS]
    if unknown:
        print(f"unknown shapes or formats: {unknown}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    info = DeviceInfo.from_torch(device)
    to_stdout = args.json_out == "-"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if to_stdout else sys.stdout, flush=True)

    from prepkit.kernels.mx import default_dense_tactic

    copy_gbs = copy_bandwidth(device)
    log(f"{info.name} (sm_{info.capability[0]}{info.capability[1]}, {info.sm_count} SMs): copy {copy_gbs:.0f} GB/s")
    rows: list[dict] = []
    for name in names:
        n, k = SHAPES[name]
        shape = Shape(name, n, k, formats, device)
        for T in tokens:
            x = (torch.randn((T, k), device=device) * 0.5).to(torch.bfloat16)
            runs: list[tuple[str, str, GemmTactic | None]] = [("bf16", "cublas", None)]
            for fmt in formats:
                for p in policies:
                    if p == "mxfp4" and fmt != "mxfp4":
                        continue
                    runs.append((fmt, p, default_dense_tactic(T, n, k, fmt, info.capability, activations=p,
                                                              sm_count=info.sm_count)))  # fmt: skip
            for fmt, policy, tactic in runs:
                if tactic is None:
                    us = time_cublas(shape, x)
                    err = None
                else:
                    assert dense_invalid_reason(tactic, fmt, info, policy) is None, tactic.key()  # type: ignore[arg-type]
                    err = check_once(shape, fmt, x, policy, tactic)
                    us = time_mx(shape, fmt, x, policy, tactic)
                gbs = shape.moved_bytes(fmt, T) / us / 1e3
                row = {
                    "shape": name, "n": n, "k": k, "tokens": T, "weights": fmt, "activations": policy,
                    "tactic": tactic.key() if tactic else "cublas", "us": us, "gbs": gbs,
                    "copy_frac": gbs / copy_gbs, "rel_err": err,
                }  # fmt: skip
                if args.sweep and tactic is not None:
                    best, best_us, timed = sweep(shape, fmt, x, policy, info, log)
                    row.update(
                        sweep_best=best.to_json() if best else None, sweep_best_key=best.key() if best else None,
                        sweep_us=best_us, sweep_copy_frac=shape.moved_bytes(fmt, T) / best_us / 1e3 / copy_gbs,
                        sweep_timed=timed,
                    )  # fmt: skip
                rows.append(row)
                extra = f" | sweep best {row['sweep_best_key']} {row['sweep_us']:.1f} us" if "sweep_us" in row else ""
                log(
                    f"{name:8s} T={T:3d} {fmt:5s} act={policy:6s} {row['tactic']:32s} {us:9.1f} us "
                    f"{gbs:7.0f} GB/s ({100 * gbs / copy_gbs:5.1f}% copy)"
                    + ("" if err is None else f" err {err:.1e}")
                    + extra
                )
        del shape
        torch.cuda.empty_cache()
    log("| shape | tokens | weights | activations | µs | GB/s | % copy BW | vs bf16 |")
    log("|---|---:|---|---|---:|---:|---:|---:|")
    base = {(r["shape"], r["tokens"]): r["us"] for r in rows if r["weights"] == "bf16"}
    for r in rows:
        log(
            f"| {r['shape']} | {r['tokens']} | {r['weights']} | {r['activations']} | {r['us']:.1f} | "
            f"{r['gbs']:.0f} | {100 * r['copy_frac']:.1f} | {base[(r['shape'], r['tokens'])] / r['us']:.2f}x |"
        )
    if args.json_out:
        text = json.dumps({"device": info.name, "copy_gbs": copy_gbs, "rows": rows}, indent=1)
        if to_stdout:
            print(text)
        else:
            Path(args.json_out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
