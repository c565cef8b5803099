"""The decode step's projections as single launches that stream their weight
(:mod:`~prepkit.kernels.decode.gemv_kernel`): ``norm_linear`` (the residual add and RMS norm in the
prologue), ``linear_residual`` (the residual add in the epilogue) and ``linear`` (neither).

A weight is a bf16 tensor ``[N, K]`` or a stored MX weight: any object with ``blocks``
(``[P, N, 128]`` uint8 K panels), ``scales`` (``[K/32, N]`` E8M0 bytes) and ``fmt`` (``"mxfp8"``,
``"mxfp4"``), as :class:`~prepkit.kernels.mx.dense.DenseMxWeights` and the decode step's MX weight
hold them (:mod:`prepkit.layouts.dense_mx`). MX codes are decoded exactly and multiplied with the
bf16 activations in fp32, so a weight's activation policy plays no part here.

Rounding follows transformers' eager gpt-oss modules: bf16 between modules, the RMS norm in fp32
with its weight applied before the cast to bf16, one fp32 accumulation per projection (bias
included) rounded to bf16 once, residual adds in bf16. Rows: 1 to :data:`MAX_ROWS`; any ``N``;
any ``K`` for bf16 weights, MX weights' ``K`` is a multiple of 32 by their layout.
"""

from __future__ import annotations

from typing import Protocol

import torch

from prepkit.kernels.decode.gemv_kernel import WFMT_BF16, WFMT_MXFP4, WFMT_MXFP8, _add_norm_kernel, _gemv_kernel
from prepkit.kernels.decode.problems import TARGET_PROGRAMS, row_count
from prepkit.kernels.decode.variants import DecodeVariant
from prepkit.kernels.mx._chain import chain_launch
from prepkit.kernels.mx._target import interpreting
from prepkit.kernels.mx.dense import check_weights, split_counters

MAX_ROWS = 8  # the most rows (tokens of one decode step) one launch takes
_WFMT_IDS = {"bf16": WFMT_BF16.value, "mxfp8": WFMT_MXFP8.value, "mxfp4": WFMT_MXFP4.value}
# Per weight format: the narrowest K step a variant may take (mxfp4: 32 code bytes, what the
# nibble widener handles) and the default one (256 weight bytes a row and step).
MIN_BLOCK_K = {"bf16": 16, "mxfp8": 32, "mxfp4": 64}
DEFAULT_BLOCK_K = {"bf16": 128, "mxfp8": 256, "mxfp4": 512}
# The widest block of one row's activations the norm's prologue loads at once: gpt-oss rows
# (2,880) in one load, longer ones in a loop.
MAX_ROW_BLOCK = 4096
# Code bytes of a K step of one MX row's default tiles where the weight has some row blocks (o):
# 2,048 values a row (:func:`_one_mx_row`).
MX_WIDE_STEP_BYTES = 16384
# The most accumulator registers a thread spends on deferred row sums (:func:`defers`).
DEFERRED_VALUES = 32


class StoredMx(Protocol):
    """A dense weight in its stored MX form (:mod:`prepkit.layouts.dense_mx`)."""

    @property
    def blocks(self) -> torch.Tensor: ...
    @property
    def scales(self) -> torch.Tensor: ...
    @property
    def fmt(self) -> str: ...


Weight = torch.Tensor | StoredMx


def weight_format(weight: Weight) -> str:
    """``"bf16"`` for a tensor, else the stored weight's MX format."""
    return "bf16" if isinstance(weight, torch.Tensor) else weight.fmt


def weight_shape(weight: Weight, name: str = "weight") -> tuple[int, int]:
    """``(N, K)`` of ``weight``, checked.

    Raises:
        ValueError: not a bf16 ``[N, K]`` tensor with a contiguous last dim, nor a stored MX weight
            (the message names the tensor).
    """
    if isinstance(weight, torch.Tensor):
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"{name}: {list(weight.shape)} {weight.dtype}, expected a bf16 [N, K] tensor")
        if weight.stride(1) != 1 and weight.shape[1] > 1:
            raise ValueError(f"{name}: strides {weight.stride()}, the K axis must be contiguous")
        return weight.shape[0], weight.shape[1]
    check_weights(weight.blocks, weight.scales, weight.fmt, name)
    return weight.scales.shape[1], weight.scales.shape[0] * 32


