"""The decode problems, one spelling for the tuner that records winners and the step that looks
them up: a projection by its weight's shape, format and the batch; attention by its heads, head
size, batch and the cache slots it is tuned for. Standard library only (the tuner plans without
triton)."""

from __future__ import annotations

from prepkit.kernels.decode.variants import DecodeProblem

ATTENTION_KERNEL = "rope_cache_attend"
# Cache slots attention is tuned at: a sliding-window layer's 128, and a few full-attention contexts.
DECODE_CONTEXTS: tuple[int, ...] = (128, 1024, 4096, 16384)
CACHE_FORMAT = "bf16"  # the dtype the KV cache is kept in (the attention problem's format)
# Programs a projection's launch aims for: two per SM of an H100 (132), so that the tail wave is short.
TARGET_PROGRAMS = 264
# 8-row blocks beyond which a projection is a long stream over many waves (the lm_head's 25,136).
STREAMING_BLOCKS = 16 * TARGET_PROGRAMS


def row_count(n: int) -> str:
    """How a weight of ``n`` rows stands against the programs a launch aims for, counted in
    8-row blocks: ``"few"`` below :data:`TARGET_PROGRAMS` / 2 (the router), ``"some"`` below
    2 x :data:`TARGET_PROGRAMS` (o), ``"stream"`` above :data:`STREAMING_BLOCKS` (the lm_head),
    else ``"many"``. The GEMV's one-row defaults and the tuner's candidates both follow it."""
    blocks = -(-n // 8)
    if blocks < TARGET_PROGRAMS // 2:
        return "few"
    if blocks < 2 * TARGET_PROGRAMS:
        return "some"
    return "stream" if blocks > STREAMING_BLOCKS else "many"


def on_tensor_cores(n: int, fmt: str) -> bool:
    """Whether the step's projection through an ``[n, K]`` ``fmt`` weight runs on the dense MX
    kernel (tensor cores; its tactics are the dense problem's) after a norm-only launch, rather
    than on the decode GEMV: an mxfp4 weight that streams (the lm_head). The GEMV decodes fp4 on
    the CUDA cores and is bound by their instructions there, at about 40 % of the copy bandwidth;
    the MMA path spends fewer instructions a weight byte, at any batch (docs/decode.md)."""
    return fmt == "mxfp4" and row_count(n) == "stream"


def projection_problem(kernel: str, rows: int, cols: int, batch: int, fmt: str) -> DecodeProblem:
    """``batch`` rows through a ``[rows, cols]`` weight in ``fmt`` with ``kernel`` ("norm_linear"
    or "linear_residual"). The residual add and bias that a call may or may not have are left out
    of the key: they cost the same few values a row whatever variant runs."""
    return DecodeProblem(kernel, rows, cols, batch, fmt)


def attention_problem(
    batch: int,
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    slots: int,
    window: int | None = None,
    cache_len: int | None = None,
) -> DecodeProblem:
    """``batch`` rows attending over ``slots`` cache slots (of ``cache_len``, ``slots`` when None).

    Raises:
        ValueError: ``slots`` outside ``1..cache_len``.
    """
    cache_len = slots if cache_len is None else cache_len
    if not 1 <= slots <= cache_len:
        raise ValueError(f"attention problem: {slots} slots in use, expected 1..{cache_len} (the cache's length)")
    extra = (("head_dim", head_dim), ("kv_heads", kv_heads), ("window", window or 0), ("cache_len", cache_len))
    return DecodeProblem(ATTENTION_KERNEL, query_heads, slots, batch, CACHE_FORMAT, extra)


def tuned_context(cache_len: int, window: int | None) -> int:
    """The slots a step's attention is tuned for: a sliding window's length, else the smallest
    tuned context that holds the cache (the largest one past it). One variant serves a captured
    step at every position, so it is chosen for the longest the cache allows."""
    if window is not None:
        return min(window, cache_len)
    return next((c for c in DECODE_CONTEXTS if c >= cache_len), DECODE_CONTEXTS[-1])


def step_attention_problem(
    batch: int, query_heads: int, kv_heads: int, head_dim: int, cache_len: int, window: int | None
) -> DecodeProblem:
    """The problem a step looks its attention variant up by (the tuner records the same)."""
    slots = tuned_context(cache_len, window)
    return attention_problem(batch, query_heads, kv_heads, head_dim, slots, None, slots)
