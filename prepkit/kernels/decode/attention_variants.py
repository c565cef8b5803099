"""The ``rope_cache_attend`` decode kernel as the tuner and the step see it: its problem, variants,
random inputs, and two torch paths to check it against (a fp32 reference and the decode step's
module-for-module path, :mod:`prepkit.integrations.decode_step`).

A problem (:func:`attention_problem`): ``rows`` the query heads, ``cols`` the slots in use
(``position + 1``), ``fmt`` the cache dtype, ``extra`` the head size, kv heads, window (0: full
attention) and the cache's length.
"""

from __future__ import annotations

from typing import Any

import torch

from prepkit.kernels.decode.attention import (
    KERNEL_NAME,
    MAX_SPLIT,
    MIN_TILE,
    default_variant,
    rope_cache_attend,
    variant_reason,
)
from prepkit.kernels.decode.variants import DecodeProblem, DecodeVariant, register

# The launcher's arguments, as :meth:`RopeCacheAttend.inputs` names them.
INPUT_NAMES = ("qkv", "cos", "sin", "keys", "values", "position", "pad", "window", "sinks", "scaling")


def problem_dims(problem: DecodeProblem) -> dict[str, int]:
    """The named facts of an attention ``problem`` (its ``extra``), checked present."""
    facts = dict(problem.extra)
    missing = {"head_dim", "kv_heads", "window", "cache_len"} - facts.keys()
    if problem.kernel != KERNEL_NAME or missing:
        raise ValueError(f"{problem.key()}: not a {KERNEL_NAME} problem (missing {sorted(missing)})")
    return facts