def variant_reason(variant: DecodeVariant, fmt: str) -> str | None:
    """Why ``variant`` cannot run a ``fmt`` weight, or ``None`` when it can."""
    if fmt not in _WFMT_IDS:
        return f"weight format {fmt!r} is not one of {', '.join(_WFMT_IDS)}"
    for field, value in (("block_n", variant.block_n), ("block_k", variant.block_k), ("num_warps", variant.num_warps)):
        if value < 1 or value & (value - 1):
            return f"{field} {value} is not a power of two"
    if variant.block_k < MIN_BLOCK_K[fmt]:
        return f"block_k {variant.block_k} is below {MIN_BLOCK_K[fmt]}, the narrowest {fmt} step"
    if not 1 <= variant.split_k <= 64:
        return f"split_k {variant.split_k} is not in 1..64"
    if variant.num_stages not in (1, 2):
        return f"num_stages {variant.num_stages} is not 1 (loads in the step) or 2 (a step ahead)"
    return None


def defers(variant: DecodeVariant, rows: int, fmt: str) -> bool:
    """Whether a launch keeps each row's products in registers through the K loop and sums them
    once (one multiply-add per weight value and row) rather than summing every step (a
    cross-thread sum per row and step, fewer registers): when the rows' tiles take at most
    :data:`DEFERRED_VALUES` fp32 registers a thread, and for MX weights only from two rows on
    (one row sums 32-value groups and scales the sums, which costs fewer instructions than
    scaling every value; sm_90 SASS counts)."""
    fits = rows * variant.block_n * variant.block_k <= DEFERRED_VALUES * 32 * variant.num_warps
    return fits and (fmt == "bf16" or rows > 1)


