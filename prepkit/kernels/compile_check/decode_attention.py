"""Compiling the decode step's attention kernel (:mod:`prepkit.kernels.decode.attention`) for a GPU
this machine lacks: its real launcher on CPU tensors of the model's shapes inside the stand-in
target (stage ``attention``), as :mod:`.dense` does the dense linear."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prepkit.kernels.compile_check._compiler import TargetCompiler
from prepkit.kernels.compile_check.candidates import arch_device
from prepkit.kernels.compile_check.report import CompileReport
from prepkit.kernels.decode.variants import DecodeVariant

# gpt-oss's attention: query heads, kv heads, head size; the cache length whose defaults compile.
GPT_OSS_ATTENTION = (64, 8, 64)
ATTENTION_CACHE_LEN = 8192
ATTENTION_BATCHES: tuple[int, ...] = (1, 4, 64)


@dataclass(frozen=True)
class AttentionCandidate:
    """One attention variant to compile: dims of the launch, window (None: full attention)."""

    variant: DecodeVariant
    origin: str
    batch: int
    query_heads: int
    kv_heads: int
    head_dim: int
    cache_len: int
    window: int | None


def attention_candidates(
    dims: tuple[int, int, int] = GPT_OSS_ATTENTION,
    batches: Iterable[int] = ATTENTION_BATCHES,
    cache_len: int = ATTENTION_CACHE_LEN,
    windows: Iterable[int | None] = (None, 128),
) -> list[AttentionCandidate]:
    """The distinct default variants over ``batches`` for full and sliding-window layers, and the
    largest tile of the candidates (128 slots a block, 8 warps, 3 stages, 16 splits)."""
    from prepkit.kernels.decode.attention import MAX_SPLIT, default_variant

    heads, kv_heads, head_dim = dims
    seen: dict[tuple[DecodeVariant, int | None], AttentionCandidate] = {}
    for window in windows:
        for batch in batches:
            v = default_variant(batch, kv_heads, head_dim, cache_len)
            if (v, window) not in seen:
                origin = f"default B={batch} window {window or '-'} {v.name()}"
                seen[(v, window)] = AttentionCandidate(v, origin, batch, heads, kv_heads, head_dim, cache_len, window)
        big = DecodeVariant(128, head_dim, 8, MAX_SPLIT, 3)
        seen[(big, window)] = AttentionCandidate(
            big, f"largest window {window or '-'} {big.name()}", 1, heads, kv_heads, head_dim, cache_len, window
        )
    return list(seen.values())


def compile_attention(arch: str, candidates: Iterable[AttentionCandidate]) -> list[CompileReport]:
    """Compile each attention candidate for ``arch``'s reference device; stage ``attention``."""
    device = arch_device(arch)
    out: list[CompileReport] = []
    with TargetCompiler(device) as tc:
        for cand in candidates:
            out.extend(tc.run(arch, "bf16", "attention", None, cand.origin, _attention_launch(cand)))
    return out


def _attention_launch(cand: AttentionCandidate) -> Any:
    import torch

    # Imported inside the stand-in target: the kernel must be a compiler function.
    from prepkit.kernels.decode.attention import rope_cache_attend

    def launch() -> None:
        b, hkv, d = cand.batch, cand.kv_heads, cand.head_dim
        bf16 = torch.bfloat16
        cache = torch.empty((b, hkv, cand.cache_len, d), dtype=bf16)
        rope_cache_attend(
            torch.empty((b, (cand.query_heads + 2 * hkv) * d), dtype=bf16),
            torch.empty((b, d // 2), dtype=bf16),
            torch.empty((b, d // 2), dtype=bf16),
            cache,
            torch.empty_like(cache),
            torch.zeros((), dtype=torch.int64),
            torch.zeros(b, dtype=torch.int64),
            cand.window,
            torch.empty(cand.query_heads, dtype=bf16),
            d**-0.5,
            variant=cand.variant,
        )

    return launch
