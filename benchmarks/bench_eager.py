"""Host cost of eager ``prepkit.runtime.moe`` calls at gpt-oss-120b dims (E=128, H=I=2880, top-4):
200 calls back to back with one sync at the end, against the same call replayed in a CUDA graph
(the GPU's own time). Prints a table; ``--json`` writes it. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(layer: Any, tokens: int, calls: int = 200) -> dict[str, float]:
    """Eager µs per call (all 200 launched, then one sync), the host's share of it, and the
    call's GPU µs replayed in a CUDA graph, for ``tokens`` random tokens through ``layer``."""
    from prepkit.runtime import moe

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn((tokens, layer.hidden), generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn((tokens, layer.num_experts), generator=g, device="cuda")
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
        from benchmarks.bench_kernel import synth_layer

        layer, _ = synth_layer(torch.device("cuda"))
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
