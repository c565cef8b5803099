"""Host cost of eager ``prepkit.runtime.moe`` calls at gpt-oss-120b dims (E=128, H=I=2880, top-4):
200 calls back to back with one sync at the end, against the same call replayed in a CUDA graph
(the GPU's own time). Prints a table; ``--json`` writes it. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

E, H, I, TOP_K = 128, 2880, 2880, 4


def random_layer() -> object:
    from prepkit.layouts.base import ExpertWeights
    from prepkit.runtime import MoeLayer

    g = torch.Generator(device="cuda").manual_seed(0)

    def u8(shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, device="cuda", dtype=torch.uint8)

    experts = ExpertWeights(
        gate_up_proj_blocks=u8((E, 2 * I, H // 32, 16), 0, 256),
        gate_up_proj_scales=u8((E, 2 * I, H // 32), 119, 124),
        gate_up_proj_bias=(torch.randn((E, 2 * I), generator=g, device="cuda") * 0.1).to(torch.bfloat16),
        down_proj_blocks=u8((E, H, I // 32, 16), 0, 256),
        down_proj_scales=u8((E, H, I // 32), 119, 124),
        down_proj_bias=(torch.randn((E, H), generator=g, device="cuda") * 0.1).to(torch.bfloat16),
    )
    layer, _ = MoeLayer.from_experts(experts, top_k=TOP_K)
    return layer


def measure(layer: object, tokens: int, calls: int = 200) -> dict[str, float]:
    from prepkit.runtime import moe

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn((tokens, H), generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn((tokens, E), generator=g, device="cuda")
    for _ in range(5):
        moe(layer, x, logits)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        moe(layer, x, logits)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    eager = time.perf_counter() - start
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(layer, x, logits)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(20):
                moe(layer, x, logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return {
        "eager_us": eager / calls * 1e6,
        "host_us": host / calls * 1e6,
        "graph_us": begin.elapsed_time(end) / 200 * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_eager needs a CUDA device", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = random_layer()
        rows = {int(t): measure(layer, int(t)) for t in args.tokens.split(",")}
    print(f"{torch.cuda.get_device_name()}: eager prepkit.runtime.moe, gpt-oss-120b dims")
    print("| tokens | eager µs/call | host µs/call | CUDA graph µs/call |")
    print("|---:|---:|---:|---:|")
    for t, r in rows.items():
        print(f"| {t} | {r['eager_us']:.1f} | {r['host_us']:.1f} | {r['graph_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