def launch_grid(n: int, variant: DecodeVariant) -> tuple[int, int]:
    """The programs of one launch over ``n`` output rows: (row blocks, K splits)."""
    return -(-n // variant.block_n), variant.split_k


def own_row_loop(variant: DecodeVariant, rows: int, fmt: str, norm: bool, k: int) -> bool:
    """Whether one bf16 row runs the loop that loads its inputs a step ahead, and its first weight
    tile before the wait on the kernel before: without the norm (o), or with the norm's whole row
    in one K step (the router). Under the norm over many steps (q/k/v) the step-ahead inputs
    repeat the norm's arithmetic for every weight value and cost more than they hide
    (docs/decode.md)."""
    if not (rows == 1 and fmt == "bf16" and defers(variant, rows, fmt)):
        return False
    return not norm or variant.block_k >= _norm_row_block(k)


def mx_ahead(variant: DecodeVariant, rows: int, fmt: str) -> bool:
    """Whether one row through an MX weight loads each K step's codes, scales and inputs a step
    ahead: variants of two stages. The codes cross the loop byte by byte (about 150 more
    instructions a step at 8 KB), which pays where a step's round trip, not its decode, is what
    the row waits on (mxfp8; docs/decode.md)."""
    return rows == 1 and fmt != "bf16" and variant.num_stages == 2


def early_tile(variant: DecodeVariant, rows: int, fmt: str, n: int) -> bool:
    """Whether one row through an MX weight, in the loop that loads each step's codes in the step,
    loads its first step's tile before the wait on the kernel before, so that the tile is on its
    way while that kernel finishes and the norm's prologue runs. Not for a weight that streams
    over many waves (the lm_head): only its first wave could gain, and measured, its launch was
    slower (docs/decode.md)."""
    return rows == 1 and fmt != "bf16" and not mx_ahead(variant, rows, fmt) and row_count(n) != "stream"


def _norm_row_block(k: int) -> int:
    """How many of a row's ``k`` values the norm's prologue loads at once."""
    return min(_pow2_at_least(k), MAX_ROW_BLOCK)


def norm_linear(
    hidden: torch.Tensor,
    add: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    want_normed: bool,
    *,
    variant: DecodeVariant | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``summed = hidden + bf16(add)``, ``normed = bf16(rms_norm(summed) * norm_weight)``,
    ``out = bf16(normed @ W^T + bias)`` in one launch: returns ``(summed, out, normed or None)``.

    Raises:
        ValueError: shapes, dtypes, devices or a variant that do not fit (the message names the tensor).
    """
    n, k = weight_shape(weight)
    rows, h = _check_norm_inputs(hidden, add, norm_weight, k)
    summed = torch.empty((rows, h), dtype=torch.bfloat16, device=hidden.device)
    normed = torch.empty((rows, h), dtype=torch.bfloat16, device=hidden.device) if want_normed else None
    out = _launch(hidden, weight, bias, n, variant, add=add, norm=(norm_weight, eps, summed, normed))
    return summed, out, normed


def add_norm(
    hidden: torch.Tensor, add: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed, normed)`` exactly as :func:`norm_linear` computes them, in one launch with no
    projection: the norm before a weight the tensor cores run
    (:func:`~prepkit.kernels.decode.problems.on_tensor_cores`).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (the message names the tensor).
    """
    rows, h = _check_norm_inputs(hidden, add, norm_weight)
    summed = torch.empty((rows, h), dtype=torch.bfloat16, device=hidden.device)
    normed = torch.empty_like(summed)
    add_t = add if add is not None else hidden
    _add_norm_kernel[(rows,)](
        hidden, add_t, norm_weight, summed, normed, h, float(eps),
        hidden.stride(0), add_t.stride(0), summed.stride(0), normed.stride(0),
        HAS_ADD=add is not None, ROW_BLOCK=_norm_row_block(h), SW_ROUND=interpreting(), num_warps=4,
        **chain_launch(hidden.device),
    )  # fmt: skip
    return summed, normed


def linear_residual(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    variant: DecodeVariant | None = None,
) -> torch.Tensor:
    """``residual + bf16(x @ W^T + bias)`` (the add in bf16) in one launch: ``[B, N]`` bf16.

    Raises:
        ValueError: shapes, dtypes, devices or a variant that do not fit (the message names the tensor).
    """
    rows, _ = _check_rows(x, "x")
    n, _ = weight_shape(weight)
    _check_like(residual, "residual", (rows, n), (torch.bfloat16,), x.device)
    return _launch(x, weight, bias, n, variant, residual=residual)


def linear(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, *, variant: DecodeVariant | None = None
) -> torch.Tensor:
    """``bf16(x @ W^T + bias)`` in one launch: ``[B, N]`` bf16.

    Raises:
        ValueError: shapes, dtypes, devices or a variant that do not fit (the message names the tensor).
    """
    _check_rows(x, "x")
    n, _ = weight_shape(weight)
    return _launch(x, weight, bias, n, variant)


def default_variant(n: int, k: int, batch: int, fmt: str) -> DecodeVariant:
    """The untuned variant of ``batch`` rows through an ``[n, k]`` ``fmt`` weight. One bf16 row:
    :func:`_one_bf16_row`; one MX row of some or many row blocks: :func:`_one_mx_row`. Otherwise
    256 weight bytes a row per K step, the widest row block (32 .. 8; the rows' products at most
    :data:`DEFERRED_VALUES` values a thread) that still gives :data:`TARGET_PROGRAMS` programs,
    and K splits where even 8-row blocks give too few (the router, small heads)."""
    if fmt == "bf16" and batch == 1:
        return _one_bf16_row(n, k)
    if fmt != "bf16" and batch == 1 and row_count(n) in ("some", "many"):
        return _one_mx_row(n, k, fmt)
    block_k = min(DEFAULT_BLOCK_K[fmt], max(MIN_BLOCK_K[fmt], _pow2_at_least(k)))
    # bf16: at most DEFERRED_VALUES weight values a thread (4 warps) for all rows together where
    # 8-row blocks allow it, so that the K loop sums once (:func:`defers`). MX weights sum scale
    # groups in registers whatever the rows and take twice that for the tile alone: wider blocks
    # share each row's activations among more weight values (sm_90 SASS, mxfp4 instructions a
    # weight byte at 1 / 4 / 8 rows: 11.0 / 21.0 / 32.9 at 16 x 512, 13.5 / 25.4 / 42.9 at 8 x 512).
    if fmt == "bf16":
        widest = max(8, DEFERRED_VALUES * 128 // (block_k * batch))
    else:
        widest = max(8, 2 * DEFERRED_VALUES * 128 // block_k)
    block_n = next((bn for bn in (32, 16) if bn <= widest and -(-n // bn) >= TARGET_PROGRAMS), 8)
    tiles = -(-n // block_n)
    steps = -(-k // block_k)
    split = 1
    while split < 8 and tiles * split < TARGET_PROGRAMS // 2 and steps >= 4 * split:
        split *= 2  # each split keeps two K steps or more
    return DecodeVariant(block_n, block_k, 4, split)


def _one_bf16_row(n: int, k: int) -> DecodeVariant:
    """One row through a bf16 weight, by how many 8-row blocks the weight has (the fastest
    variants at gpt-oss-120b's shapes on an H100, docs/decode.md):

    - fewer than :data:`TARGET_PROGRAMS` / 2 (the router): 2-row blocks, the whole row in one K
      step, since each of the few programs would wait out one memory round trip a step;
    - fewer than 2 x :data:`TARGET_PROGRAMS` (o): 4-row blocks of 512-wide steps, for more programs;
    - a stream (:func:`~prepkit.kernels.decode.problems.row_count`, the lm_head): 8-row blocks
      of 256, 4 warps, a long stream at the copy bandwidth that 8 warps slow down;
    - otherwise (q/k/v): 8-row blocks of 256-wide steps, 8 warps. 16-row blocks of 4 warps fit
      one wave and win alone, but lost in the step.
    """
    row = max(MIN_BLOCK_K["bf16"], _pow2_at_least(k))
    rows = row_count(n)
    if rows == "few":
        return DecodeVariant(2, min(MAX_ROW_BLOCK, row), 8, 1)
    if rows == "some":
        return DecodeVariant(4, min(512, row), 8, 1)
    return DecodeVariant(8, min(256, row), 4 if rows == "stream" else 8, 1)


def _one_mx_row(n: int, k: int, fmt: str) -> DecodeVariant:
    """One row through an MX weight of some or many row blocks (o, q/k/v): wide K steps, each
    loaded in its step, so that each program has more code bytes in flight per memory round
    trip, which is what a one-row launch waits on. Many blocks (q/k/v): 16 rows of 1,024 values
    a step on 4 warps. Some (o, under 2 x :data:`TARGET_PROGRAMS` 8-row blocks): steps of 2,048
    values and :data:`MX_WIDE_STEP_BYTES` code bytes (mxfp4 16 rows, mxfp8 8) on 8 warps, whose
    registers leave two programs an SM, which still fit one wave there (the fastest at
    gpt-oss-120b's shapes on an H200, docs/decode.md)."""
    some = row_count(n) == "some"
    block_k = min(2048 if some else 1024, max(MIN_BLOCK_K[fmt], _pow2_at_least(k)))
    rows = MX_WIDE_STEP_BYTES * (2 if fmt == "mxfp4" else 1) // 2048 if some else 16
    return DecodeVariant(rows, block_k, 8 if some else 4, 1)


def candidate_variants(n: int, k: int, batch: int, fmt: str) -> list[DecodeVariant]:
    """The variants the tuner sweeps for ``batch`` rows through an ``[n, k]`` ``fmt`` weight:
    row blocks of 8 .. 64, K steps of 1, 2 and 4 times the narrowest useful one, 4 or 8 warps
    (8 .. 128 fp32 weight values a thread), and K splits (up to 8, at least two steps each); one
    row through MX weights also each of those loading a step ahead (:func:`mx_ahead`).
    Weights of fewer 8-row blocks than 2 x :data:`TARGET_PROGRAMS` (o) also get 4-row blocks and
    steps of 8 times the narrowest; those of fewer than :data:`TARGET_PROGRAMS` / 2 (the router)
    2-row blocks and steps up to 64 times it (the whole row): their few programs each wait out
    one memory round trip a K step, so fewer, wider steps are what shortens them."""
    default = default_variant(n, k, batch, fmt)
    k_cap = max(MIN_BLOCK_K[fmt], _pow2_at_least(k))
    base = DEFAULT_BLOCK_K[fmt] // 2
    widths: tuple[int, ...] = (base, base * 2, base * 4)
    blocks: tuple[int, ...] = (8, 16, 32, 64)
    rows = row_count(n)
    if rows == "few":
        widths, blocks = widths + (base * 8, base * 16, base * 32, base * 64), (2, 4) + blocks
    elif rows == "some":
        widths, blocks = widths + (base * 8,), (4,) + blocks
    out = [default]
    for block_n in blocks:
        if block_n > max(8, _pow2_at_least(n)):
            continue
        for block_k in widths:
            if block_k > k_cap:
                continue
            for num_warps in (4, 8):
                if not 8 <= block_n * block_k // (32 * num_warps) <= 128:
                    continue
                for split in (1, 2, 4, 8):
                    if split > 1 and -(-k // block_k) < 2 * split:
                        break
                    for stages in (1, 2) if fmt != "bf16" and batch == 1 else (1,):
                        v = DecodeVariant(block_n, block_k, num_warps, split, stages)
                        if v not in out:
                            out.append(v)
    return out


def _pow2_at_least(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _check_rows(x: torch.Tensor, name: str) -> tuple[int, int]:
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"{name}: {list(x.shape)} {x.dtype}, expected bf16 [B, K]")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: {x.shape[0]} rows, the decode projections take 1 to {MAX_ROWS}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"{name}: strides {x.stride()}, the last dim must be contiguous")
    return x.shape[0], x.shape[1]


def _check_norm_inputs(
    hidden: torch.Tensor, add: torch.Tensor | None, norm_weight: torch.Tensor, k: int | None = None
) -> tuple[int, int]:
    """``(rows, width)`` of the norm's inputs, checked; ``k``: the weight's K, when one follows."""
    rows, h = _check_rows(hidden, "hidden")
    if k is not None and k != h:
        raise ValueError(f"weight: K {k} is not hidden's width {h}")
    if add is not None:
        _check_like(add, "add", (rows, h), (torch.float32, torch.bfloat16), hidden.device)
    _check_like(norm_weight, "norm_weight", (h,), None, hidden.device)
    return rows, h


def _check_like(
    t: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None, device: torch.device
) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: shape {list(t.shape)}, expected {list(shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected one of {', '.join(str(d) for d in dtypes)}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: dtype {t.dtype} is not a floating point type")
    if t.device != device:
        raise ValueError(f"{name} on {t.device}, the activations on {device}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: strides {t.stride()}, the last dim must be contiguous")


def _launch(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    n: int,
    variant: DecodeVariant | None,
    *,
    add: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, torch.Tensor, torch.Tensor | None] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch of the kernel on checked rows ``x``; returns ``out [B, N]`` bf16."""
    rows, k = x.shape
    fmt = weight_format(weight)
    wk = weight_shape(weight)[1]
    if wk != k:
        raise ValueError(f"weight: K {wk} is not the activations' width {k}")
    w_dev = weight.device if isinstance(weight, torch.Tensor) else weight.blocks.device
    if w_dev != x.device:
        raise ValueError(f"weight on {w_dev}, the activations on {x.device}")
    if bias is not None:
        _check_like(bias, "bias", (n,), None, x.device)
    variant = variant or default_variant(n, k, rows, fmt)
    reason = variant_reason(variant, fmt)
    if reason is not None:
        raise ValueError(f"variant {variant.name()}: {reason}")
    out = torch.empty((rows, n), dtype=torch.bfloat16, device=x.device)
    grid = launch_grid(n, variant)
    split = variant.split_k > 1
    part = torch.empty((variant.split_k, rows, n), dtype=torch.float32, device=x.device) if split else out
    counts = split_counters(x.device, grid[0]) if split else out
    if isinstance(weight, torch.Tensor):
        w, s, stride_wn, stride_wp, stride_sk = weight, weight, weight.stride(0), 0, 0
    else:
        w, s = weight.blocks, weight.scales
        stride_wn, stride_wp, stride_sk = 0, weight.blocks.stride(0), weight.scales.stride(0)
    nw, eps, summed, normed = norm if norm is not None else (x, 0.0, out, None)
    normed_t = normed if normed is not None else summed
    add_t = add if add is not None else x
    res_t = residual if residual is not None else out
    _gemv_kernel[grid](
        x, add_t, nw, w, s, bias if bias is not None else out, res_t, out, summed, normed_t, part, counts,
        n, k, float(eps),
        x.stride(0), add_t.stride(0), res_t.stride(0), out.stride(0), summed.stride(0), normed_t.stride(0),
        stride_wn, stride_wp, stride_sk,
        B=rows, B_PAD=_pow2_at_least(rows), BLOCK_N=variant.block_n, BLOCK_K=variant.block_k,
        SPLIT_K=variant.split_k, WFMT=_WFMT_IDS[fmt], NORM=norm is not None, HAS_ADD=add is not None,
        WANT_NORMED=normed is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        ASM=not interpreting(), SW_ROUND=interpreting(), DEFER=defers(variant, rows, fmt),
        OWN_ROW_LOOP=own_row_loop(variant, rows, fmt, norm is not None, k), ROW_BLOCK=_norm_row_block(k),
        MX_AHEAD=mx_ahead(variant, rows, fmt), EARLY_TILE=early_tile(variant, rows, fmt, n),
        num_warps=variant.num_warps, num_stages=variant.num_stages, **chain_launch(x.device),
    )  # fmt: skip
    return out
