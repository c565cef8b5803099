"""The variant space of the MoE kernel: which tactics exist, which fit a device, and a default.

Nothing here imports triton or queries a GPU: device facts arrive as a :class:`DeviceInfo`, so the
tuner, the runtime and the tests all prune the same way on any machine.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Literal

from prepkit.kernels.activations import ACTIVATION_POLICIES, ActivationPolicy
from prepkit.kernels.device import DeviceInfo
from prepkit.kernels.tactic import KNOB_NAMES, KNOBS, GemmTactic, knob
from prepkit.mx_formats import MX_FORMATS, pairing_reason

if TYPE_CHECKING:
    from prepkit.layer import MoeProblem

Gemm = Literal["gemm1", "gemm2"]
GEMMS: tuple[Gemm, ...] = ("gemm1", "gemm2")

# The knobs' domains (the table in prepkit.kernels.tactic), by the names the rules below use.
BLOCK_M = knob("block_m").domain
BLOCK_N = knob("block_n").domain
BLOCK_K = knob("block_k").domain
NUM_WARPS = knob("num_warps").domain
NUM_STAGES = knob("num_stages").domain
SPLIT_K = knob("split_k").domain
UPCASTS = knob("upcast").domain
WEIGHT_LOADS = knob("weight_load").domain
K_LOOPS = knob("k_loop").domain
SWAPPED_DOTS = knob("swapped_dot").domain
# Tiles of at most this many rows swap operands (the weight tile is the MMA's M side).
MAX_SWAPPED_ROWS = 32

# Accumulator plus the dequantized weight tile must stay in registers: beyond this many fp32
# values per thread the compiler spills, and such a variant never wins.
_MAX_VALUES_PER_THREAD = 256


# Bytes per activation value and per weight value handed to the matrix unit, by policy: bf16
# activations meet bf16-upcast weights; mxfp8 e4m3 meets weights widened to e4m3; mxfp4 e2m1
# meets the stored e2m1 bytes.
_ACT_BYTES = {"bf16": 2.0, "mxfp8": 1.0, "mxfp4": 0.5}


def shared_mem_bytes(t: GemmTactic, activations: ActivationPolicy = "bf16") -> int:
    """Upper estimate of the shared memory one program uses (pipelined operands + dot staging)."""
    a_bytes = int(t.block_m * t.block_k * _ACT_BYTES[activations])
    a_scales = 0 if activations == "bf16" else t.block_m * t.block_k // 32
    per_stage = a_bytes + a_scales + t.block_n * t.block_k // 2 + t.block_n * t.block_k // 32
    staging = int(t.block_k * t.block_n * _ACT_BYTES[activations])  # the weight tile as the MMA reads it
    return max(t.num_stages, 1) * per_stage + staging


def swaps_operands(t: GemmTactic, activations: ActivationPolicy = "bf16") -> bool:
    """Tiles of at most MAX_SWAPPED_ROWS rows run as ``W @ A^T``: the weight tile fills the MMA's
    wide side and the few tokens its narrow side (bf16 dot_scaled keeps its own operand order)."""
    return t.block_m <= MAX_SWAPPED_ROWS and (t.upcast != "dot_scaled" or activations != "bf16")


def joins_halves(t: GemmTactic) -> bool:
    """One dot per K step on the weight halves joined into group order: always on tiles that do
    not swap operands, by the ``swapped_dot`` knob on those that do."""
    return not swaps_operands(t) or t.swapped_dot == "joined"


def invalid_reason(t: GemmTactic, gemm: Gemm, device: DeviceInfo, activations: ActivationPolicy = "bf16") -> str | None:
    """Why ``t`` cannot run GEMM ``gemm`` on ``device`` with the ``activations`` policy, or
    ``None`` when it can."""
    if gemm not in GEMMS:
        return f"unknown gemm {gemm!r} (expected one of {GEMMS})"
    if activations not in ACTIVATION_POLICIES:
        return f"unknown activations {activations!r} (expected one of {ACTIVATION_POLICIES})"
    for k, value in t.knob_values():
        reason = k.reject(value)
        if reason is not None:
            return reason
    if activations != "bf16":
        reason = _mx_reason(t, gemm, activations)
        if reason is not None:
            return reason
    elif t.swapped_dot != "split" and not swaps_operands(t):
        # Larger tiles always join and dot_scaled has its own operand order: one variant each.
        return (
            f"swapped_dot {t.swapped_dot!r} only applies to tiles that swap operands "
            f"(block_m <= {MAX_SWAPPED_ROWS}, not dot_scaled)"
        )
    if t.k_loop != "tail" and t.upcast == "dot_scaled" and activations == "bf16":
        return "k_loop 'masked' is the dot_scaled path's only loop (it masks every step): use 'tail'"
    if t.upcast == "asm" and device.capability < (8, 0):
        return "upcast 'asm' uses bf16x2 FMA (sm_80 and newer)"
    if t.weight_load == "tma" and device.capability < (9, 0):
        return "weight_load 'tma' needs the tensor memory accelerator (sm_90 and newer)"
    if t.weight_load == "tma" and t.upcast == "dot_scaled" and activations == "bf16":
        return "weight_load 'tma' is not wired to the bf16 dot_scaled path"
    if t.weight_load == "tma" and t.num_stages < 3:
        # Two stages give the TMA weight tile a single shared-memory buffer; on H100 (triton 3.6)
        # such variants return wrong rows that change from launch to launch (docs/kernel-notes.md;
        # the GPU launch-stability test catches it). Three stages and more are exact.
        return "weight_load 'tma' needs at least 3 stages (with 2 the single TMA buffer races)"
    if gemm == "gemm1" and t.split_k != 1 and (t.block_m > MAX_SWAPPED_ROWS or activations != "bf16"):
        # SwiGLU needs the whole K sum: the splits' partial sums wait in a buffer of every pick's
        # row, worth it only where few row tiles leave SMs idle. Tested with bf16 activations.
        return f"gemm1 splits K only with bf16 activations and row tiles of at most {MAX_SWAPPED_ROWS} rows"
    smem = shared_mem_bytes(t, activations)
    if smem > device.max_shared_mem:
        return f"needs ~{smem} B of shared memory, device allows {device.max_shared_mem}"
    threads = 32 * t.num_warps
    values = (t.block_m * t.block_n + t.block_n * t.block_k // 2) // threads  # fp32 acc + bf16 tile
    if values > _MAX_VALUES_PER_THREAD:
        return f"{values} fp32 values per thread would spill (limit {_MAX_VALUES_PER_THREAD})"
    return None


def _mx_reason(t: GemmTactic, gemm: Gemm, activations: ActivationPolicy) -> str | None:
    """The rules MX activations add: one ``tl.dot_scaled`` of same-format operands per K step
    (the only form SM12x lowers to block-scaled MMA), and GEMM1 tiles that quantize whole
    32-value groups of their SwiGLU output."""
    if t.upcast != "dot_scaled":
        return (
            f"activations {activations!r} multiply through tl.dot_scaled (no bf16 upcast): "
            f"upcast must be 'dot_scaled', not {t.upcast!r}"
        )
    if t.swapped_dot != "split":
        return (
            f"swapped_dot {t.swapped_dot!r} is a knob of the bf16 path; "
            f"activations {activations!r} run one dot per K step"
        )
    if gemm == "gemm1" and t.block_n < 64:
        return (
            f"activations {activations!r}: GEMM1's epilogue quantizes whole 32-value groups of its "
            f"block_n/2 SwiGLU outputs, so block_n must be >= 64 (got {t.block_n})"
        )
    return None


def policy_variant(t: GemmTactic, gemm: Gemm, device: DeviceInfo, activations: ActivationPolicy) -> GemmTactic:
    """The variant of ``t`` that runs with ``activations``: ``t`` itself for bf16; for mxfp8/mxfp4
    the same tile through ``tl.dot_scaled`` (GEMM1 at least 64 wide), fewer stages if the result
    would not fit. Maps a bf16 default or tuned pair onto a policy that has none of its own."""
    from dataclasses import replace

    if activations == "bf16":
        return t
    cand = replace(t, upcast="dot_scaled", swapped_dot="split")
    if gemm == "gemm1":
        cand = replace(cand, block_n=max(cand.block_n, 64), split_k=1)
    for stages in dict.fromkeys((cand.num_stages, 3, 2, 1)):
        for load in dict.fromkeys((cand.weight_load, "ptr")):
            fit = replace(cand, num_stages=stages, weight_load=load)
            if invalid_reason(fit, gemm, device, activations) is None:
                return fit
    raise ValueError(
        f"no {activations} variant of {gemm} {t.key()} fits {device.name}: "
        f"{invalid_reason(cand, gemm, device, activations)}"
    )


def enumerate_tactics(
    gemm: Gemm, device: DeviceInfo, problem: MoeProblem | None = None, activations: ActivationPolicy = "bf16"
) -> list[GemmTactic]:
    """Every valid variant of ``gemm`` on ``device`` with the ``activations`` policy, in a stable
    order.

    With ``problem`` given, block_m larger than any expert's row count is dropped: such tiles only
    add masked rows.
    """
    out = []
    for values in itertools.product(*(k.domain for k in KNOBS)):
        t = GemmTactic(**dict(zip(KNOB_NAMES, values, strict=True)))
        if invalid_reason(t, gemm, device, activations) is not None:
            continue
        if problem is not None and t.block_m > max(16, next_pow2(problem.max_rows_per_expert)):
            continue
        out.append(t)
    return out


def default_tactics(
    problem: MoeProblem, device: DeviceInfo, activations: ActivationPolicy = "bf16"
) -> tuple[GemmTactic, GemmTactic]:
    """A variant pair that is valid on every device; good, not tuned. ``activations``: the policy
    the pair must run (bf16 variants mapped by :func:`policy_variant` elsewhere).

    SM12x (compute capability 12.x): see :func:`_sm12x_defaults`.

    Elsewhere, picked from sweeps on an H100 (the measurements are in docs/kernel-history.md): up
    to 12 rows per expert run 16-row tiles with swapped operands and, when the output tiles alone
    cannot cover the SMs, a K split in GEMM2; more rows run 64 x 256 x 64 tiles, except GEMM1 with
    32 x 256 x 64 TMA tiles up to 24 rows. The inline-PTX upcast wins everywhere it can run; the
    few-row tiles load weights through the TMA unit where the device has one.
    """
    if device.capability[0] == 12:
        return _sm12x_defaults(problem, device, activations)
    pair = _measured_defaults(problem, device)
    return (
        policy_variant(pair[0], "gemm1", device, activations),
        policy_variant(pair[1], "gemm2", device, activations),
    )


def _measured_defaults(problem: MoeProblem, device: DeviceInfo) -> tuple[GemmTactic, GemmTactic]:
    active = max(1, min(problem.num_experts, problem.num_tokens * problem.top_k))
    rows = -(-problem.num_tokens * problem.top_k // active)
    upcast = "asm" if device.capability >= (8, 0) else "bits"
    if rows <= 12:
        load = "tma" if device.capability >= (9, 0) else "ptr"
        # With TMA weight loads 128 x 128 tiles with 4 stages won at 8 and 64 tokens; one token (four
        # experts, too few tiles for 128-row programs) and pointer loads keep 64 x 256. At one token
        # with TMA, the tuned H100 and H200 picks: 4 stages, every K step masked, GEMM1 joined.
        tma_tiles = load == "tma" and problem.num_tokens > 1
        one_token = load == "tma" and problem.num_tokens == 1
        bn, bk, stages = (128, 128, 4) if tma_tiles else (64, 256, 4 if one_token else 3)
        k_loop = "masked" if one_token else "tail"
        split1 = _one_token_gemm1_split(problem, active, bn, device)
        g1 = GemmTactic(16, bn, bk, 4, stages, split1, upcast, load, k_loop, "joined" if one_token else "split")
        tiles = active * -(-problem.hidden // bn)
        split = max(1, min(4, next_pow2(-(-2 * device.sm_count // tiles))))
        g2 = GemmTactic(16, bn, bk, 4, stages, split, upcast, load, k_loop)
    else:
        # Measured with pointer loads only (TMA is left to the tuner here).
        g2 = GemmTactic(64, 256, 64, 4, 3, 1, upcast, "ptr")
        # GEMM1 up to 24 rows: the tuner's pick at 385-768 tokens on an H100, TP 1 and 2 (1.2x).
        few_rows = rows <= 24 and device.capability >= (9, 0)
        g1 = GemmTactic(32, 256, 64, 4, 4, 1, upcast, "tma") if few_rows else g2
    return _fit(g1, "gemm1", device), _fit(g2, "gemm2", device)


def _one_token_gemm1_split(problem: MoeProblem, active: int, block_n: int, device: DeviceInfo) -> int:
    """GEMM1's K split at one token: the four picks' N tiles of a TP rank leave SMs idle, so split
    K (at most 4) while the programs stay within one wave at three an SM. On an H200 at one token,
    the layer of a TP 2 rank took 26.0 -> 21.6 us with 2 splits; TP 1 (360 tiles) lost with any
    split; a TP 4 rank was level with 4 (docs/kernel-history.md)."""
    if problem.num_tokens != 1:
        return 1
    tiles = active * -(-2 * problem.intermediate // block_n)
    split = 1
    while split < 4 and tiles * split * 2 <= 3 * device.sm_count:
        split *= 2
    return split


def _sm12x_defaults(
    problem: MoeProblem, device: DeviceInfo, activations: ActivationPolicy
) -> tuple[GemmTactic, GemmTactic]:
    """SM12x defaults (docs/sm12x.md), read off the compile reports of
    ``prepkit.kernels.compile_check`` for sm_120a / sm_121a: variants that compile without spills
    and within the 99 KiB of shared memory a block may use; at decode enough programs (and weight
    tiles in flight) per SM to cover DRAM latency; then the most warps resident per SM
    (``mma.sync`` is synchronous: warps hide each other's latency).

    Up to 12 rows per expert: 16 x 128 x 128 swapped tiles, 3 stages (25 KiB of shared memory for
    bf16, 21 KiB for mxfp8: three or four programs fit an SM); 16 x 64 x 256 when the 128-wide GEMM1
    tiles of the active experts are fewer than the SMs (one token on an RTX PRO 6000: the same bytes
    per stage, twice the programs); GEMM2 splits K until its programs are twice the SMs (at most 4);
    at one token with bf16 activations GEMM1 splits K by the Hopper rule
    (:func:`_one_token_gemm1_split`: a TP rank of an RTX PRO 6000, 180 tiles of 16 x 64 on 188 SMs,
    splits in two; not timed on SM12x, and ``prepkit tune`` keeps it only where it is fastest).
    Up to 32 rows: 32 x 128 x 128, 3 stages. More: 64 x 128 x 64, 3 stages, 4 warps (230 registers
    and 41 KiB: two programs per SM; the sm90 default 64 x 256 x 64 needs 255 registers and 65 KiB,
    one program of 4 warps per SM). Pointer loads throughout: on sm_120a the K step has the same
    instructions as with TMA loads, and it is the path every GPU runs. The upcast is inline PTX for
    bf16 and ``tl.dot_scaled`` (native block-scaled MMA) for mxfp8 / mxfp4.
    """
    active = max(1, min(problem.num_experts, problem.num_tokens * problem.top_k))
    rows = -(-problem.num_tokens * problem.top_k // active)
    upcast = "asm" if activations == "bf16" else "dot_scaled"
    if rows <= 12:
        bn, bk = (128, 128) if active * -(-2 * problem.intermediate // 128) >= device.sm_count else (64, 256)
        split1 = _one_token_gemm1_split(problem, active, bn, device) if activations == "bf16" else 1
        g1 = GemmTactic(16, bn, bk, 4, 3, split1, upcast, "ptr")
        tiles = active * -(-problem.hidden // bn)
        split = max(1, min(4, next_pow2(-(-2 * device.sm_count // tiles))))
        g2 = GemmTactic(16, bn, bk, 4, 3, split, upcast, "ptr")
    elif rows <= 32:
        g1 = g2 = GemmTactic(32, 128, 128, 4, 3, 1, upcast, "ptr")
    else:
        g1 = g2 = GemmTactic(64, 128, 64, 4, 3, 1, upcast, "ptr")
    return (
        _fit(g1, "gemm1", device, activations),
        _fit(g2, "gemm2", device, activations),
    )


def _fit(t: GemmTactic, gemm: Gemm, device: DeviceInfo, activations: ActivationPolicy = "bf16") -> GemmTactic:
    """Shrink stages (then pointer loads, which may run fewer stages than TMA), then tiles, until
    ``t`` is valid: the default must always run."""
    from dataclasses import replace

    for load in dict.fromkeys((t.weight_load, "ptr")):
        for stages in (t.num_stages, 3, 2, 1):
            cand = replace(t, num_stages=stages, weight_load=load)
            if invalid_reason(cand, gemm, device, activations) is None:
                return cand
    for bm, bn, bk in ((t.block_m, 64, 64), (64, 64, 64), (16, 64, 64), (16, 32, 64)):
        for stages in (2, 1):
            cand = replace(t, block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=4, weight_load="ptr")
            if invalid_reason(cand, gemm, device, activations) is None:
                return cand
    raise ValueError(f"no {gemm} variant fits {device.name} ({device.max_shared_mem} B shared memory)")


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


# ---------------------------------------------------------------------------- dense MX linear
# The dense linear (prepkit.kernels.mx.dense) runs the MoE mainloops as one expert with no
# routing: the same knobs, with split-K always meaningful and the weight format's panel.


def dense_invalid_reason(
    t: GemmTactic, fmt: str, device: DeviceInfo, activations: ActivationPolicy = "bf16"
) -> str | None:
    """Why ``t`` cannot run the dense linear on ``fmt`` weights (``mxfp4``/``mxfp8``) on
    ``device`` with the ``activations`` policy, or ``None`` when it can. The MoE rules of a GEMM
    that may split K, plus the weight format's own."""
    if fmt not in MX_FORMATS:
        return f"unknown dense weight format {fmt!r} (expected one of {tuple(MX_FORMATS)})"
    pairing = pairing_reason(activations, fmt)
    if pairing is not None:
        return pairing
    panel_k = MX_FORMATS[fmt].panel_k
    if panel_k % t.block_k:
        return f"block_k {t.block_k} does not divide the {fmt} weights' {panel_k}-element K panel"
    if fmt == "mxfp8":
        if t.upcast == "asm":
            return "mxfp8 weights widen by a conversion, not inline PTX: upcast 'bits' (or 'dot_scaled')"
        if t.swapped_dot != "split":
            return "swapped_dot is a knob of mxfp4 weights (their two halves per byte); mxfp8 has one"
    reason = invalid_reason(t, "gemm2", device, activations)
    if reason is not None:
        return reason
    if fmt == "mxfp8":
        # The e4m3 weight tile is a byte per element: twice the mxfp4 tile in shared memory.
        smem = shared_mem_bytes(t, activations) + max(t.num_stages, 1) * t.block_n * t.block_k // 2
        if smem > device.max_shared_mem:
            return f"needs ~{smem} B of shared memory, device allows {device.max_shared_mem}"
    return None


def dense_default(
    tokens: int, n: int, k: int, fmt: str, device: DeviceInfo, activations: ActivationPolicy = "bf16"
) -> GemmTactic:
    """A valid, untuned variant of the dense linear for ``tokens`` rows of an ``[n, k]`` weight.

    Up to 16 rows: 16-row swapped tiles (the weights fill the MMA's wide side), 64 columns a
    program and one whole panel per K step (mxfp8: 128 columns, 128-element steps); a weight
    wide enough for twice the SMs with 256 columns a program (lm_head) takes mxfp4 in 256 x 64
    steps four deep. Then K splits until the programs are at least twice the SMs (o_proj's 45
    column tiles at one token split 8 ways; lm_head's do not split), each split keeping at least
    two K steps. Up to 32 rows, 32-row tiles; more, 64 x 128 x 64 tiles. Weights load through
    the TMA unit where there is one. The upcast: inline PTX for mxfp4 weights with bf16
    activations, the e4m3 conversion for mxfp8 weights, ``tl.dot_scaled`` for MX activations.
    (The fastest of a sweep on an H100 at gpt-oss's shapes, 1 and 8 tokens: docs/kernel-notes.md.)
    """
    from dataclasses import replace

    if fmt not in MX_FORMATS:
        raise ValueError(f"unknown dense weight format {fmt!r} (expected one of {tuple(MX_FORMATS)})")
    panel_k = MX_FORMATS[fmt].panel_k
    if activations != "bf16":
        upcast = "dot_scaled"
    elif fmt == "mxfp4" and device.capability >= (8, 0):
        upcast = "asm"
    else:
        upcast = "bits"
    stages = 3
    if tokens <= 32:
        bm, bn, bk = (16 if tokens <= 16 else 32), 64, panel_k
        if fmt == "mxfp8":
            bn, bk = 128, 128
        elif upcast == "asm" and -(-n // 256) >= 2 * device.sm_count:
            bn, bk, stages = 256, 64, 4
    else:
        bm, bn, bk = 64, 128, 64
    programs = -(-n // bn) * -(-max(tokens, 1) // bm)
    steps = -(-k // bk)
    split = 1
    while split < 8 and programs * split < 2 * device.sm_count and steps >= 4 * split:
        split *= 2
    t = GemmTactic(bm, bn, bk, 4, stages, split, upcast, "tma" if device.capability >= (9, 0) else "ptr")
    for load in dict.fromkeys((t.weight_load, "ptr")):
        for stages in range(t.num_stages, 0, -1):
            cand = replace(t, num_stages=stages, weight_load=load)
            if dense_invalid_reason(cand, fmt, device, activations) is None:
                return cand
    for bn in (32, 16):
        cand = replace(t, block_n=bn, block_k=64, num_stages=2, weight_load="ptr")
        if dense_invalid_reason(cand, fmt, device, activations) is None:
            return cand
    raise ValueError(f"no dense {fmt} variant fits {device.name}: {dense_invalid_reason(t, fmt, device, activations)}")


def enumerate_dense_tactics(
    fmt: str, device: DeviceInfo, tokens: int | None = None, activations: ActivationPolicy = "bf16"
) -> list[GemmTactic]:
    """Every valid variant of the dense linear on ``fmt`` weights, in a stable order; with
    ``tokens``, row tiles larger than the rows are dropped (they only add masked rows)."""
    out = []
    for values in itertools.product(*(k.domain for k in KNOBS)):
        t = GemmTactic(**dict(zip(KNOB_NAMES, values, strict=True)))
        if tokens is not None and t.block_m > max(16, next_pow2(tokens)):
            continue
        if dense_invalid_reason(t, fmt, device, activations) is None:
            out.append(t)
    return out


def dense_sweep_space(
    fmt: str, device: DeviceInfo, tokens: int, n: int, k: int, activations: ActivationPolicy = "bf16"
) -> list[GemmTactic]:
    """The variants worth timing for one dense shape: the valid space cut to 4 warps, 3 or 4
    stages, the default's upcast (MX activations allow one anyway), the tail loop, split swapped
    dots, the smallest row tile that holds the rows, and K splits only where the column tiles
    alone leave SMs idle. What a sweep on the GPU (benchmarks/bench_dense.py --sweep) times."""
    base = dense_default(tokens, n, k, fmt, device, activations)
    bm = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    out = []
    for t in enumerate_dense_tactics(fmt, device, tokens, activations):
        if (t.block_m, t.num_warps, t.upcast, t.k_loop, t.swapped_dot) != (bm, 4, base.upcast, "tail", "split"):
            continue
        if t.num_stages not in (3, 4) or t.block_n < 32:
            continue
        if t.split_k > 1 and -(-n // t.block_n) * -(-tokens // bm) >= 4 * device.sm_count:
            continue
        out.append(t)
    return out
