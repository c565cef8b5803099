"""Decode-step replay times by step kind, cache length and layer count, and the sampler's parts:
a quick probe (CUDA events, medians of graph replays)."""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replay_ms(fn, iters: int = 50) -> float:
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    from prepkit.generation import loading
    from prepkit.generation.bench import keep_layers
    from prepkit.generation.sampling import SamplingParams, sample
    from prepkit.integrations.static_decode import PrepkitDecoder

    folder = Path(sys.argv[1])
    warnings.filterwarnings("ignore")
    logits = torch.randn(1, 201088, device="cuda", dtype=torch.bfloat16)
    seed, pos = torch.zeros((), dtype=torch.long, device="cuda"), torch.ones((), dtype=torch.long, device="cuda")
    for name, params in [
        ("greedy", SamplingParams()),
        ("top50", SamplingParams(greedy=False, top_k=50)),
        ("full", SamplingParams(greedy=False, top_k=0)),
        ("topp.9", SamplingParams(greedy=False, top_k=0, top_p=0.9)),
    ]:
        sample(logits, params, seed, pos)
        print(f"sample {name}: {replay_ms(lambda p=params: sample(logits, p, seed, pos)):.3f} ms", flush=True)
    print(f"topk50 alone: {replay_ms(lambda: logits.float().topk(50)):.3f} ms", flush=True)
    manifest = loading.open_prepared(folder)
    model = loading.load_model(folder, manifest, torch.device("cuda"), "bf16").model
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 1000, (1, 8))
    compiled_sample = torch.compile(sample, fullgraph=True, dynamic=False)
    for name, params in [("top50", SamplingParams(greedy=False, top_k=50)), ("full", SamplingParams(greedy=False))]:
        compiled_sample(logits, params, seed, pos)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            compiled_sample(logits, params, seed, pos)
        print(f"compiled sample {name} in a graph: {replay_ms(g.replay):.3f} ms", flush=True)
    for layers in (5,):
        keep_layers(model, layers)
        for compile in (False, True):
            for max_len in (256, 2049):
                d = PrepkitDecoder(model, max_len, compile=compile)
                d.prefill(ids)
                d.step()
                d.step()
                ms = replay_ms(d.graph.replay)
                print(f"layers {layers} compile {compile} max_len {max_len}: {ms:.3f} ms/step", flush=True)
                del d


if __name__ == "__main__":
    main()
