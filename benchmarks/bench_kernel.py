"""Benchmark of the bundled MXFP4 MoE kernel: one gpt-oss-120b MoE layer per call.

    python -m benchmarks.bench_kernel [--tokens 1,8,8192] [--sweep] [--baseline/--no-baseline]
        [--activations bf16,mxfp8,mxfp4]

Weights are synthesized on the GPU directly in the triton_moe_v3 layout (no disk). Per token count
it prints the median µs per layer (CUDA graph; cold L2 by rotating input sets whose experts
differ, so each replay reads its experts from memory), the distinct expert bytes touched and the
GB/s that makes, TFLOP/s, each as a fraction of the device's copy bandwidth and bf16 matmul rate
measured in the same run, and a plain-torch baseline (dequantize + matmul) side by side.
``--sweep`` times GEMM1/GEMM2 variants per token count first and uses the fastest.
``--activations`` runs each listed precision policy and prints µs and the relative error against
the unquantized fp32 layer side by side (MX policies run natively only on SM10x/SM12x; elsewhere
Triton decomposes them, so their µs there is information, not a target).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prepkit.kernels.activations import ACTIVATION_POLICIES, check_policy  # noqa: E402
from prepkit.kernels.device import DeviceInfo, lowers_natively  # noqa: E402
from prepkit.kernels.reference import moe_reference, relative_error  # noqa: E402
from prepkit.kernels.tactic import GemmTactic  # noqa: E402
from prepkit.kernels.variants import default_tactics, policy_variant  # noqa: E402
from prepkit.layouts.base import ExpertWeights, RankSpec  # noqa: E402
from prepkit.runtime.moe import MoeLayer, moe  # noqa: E402

E, H, I, TOP_K = 128, 2880, 2880, 4
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 4096, 8192)
FP4_LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_bytes(hidden: int = H, intermediate: int = I) -> int:
    """Bytes of one expert the layer reads: fp4 values (checkpoint K, not the panels' zero tail),
    E8M0 scales, fp32 biases."""
    w13 = 2 * intermediate * (hidden // 2 + hidden // 32 + 4)
    w2 = hidden * (intermediate // 2 + intermediate // 32 + 4)
    return w13 + w2


def flops_per_token(hidden: int = H, intermediate: int = I, top_k: int = TOP_K) -> int:
    return 2 * top_k * (hidden * 2 * intermediate + intermediate * hidden)


# E8M0 scale bytes [lo, hi): "small" near gpt-oss's (2^-8 .. 2^-4, every byte <= 128, so the
# kernel's folded upcast applies); "wide" reaches past 128 (scales up to 2^8), which turns it off.
SCALE_BYTES = {"small": (119, 124), "wide": (119, 136)}


def synth_layer(
    device: torch.device, seed: int = 0, scales: str = "small", tp: int = 1
) -> tuple[MoeLayer, ExpertWeights]:
    """A random layer in checkpoint form, its scale bytes from :data:`SCALE_BYTES`, built
    into the kernel's layout by the layout itself (rank 0 of a ``tp`` split); returns (layer,
    checkpoint experts), the latter for the fp32 reference."""
    lo, hi = SCALE_BYTES[scales]
    g = torch.Generator(device=device).manual_seed(seed)

    def u8(shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.uint8)

    source = ExpertWeights(
        gate_up_proj_blocks=u8((E, 2 * I, H // 32, 16), 0, 256),
        gate_up_proj_scales=u8((E, 2 * I, H // 32), lo, hi),
        gate_up_proj_bias=(torch.randn((E, 2 * I), generator=g, device=device) * 0.1).to(torch.bfloat16),
        down_proj_blocks=u8((E, H, I // 32, 16), 0, 256),
        down_proj_scales=u8((E, H, I // 32), lo, hi),
        down_proj_bias=(torch.randn((E, H), generator=g, device=device) * 0.1).to(torch.bfloat16),
    )
    layer, _ = MoeLayer.from_experts(source, top_k=TOP_K, rank=RankSpec(tp_size=tp))
    return layer, source


# --- device ceilings ---------------------------------------------------------------------------


def events_median(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = events_median(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """bf16 n x n x n matmul on random data, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = events_median(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


# --- timing the layer --------------------------------------------------------------------------


def make_inputs(T: int, sets: int, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        (
            torch.randn((T, H), generator=g, device=device).to(torch.bfloat16),
            torch.randn((T, E), generator=g, device=device),
        )
        for _ in range(sets)
    ]


def rotation_sets(T: int) -> int:
    """Input sets per graph: enough that consecutive replays touch other experts and activations."""
    return 16 if T <= 128 else 8 if T <= 2048 else 4


def graph_us_per_set(step: Callable[..., object], sets: list[tuple], replays: int = 20) -> float:
    """Median µs per input set: one CUDA graph runs ``step(*s)`` once for each of ``sets``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets:  # compile and warm up outside the capture
            step(*s)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            step(*s)
    ms = events_median(graph.replay, iters=replays, warmup=3)
    return ms * 1e3 / len(sets)


def time_layer_graph(
    layer: MoeLayer,
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    tactics: tuple[GemmTactic, GemmTactic],
    replays: int = 20,
) -> float:
    """Median µs per layer: one CUDA graph runs the layer once per input set."""

    def step(x: torch.Tensor, logits: torch.Tensor) -> None:
        moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32)

    return graph_us_per_set(step, inputs, replays)


def distinct_experts(inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean number of distinct experts one input set touches."""
    counts = [torch.unique(torch.topk(logits, TOP_K, dim=-1).indices).numel() for _, logits in inputs]
    return sum(counts) / len(counts)


def dequant_layout(panels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[K/256, N, 128]`` fp4 panels and ``[K/32, N]`` E8M0 -> bf16 ``[N, K]`` (plain torch)."""
    blocks = panels.transpose(0, 1).flatten(1)[:, : scales.shape[0] * 16]
    lut = torch.tensor(FP4_LUT, device=blocks.device, dtype=torch.float32)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()
    vals = lut[codes].unflatten(-1, (-1, 32))
    scale = torch.exp2(scales.t().float() - 127.0)
    return (vals * scale[..., None]).flatten(-2).to(torch.bfloat16)


def torch_baseline(layer: MoeLayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The speed baseline in plain torch: route, then per hit expert dequantize the stored panel
    bytes and matmul in bf16. The same work as the layer, not its values (the panel bytes are
    read in storage order); the accuracy reference is :func:`moe_reference`."""
    values, ids = torch.topk(logits.float(), TOP_K, dim=-1)
    weights = torch.softmax(values, dim=-1)
    out = torch.zeros((x.shape[0], H), dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w13 = dequant_layout(layer.w13_blocks[e], layer.w13_scales[e])
        y = (x[tok] @ w13.T).float() + layer.w13_bias[e]
        gate, up = y[:, 0::2].clamp(max=7.0), y[:, 1::2].clamp(-7.0, 7.0)
        act = (gate * torch.sigmoid(1.702 * gate) * (up + 1)).to(torch.bfloat16)
        w2 = dequant_layout(layer.w2_blocks[e], layer.w2_scales[e])
        z = (act @ w2.T).float() + layer.w2_bias[e]
        out.index_add_(0, tok, z * weights[tok, slot, None])
    return out


# --- sweep ---------------------------------------------------------------------------------------


def sweep_candidates(T: int, gemm: str) -> list[GemmTactic]:
    """A short list of tiles around the best ones found so far, inline-PTX upcast only (the other
    upcasts lost every sweep: docs/kernel-history.md)."""
    rows = max(1, T * TOP_K // min(E, T * TOP_K))
    out = []
    if rows <= 32:
        for bn, bk, load in itertools.product((64, 128), (128, 256), ("ptr", "tma")):
            for sk in (1,) if gemm == "gemm1" else (1, 2, 4):
                out.append(GemmTactic(16, bn, bk, 4, 4 if bk == 128 else 3, sk, "asm", load))
    else:
        for (bm, bn, bk, warps), load in itertools.product(
            ((64, 256, 64, 4), (64, 128, 64, 4), (128, 128, 64, 4), (128, 256, 64, 8)), ("ptr", "tma")
        ):
            out.append(GemmTactic(bm, bn, bk, warps, 3, 1, "asm", load))
    return out


def precompile(fns: list[Callable[[], object]]) -> None:
    """Compile variants in parallel threads (ptxas runs outside the GIL); errors surface later."""
    from concurrent.futures import ThreadPoolExecutor

    def run(fn: Callable[[], object]) -> None:
        with contextlib.suppress(Exception):  # the timed call reports it
            fn()

    with ThreadPoolExecutor(max_workers=12) as pool:
        list(pool.map(run, fns))
    torch.cuda.synchronize()


def sweep(layer: MoeLayer, T: int, device: torch.device, log: Callable[[str], None]) -> tuple[GemmTactic, GemmTactic]:
    """Fastest GEMM1 and GEMM2 variants at ``T`` tokens (each timed alone, L2 flushed), for the
    layer's activation policy."""
    import triton.testing

    from prepkit.kernels import mx as k

    policy = layer.activations
    info = DeviceInfo.from_torch(device)
    x, logits = make_inputs(T, 1, device, seed=T)[0]
    routing = k.route(
        logits, top_k=TOP_K, expert_lo=0, num_local_experts=E, hidden=H, hidden_states=x, activations=policy
    )
    first = {g: [policy_variant(t, g, info, policy) for t in sweep_candidates(T, g)] for g in ("gemm1", "gemm2")}
    if policy == "bf16":
        h1 = torch.randn((T * TOP_K, I), device=device).to(torch.bfloat16)
    else:  # GEMM2 reads quantized rows: GEMM1's own output
        w13 = (layer.w13_blocks, layer.w13_scales, layer.w13_bias)
        h1 = k.gemm1_swiglu(routing, x, *w13, valid_intermediate=I, tactic=first["gemm1"][0], activations=policy)
    best: dict[str, tuple[float, GemmTactic]] = {}
    small = layer.small_scales
    for gemm in ("gemm1", "gemm2"):
        fns = []
        for t in dict.fromkeys(first[gemm]):
            if gemm == "gemm1":

                def fn(t: GemmTactic = t) -> object:
                    return k.gemm1_swiglu(
                        routing,
                        x,
                        layer.w13_blocks,
                        layer.w13_scales,
                        layer.w13_bias,
                        valid_intermediate=I,
                        tactic=t,
                        small_scales=small[0],
                        activations=policy,
                    )
            else:

                def fn(t: GemmTactic = t) -> object:
                    return k.gemm2_combine(
                        routing,
                        h1,
                        layer.w2_blocks,
                        layer.w2_scales,
                        layer.w2_bias,
                        tactic=t,
                        small_scales=small[1],
                        activations=policy,
                    )

            fns.append((t, fn))
        precompile([fn for _, fn in fns])
        for t, fn in fns:
            try:
                us = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
            except Exception as err:  # a variant the compiler rejects is reported, not fatal
                log(f"  T={T} {gemm} {t.key()}: failed: {type(err).__name__}: {str(err)[-400:]}")
                continue
            log(f"  T={T} {gemm} {t.key()}: {us:.1f} us")
            if gemm not in best or us < best[gemm][0]:
                best[gemm] = (us, t)
    g1, g2 = best["gemm1"][1], best["gemm2"][1]
    log(f"T={T}: best gemm1 {g1.to_json()} {best['gemm1'][0]:.1f} us; gemm2 {g2.to_json()} {best['gemm2'][0]:.1f} us")
    return g1, g2


def policy_table(rows: list[dict], policies: list[str], info: DeviceInfo) -> str:
    """µs per layer and relative error against the unquantized fp32 layer, one column pair per
    activation policy, one line per token count."""
    native = lowers_natively(info.capability)
    head = "| tokens | " + " | ".join(f"{p} µs | {p} rel err" for p in policies) + " |"
    lines = [
        f"activation policies on {info.name}: MX "
        + ("native (block-scaled MMA)" if native else "decomposed by Triton (information only)"),
        head,
        "|---:|" + "---:|---:|" * len(policies),
    ]
    by_t: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_t.setdefault(r["tokens"], {})[r["activations"]] = r
    for T, per in by_t.items():
        cells = " | ".join(f"{per[p]['us']:.1f} | {per[p]['rel_err']:.3g}" for p in policies)
        lines.append(f"| {T} | {cells} |")
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--sweep", action="store_true", help="time variants per T and use the fastest")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false")
    parser.add_argument("--tactics", help="JSON file {T: [gemm1, gemm2]} used instead of the defaults")
    parser.add_argument("--tuned", action="store_true", help="take variants from the tactic DBs, as the runtime does")
    parser.add_argument("--json", dest="json_out", help="write the results here")
    parser.add_argument("--scales", choices=sorted(SCALE_BYTES), default="small", help="E8M0 scale byte range")
    parser.add_argument(
        "--tp", type=int, default=1, help="time rank 0 of this tensor-parallel split (its share of every expert)"
    )
    parser.add_argument(
        "--activations",
        default="bf16",
        help=f"comma-separated precision policies, side by side ({', '.join(ACTIVATION_POLICIES)})",
    )
    args = parser.parse_args(argv)
    policies = [check_policy(p.strip()) for p in args.activations.split(",") if p.strip()]
    if not torch.cuda.is_available():
        print("bench_kernel needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    info = DeviceInfo.from_torch(device)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    copy_gbs = copy_bandwidth(device)
    mm_tflops = matmul_rate(device)
    log(
        f"device: {info.name} (sm_{info.capability[0]}{info.capability[1]}, {info.sm_count} SMs); "
        f"copy {copy_gbs:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s"
    )
    layer, source = synth_layer(device, scales=args.scales, tp=args.tp)
    if args.tp > 1:
        log(f"TP rank 0 of {args.tp}: {layer.valid_intermediate} of {I} intermediate rows an expert")
    log(f"scales: {args.scales} (E8M0 bytes {SCALE_BYTES[args.scales]}), folded upcast {layer.small_scales}")
    pinned = {}
    if args.tactics:
        raw = json.loads(Path(args.tactics).read_text())
        pinned = {
            int(t): (GemmTactic.from_json(json.dumps(a)), GemmTactic.from_json(json.dumps(b)))
            for t, (a, b) in raw.items()
        }
    lookup = None
    if args.tuned:
        from prepkit.tactics.lookup import make_tactic_lookup

        lookup = make_tactic_lookup()
    rows = []
    for T, policy in itertools.product([int(t) for t in args.tokens.split(",")], policies):
        layer.activations = policy
        problem = layer.problem(T)
        tuned = lookup(problem, info) if lookup is not None else None
        tactics = (
            sweep(layer, T, device, log) if args.sweep else pinned.get(T) or tuned or default_tactics(problem, info)
        )
        tactics = (policy_variant(tactics[0], "gemm1", info, policy), policy_variant(tactics[1], "gemm2", info, policy))
        inputs = make_inputs(T, rotation_sets(T), device, seed=1000 + T)
        us = time_layer_graph(layer, inputs, tactics)
        hit = distinct_experts(inputs)
        nbytes = hit * expert_bytes() / args.tp  # a TP rank holds its share of each expert
        gbs = nbytes / us / 1e3
        tflops = T * flops_per_token() / us / 1e6
        base_us = float("nan")
        x, logits = inputs[0]
        if args.baseline and args.tp == 1:
            base_us = (
                events_median(lambda x=x, logits=logits: torch_baseline(layer, x, logits), iters=3, warmup=1) * 1e3
            )
        err = float("nan")
        if (len(policies) > 1 or policy != "bf16") and args.tp == 1:  # the reference is of the whole layer
            torch.backends.cuda.matmul.allow_tf32 = False
            ref = moe_reference(x, logits, source.as_dict(), top_k=TOP_K)
            err = relative_error(moe(layer, x, logits, tactics=tactics, out_dtype=torch.float32), ref)
        row = {
            "tokens": T,
            "tp": args.tp,
            "activations": policy,
            "rel_err": err,
            "experts_hit": hit,
            "us": us,
            "gbs": gbs,
            "copy_frac": gbs / copy_gbs,
            "tflops": tflops,
            "mm_frac": tflops / mm_tflops,
            "torch_us": base_us,
            "gemm1": json.loads(tactics[0].to_json()),
            "gemm2": json.loads(tactics[1].to_json()),
        }
        rows.append(row)
        log(
            f"T={T:5d} {policy:5s} hit={hit:6.1f} {us:9.1f} us {gbs:7.0f} GB/s ({100 * gbs / copy_gbs:5.1f}% copy) "
            f"{tflops:6.1f} TFLOP/s ({100 * tflops / mm_tflops:5.1f}% bf16) torch {base_us:10.1f} us "
            f"rel err {err:.3g} [{tactics[0].key()} / {tactics[1].key()}]"
        )

    log("")
    log("| tokens | activations | experts hit | µs | GB/s | % copy BW | TFLOP/s | % bf16 | torch µs | speedup |")
    log("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        log(
            f"| {r['tokens']} | {r['activations']} | {r['experts_hit']:.1f} | {r['us']:.1f} | {r['gbs']:.0f} | "
            f"{100 * r['copy_frac']:.1f} | {r['tflops']:.1f} | {100 * r['mm_frac']:.1f} | "
            f"{r['torch_us']:.0f} | {r['torch_us'] / r['us']:.1f}x |"
        )
    if len(policies) > 1:
        log("")
        log(policy_table(rows, policies, info))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"device": info.name, "copy_gbs": copy_gbs, "bf16_tflops": mm_tflops, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
