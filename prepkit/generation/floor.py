"""The bandwidth floor of decoding: the bytes one decode step must read from device memory, and
the copy bandwidth of this device, measured in the same run.

At batch 1 a decode step reads every dense weight once (q/k/v/o, router, norms, sinks, the final
norm and lm_head, one embedding row) and the ``top_k`` experts each layer routes the token to. A
batch of ``B`` rows reads the dense weights once and the union of the rows' experts: with routing
spread evenly, ``E * (1 - (1 - k/E) ** B)`` experts a layer on average. The time a step cannot go
below is those bytes over the bandwidth of a device-to-device copy (bytes read plus written).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from prepkit.runtime.moe import TENSOR_NAMES

COPY_BYTES = 1 << 30


def _nbytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer reads for ``batch`` rows routed evenly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def step_bytes(model: Any, batch: int = 1) -> dict[str, int]:
    """Bytes one decode step of ``batch`` rows reads, by part (KV cache reads not counted: a
    short context adds little next to the weights). MX dense weights count as stored."""
    base, layers = model.model, list(model.model.layers)
    experts = 0.0
    for layer in layers:
        moe = layer.mlp.moe_layer
        total = sum(getattr(moe, name).numel() * getattr(moe, name).element_size() for name in TENSOR_NAMES)
        experts += total / moe.num_local_experts * expected_experts(moe.num_local_experts, moe.top_k, batch)
    return {
        "experts": int(experts),
        "attention": sum(_nbytes(layer.self_attn) for layer in layers),
        "router": sum(_nbytes(layer.mlp.router) for layer in layers),
        "norms": sum(_nbytes(layer.input_layernorm) + _nbytes(layer.post_attention_layernorm) for layer in layers),
        "head": _nbytes(model.lm_head) + _nbytes(base.norm) + batch * base.embed_tokens.weight[0].nbytes,
    }


def copy_bandwidth(device: torch.device, repeats: int = 10) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read plus written), the median of ``repeats``
    copies of 1 GiB; None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / statistics.median(times)