def reference_attend(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, keys, values)`` computed with torch on copies of the caches: rotary in bf16 as the
    eager module rounds it (so the written slot matches the model's bit for bit), then attention in
    fp32 over the full cache with a boolean mask (causal, window, pad) and the sink column."""
    qkv, keys, values = inputs["qkv"], inputs["keys"].clone(), inputs["values"].clone()
    batch, kv_heads, slots, head_dim = keys.shape
    heads = inputs["sinks"].shape[0]
    pos, pad, window = inputs["position"], inputs["pad"], inputs["window"]
    q, k, v = qkv.reshape(batch, heads + 2 * kv_heads, 1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    q = _rotate(q, inputs["cos"], inputs["sin"])
    keys[:, :, pos] = _rotate(k, inputs["cos"], inputs["sin"])[:, :, 0]
    values[:, :, pos] = v[:, :, 0]
    slot = torch.arange(slots, device=keys.device)
    allowed = (slot[None, :] <= pos) & (slot[None, :] >= pad[:, None])  # [B, L]
    if window is not None:
        allowed &= slot[None, :] > pos - window
    group = heads // kv_heads
    kf = keys.float().repeat_interleave(group, dim=1)  # [B, Hq, L, D]
    vf = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q[:, :, 0].float(), kf) * inputs["scaling"]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    sinks = inputs["sinks"].float()[None, :, None].expand(batch, heads, 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhl,bhld->bhd", probs, vf)
    return out.reshape(batch, heads * head_dim).to(torch.bfloat16), keys, values


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """gpt-oss's rotary on ``[B, heads, 1, D]`` with ``cos``/``sin`` ``[B, D/2]``, in x's dtype."""
    from prepkit.integrations.decode_ops import rotate

    return rotate(x, cos[:, None, :], sin[:, None, :])


def decode_step_attend(inputs: dict[str, Any]) -> torch.Tensor:
    """The decode step's torch path (rotary, the cache write by ``index_copy_``, the additive
    mask over the whole cache, :func:`~prepkit.integrations.decode_step.attend`) -> ``[B, Hq * D]``;
    writes the caches of ``inputs`` as the kernel does."""
    from prepkit.integrations.decode_ops import additive_mask, attend

    qkv, keys, values = inputs["qkv"], inputs["keys"], inputs["values"]
    batch, kv_heads, slots, head_dim = keys.shape
    heads = inputs["sinks"].shape[0]
    q, k, v = qkv.reshape(batch, heads + 2 * kv_heads, 1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    positions = inputs["position"].reshape(1)
    keys.index_copy_(2, positions, _rotate(k, inputs["cos"], inputs["sin"]))
    values.index_copy_(2, positions, v)
    slot = torch.arange(slots, device=keys.device)
    mask = additive_mask(slot, positions, inputs["window"], qkv.dtype, inputs["pad"])
    out = attend(_rotate(q, inputs["cos"], inputs["sin"]), keys, values, mask, inputs["sinks"], inputs["scaling"])
    return out.reshape(batch, heads * head_dim)


def random_inputs(
    batch: int,
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    cache_len: int,
    position: int,
    pad: list[int],
    window: int | None,
    device: Any,
    seed: int = 0,
) -> dict[str, Any]:
    """Inputs of one call: random activations, caches full of random data (every slot, also
    those the call must not read), real rotary angles, sinks near gpt-oss's."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16).to(device)

    angles = torch.rand((batch, head_dim // 2), generator=g) * 6.28
    return {
        "qkv": normal(batch, (query_heads + 2 * kv_heads) * head_dim),
        "cos": angles.cos().to(torch.bfloat16).to(device),
        "sin": angles.sin().to(torch.bfloat16).to(device),
        "keys": normal(batch, kv_heads, cache_len, head_dim),
        "values": normal(batch, kv_heads, cache_len, head_dim),
        "position": torch.tensor(position, dtype=torch.int64, device=device),
        "pad": torch.tensor(pad, dtype=torch.int64, device=device),
        "window": window,
        "sinks": normal(query_heads, scale=2.0),
        "scaling": head_dim**-0.5,
    }


class RopeCacheAttend:
    """:class:`~prepkit.kernels.decode.variants.DecodeKernel` of :func:`rope_cache_attend`."""

    name = KERNEL_NAME

    def default(self, problem: DecodeProblem) -> DecodeVariant:
        facts = problem_dims(problem)
        return default_variant(problem.batch, facts["kv_heads"], facts["head_dim"], problem.cols)

    def candidates(self, problem: DecodeProblem) -> list[DecodeVariant]:
        facts = problem_dims(problem)
        out = [self.default(problem)]
        for block_n in (MIN_TILE, 32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 3):
                    split = 1
                    while split <= MAX_SPLIT and (split == 1 or split * block_n <= problem.cols):
                        v = DecodeVariant(block_n, facts["head_dim"], warps, split, stages)
                        if v not in out and variant_reason(v, facts["head_dim"]) is None:
                            out.append(v)
                        split *= 2
        return out

    def inputs(self, problem: DecodeProblem, device: Any, seed: int = 0) -> dict[str, Any]:
        facts = problem_dims(problem)
        position = problem.cols - 1
        g = torch.Generator().manual_seed(seed + 1)
        # Left padding of up to a quarter of the slots in use, different per row.
        pads = torch.randint(0, position // 4 + 1, (problem.batch,), generator=g).tolist()
        return random_inputs(
            problem.batch, problem.rows, facts["kv_heads"], facts["head_dim"], facts["cache_len"], position, pads,
            facts["window"] or None, device, seed,
        )  # fmt: skip

    def launch(self, inputs: dict[str, Any], variant: DecodeVariant) -> torch.Tensor:
        return rope_cache_attend(**{n: inputs[n] for n in INPUT_NAMES}, variant=variant)

    def reference(self, inputs: dict[str, Any]) -> torch.Tensor:
        return reference_attend(inputs)[0]

    def tolerance(self, problem: DecodeProblem) -> float:
        # bf16 probabilities in the value product and the bf16 output: a few bf16 ulps of the
        # largest output; a slot wrongly in or out of the mask moves the output far more.
        return 1e-2


ROPE_CACHE_ATTEND = register(RopeCacheAttend())
