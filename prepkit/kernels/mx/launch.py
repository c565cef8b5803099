"""The host side of the layer: argument checks, grids and the launches of the four kernels
(:class:`Routing` and :class:`Workspace`, re-exported here, live in :mod:`._buffers`)."""

from __future__ import annotations

import torch
import triton

from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.device import DeviceInfo
from prepkit.kernels.mx._buffers import Routing, Workspace, empty_h1
from prepkit.kernels.mx._chain import chain_launch
from prepkit.kernels.mx._gemm import _gemm1_swiglu_kernel, _gemm2_combine_kernel
from prepkit.kernels.mx._ids import ACT_IDS, UPCAST_IDS
from prepkit.kernels.mx._mx_rows import MxRows
from prepkit.kernels.mx._record import launch, zero
from prepkit.kernels.mx._routing import _route_kernel, _scatter_kernel
from prepkit.kernels.mx._target import interpreting, launch_capability
from prepkit.kernels.mx._upcast import UPCAST_ASM_FOLDED
from prepkit.kernels.mx.dense import split_counters
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import invalid_reason, joins_halves, next_pow2, swaps_operands
from prepkit.layouts.triton_moe import PANEL_BYTES, PANEL_K

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def upcast_id(tactic: GemmTactic, small_scales: bool) -> int:
    """The kernel's UPCAST constant: ``asm`` with ``small_scales`` (every E8M0 byte of the GEMM's
    scales is at most 128, i.e. scales <= 2; ``MoeLayer`` checks once at load) runs one bf16 FMA
    fewer per value pair. The values are the same bits for scale
    bytes 1..128; byte 0 (2^-127) becomes exact where the two-step path flushes it to zero. A
    wrong ``True`` gives wrong values for scales above 2."""
    if tactic.upcast == "asm" and small_scales:
        return UPCAST_ASM_FOLDED.value
    return UPCAST_IDS[tactic.upcast]


def routes_in_gemms(num_tokens: int, activations: ActivationPolicy) -> bool:
    """Whether the GEMMs route the call themselves (no routing launch): one token with bf16
    activations. Each GEMM program then takes one of the token's picks, so nothing needs grouping;
    the MX policies keep the routing launch, which also quantizes the token's row."""
    return num_tokens == 1 and activations == "bf16"


def row_blocks(routing: Routing, block_m: int) -> int:
    """The GEMMs' row-block programs for ``routing``: one per pick when the GEMMs route, else an
    upper bound over the groups (:func:`max_row_blocks`)."""
    if routing.logits is not None:
        return routing.num_picks
    return max_row_blocks(routing.num_picks, routing.num_local_experts, block_m)


def max_row_blocks(num_picks: int, num_local_experts: int, block_m: int) -> int:
    """Upper bound of sum over experts of ceil(rows_e / block_m) when the rows sum to at most
    ``num_picks``: each non-empty expert wastes at most ``block_m - 1`` rows of its last block."""
    busy = min(num_local_experts, num_picks)
    return (num_picks + busy * (block_m - 1)) // block_m


def _check_tactic(t: GemmTactic, name: str, activations: ActivationPolicy = "bf16") -> None:
    if activations != "bf16":
        reason = invalid_reason(t, name, _ANY_DEVICE, activations)  # type: ignore[arg-type]
        if reason is not None:
            raise ValueError(f"{name}: tactic {t.key()} cannot run with activations {activations!r}: {reason}")
    for knob, value in t.knob_values():
        # Every path the table names must exist in the kernel; tile sizes go by the tile rule below.
        reason = knob.reject(value) if knob.family else None
        if reason is not None:
            raise ValueError(f"{name}: {reason}")
    if t.upcast == "asm" and interpreting():
        raise ValueError(f"{name}: upcast 'asm' is inline PTX and cannot run under TRITON_INTERPRET")
    if PANEL_K % t.block_k or t.block_k < 32 or t.block_m < 16 or t.block_n < 16:
        raise ValueError(
            f"{name}: tile {t.key()} needs block_k in (32, 64, 128, 256) (a divisor of the "
            f"{PANEL_K}-element K panel) and block_m, block_n >= 16"
        )


def _check_panels(w_blocks: torch.Tensor, k: int, name: str) -> None:
    """``w_blocks`` must be ``[E, K_panels, N, PANEL_BYTES]`` with enough panels for ``k``."""
    if w_blocks.dim() != 4 or w_blocks.shape[3] != PANEL_BYTES or w_blocks.shape[1] * PANEL_K < k:
        raise ValueError(
            f"{name}: weights {list(w_blocks.shape)} are not [E, K/{PANEL_K}, N, {PANEL_BYTES}] panels "
            f"covering K = {k} (triton_moe_v3)"
        )


# The device-independent rules of invalid_reason: any sm_90+ part with room for every tile.
_ANY_DEVICE = DeviceInfo("any", (9, 0), 1, 1 << 30)


def weight_descriptor(
    w_blocks: torch.Tensor, tactic: GemmTactic, activations: ActivationPolicy = "bf16"
) -> object | None:
    """A TMA descriptor of the panels ``w_blocks [E, K_panels, N, PANEL_BYTES]`` as
    ``[E*K_panels*N, PANEL_BYTES]`` with ``[block_n, block_k/2]`` boxes when ``tactic`` asks for
    TMA loads and the tensor allows them (contiguous, 16-byte aligned base, a device with the unit
    or the interpreter); ``None`` means pointer loads."""
    if tactic.weight_load != "tma" or (tactic.upcast == "dot_scaled" and activations == "bf16"):
        return None
    if not w_blocks.is_contiguous() or w_blocks.shape[-1] % 16 or w_blocks.data_ptr() % 16:
        return None
    cap = launch_capability(w_blocks.device)
    if not interpreting() and not (cap is not None and cap >= (9, 0)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = w_blocks.view(-1, w_blocks.shape[-1])
    return TensorDescriptor.from_tensor(flat, [tactic.block_n, tactic.block_k // 2])


def route(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    expert_lo: int,
    num_local_experts: int,
    hidden: int,
    out: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    activations: ActivationPolicy = "bf16",
    workspace: Workspace | None = None,
    in_gemms: bool = True,
) -> Routing:
    """Launch routing (top-k, softmax, counters, output zeroing) and grouping; with an MX
    ``activations`` policy the same launch quantizes ``hidden_states`` (contiguous bf16
    ``[T, hidden]``) into ``Routing.x_mx``. Where :func:`routes_in_gemms` (and ``in_gemms``) it
    launches nothing and leaves all of that to GEMM1 (:class:`Routing`)."""
    T, E_total = router_logits.shape
    device = router_logits.device
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits must be contiguous in its last dim")
    act = ACT_IDS[check_policy(activations)]
    if act:
        if hidden_states is None or tuple(hidden_states.shape) != (T, hidden) or not hidden_states.is_contiguous():
            got = None if hidden_states is None else list(hidden_states.shape)
            raise ValueError(f"activations {activations!r} need contiguous hidden_states [{T}, {hidden}], got {got}")
        if hidden % 32:
            raise ValueError(f"activations {activations!r} need hidden a multiple of 32, got {hidden}")
    TK = T * top_k
    if out is None:
        out = torch.empty((T, hidden), dtype=torch.float32, device=device)
    e_pad_all = max(16, next_pow2(E_total))
    e_pad_local = max(16, next_pow2(num_local_experts))
    # Up to 32 tokens (128 experts) one program routes them all and groups the picks itself.
    block_t = max(1, min(32, 4096 // e_pad_all, next_pow2(T)))
    programs = triton.cdiv(T, block_t)
    if workspace is None:
        workspace = Workspace.empty(
            tokens=T, top_k=top_k, num_local_experts=num_local_experts, hidden=hidden, activations=activations,
            device=device,
        )  # fmt: skip
    counts, topk_ids, topk_w, rank, sorted_picks, x_mx = (
        workspace.counts, workspace.topk_ids, workspace.topk_weights, workspace.rank, workspace.sorted_picks,
        workspace.x_mx,
    )  # fmt: skip
    if programs != 1:
        # Counters start at zero for the atomics of several programs; one program writes them whole.
        zero(counts)
    if act and x_mx is None:
        raise ValueError(f"activations {activations!r}: the workspace holds no rows to quantize into (x_mx)")
    one_token = in_gemms and routes_in_gemms(T, activations)
    if one_token and e_pad_all > 4096:
        raise ValueError(f"one-token routing holds up to 4096 experts in a program, got {E_total}")
    routing = Routing(
        T, top_k, num_local_experts, counts, sorted_picks, topk_ids, topk_w, out, activations, x_mx,
        router_logits if one_token else None, expert_lo,
    )  # fmt: skip
    if one_token:
        return routing
    if T == 0:
        return routing
    block_h = 128
    picks_per_program = block_t * next_pow2(top_k)
    launch(
        _route_kernel,
        (programs, max(1, triton.cdiv(hidden, block_h))),
        router_logits,
        topk_ids,
        topk_w,
        rank,
        counts,
        sorted_picks,
        out,
        T,
        E_total,
        hidden,
        router_logits.stride(0),
        out.stride(0),
        expert_lo,
        num_local_experts,
        hidden_states if act else None,
        x_mx.codes if x_mx is not None and act else None,
        x_mx.scales if x_mx is not None and act else None,
        TOP_K=top_k,
        BLOCK_T=block_t,
        E_PAD=e_pad_all,
        BLOCK_H=block_h,
        E_LOCAL_PAD=e_pad_local,
        TOPK_PAD=next_pow2(top_k),
        PLACE=programs == 1,  # one launch fewer for few tokens
        ACT=act,
        **chain_launch(device),
        # Grouping 128 picks in one program compares every pair: more warps for more picks.
        num_warps=4 if picks_per_program <= 32 else 8 if picks_per_program <= 64 else 16,
    )
    if programs > 1:
        scatter_block = 128
        launch(
            _scatter_kernel,
            (triton.cdiv(TK, scatter_block),),
            topk_ids,
            rank,
            counts,
            sorted_picks,
            TK,
            expert_lo,
            num_local_experts,
            E_PAD=e_pad_local,
            BLOCK=scatter_block,
            **chain_launch(device),
        )
    return routing


def gemm1_swiglu(
    routing: Routing,
    hidden_states: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_bias: torch.Tensor,
    *,
    valid_intermediate: int,
    tactic: GemmTactic,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    small_scales: bool = False,
    activations: ActivationPolicy = "bf16",
    h1_out: torch.Tensor | MxRows | None = None,
) -> torch.Tensor | MxRows:
    """GEMM1 + SwiGLU: bf16 ``[T*k, valid_intermediate]`` activations in grouped order, or with
    an MX policy the same rows quantized (:class:`MxRows`; GEMM1 then reads ``routing.x_mx``, so
    the routing must have been made with the same policy). ``small_scales``: see :func:`upcast_id`."""
    act = ACT_IDS[check_policy(activations)]
    _check_tactic(tactic, "gemm1", activations)
    if routing.activations != activations:
        raise ValueError(f"gemm1 runs activations {activations!r}, the routing quantized for {routing.activations!r}")
    T, H = hidden_states.shape
    _check_panels(w13_blocks, H, "w13_blocks")
    if w13_scales.shape[1] * 32 != H:
        raise ValueError(f"w13 is for hidden {w13_scales.shape[1] * 32}, activations have {H}")
    if hidden_states.stride(1) != 1:
        raise ValueError("hidden_states must be contiguous in its last dim")
    TK = routing.num_picks
    device = hidden_states.device
    if act and valid_intermediate % 32:
        raise ValueError(f"activations {activations!r} need valid_intermediate a multiple of 32")
    h1 = h1_out if h1_out is not None else empty_h1(TK, valid_intermediate, activations, device)
    if TK == 0:
        return h1
    E_local = routing.num_local_experts
    n1 = 2 * valid_intermediate
    split = tactic.split_k
    grid = (row_blocks(routing, tactic.block_m), triton.cdiv(n1, tactic.block_n), split)
    # The splits' partial sums, [split, picks, n1] fp32: splits pay at a few tokens only.
    part = torch.empty((split, TK, n1), dtype=torch.float32, device=device) if split > 1 else None
    counts = split_counters(device, grid[0] * grid[1]) if split > 1 else None
    logits, out = routing.logits, routing.out
    num_experts = 0 if logits is None else logits.shape[1]  # 0: the grouped path
    w_desc = weight_descriptor(w13_blocks, tactic, activations)
    x_mx = routing.x_mx if act else None
    if act and (x_mx is None or not isinstance(h1, MxRows)):
        raise ValueError(f"gemm1: activations {activations!r} need the routing's quantized rows and MX output rows")
    x_in = x_mx.codes if x_mx is not None else hidden_states
    launch(
        _gemm1_swiglu_kernel,
        grid,
        x_in,
        w13_blocks,
        w13_blocks if w_desc is None else w_desc,
        w13_scales,
        w13_bias,
        routing.counts,
        routing.sorted_picks,
        h1.codes if isinstance(h1, MxRows) else h1,
        x_mx.scales if x_mx is not None else None,
        h1.scales if isinstance(h1, MxRows) else None,
        n1,
        H,
        E_local,
        x_in.stride(0),
        w13_blocks.stride(0),
        w13_scales.stride(0),
        w13_scales.stride(1),
        w13_bias.stride(0),
        h1.codes.stride(0) if isinstance(h1, MxRows) else h1.stride(0),
        w13_blocks.shape[2],
        w13_blocks.shape[1],
        swiglu_alpha,
        swiglu_limit,
        logits,
        routing.topk_ids,
        routing.topk_weights,
        out,
        num_experts,
        routing.expert_lo,
        out.shape[1],
        part,
        counts,
        TK,
        TOP_K=routing.top_k,
        E_PAD=max(16, next_pow2(E_local)),
        BLOCK_M=tactic.block_m,
        BLOCK_N=tactic.block_n,
        BLOCK_K=tactic.block_k,
        UPCAST=upcast_id(tactic, small_scales),
        DOT_FP32=interpreting(),
        SWAP=swaps_operands(tactic, activations),
        JOIN=joins_halves(tactic),
        W_TMA=w_desc is not None,
        MASK_ALL=tactic.k_loop == "masked",
        PANEL_K=PANEL_K,
        ACT=act,
        **chain_launch(device),
        num_warps=tactic.num_warps,
        num_stages=tactic.num_stages,
        ONE_TOKEN=logits is not None,
        E_PAD_ALL=max(16, next_pow2(num_experts)),
        # The first row block's programs zero the output row between them.
        ZERO_BLOCK=max(16, next_pow2(triton.cdiv(out.shape[1], grid[1]))) if logits is not None else 16,
        SPLIT_K=split,
        # One copy of the logits a warp: the top-4 reduces inside each warp.
        PICK_COPIES=tactic.num_warps if logits is not None else 1,
    )
    return h1


def gemm2_combine(
    routing: Routing,
    h1: torch.Tensor | MxRows,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor | None,
    *,
    tactic: GemmTactic,
    small_scales: bool = False,
    activations: ActivationPolicy = "bf16",
) -> torch.Tensor:
    """GEMM2 + bias + routing weight + sum over picks, accumulated into ``routing.out``. ``h1``
    is what :func:`gemm1_swiglu` returned for the same ``activations`` and ``routing`` (whose
    picks GEMM1 wrote where the GEMMs route). ``small_scales``: see :func:`upcast_id`."""
    act = ACT_IDS[check_policy(activations)]
    _check_tactic(tactic, "gemm2", activations)
    if isinstance(h1, MxRows) != bool(act) or (isinstance(h1, MxRows) and h1.activations != activations):
        got = h1.activations if isinstance(h1, MxRows) else "bf16"
        raise ValueError(f"gemm2 runs activations {activations!r}, h1 holds {got!r} rows")
    out = routing.out
    TK = routing.num_picks
    if TK == 0:
        return out
    H = out.shape[1]
    K = h1.num_cols if isinstance(h1, MxRows) else h1.shape[1]
    _check_panels(w2_blocks, K, "w2_blocks")
    if w2_blocks.shape[2] != H:
        raise ValueError(f"w2 is for hidden {w2_blocks.shape[2]}, the output has {H}")
    E_local = routing.num_local_experts
    has_bias = w2_bias is not None
    grid = (row_blocks(routing, tactic.block_m), triton.cdiv(H, tactic.block_n), tactic.split_k)
    w_desc = weight_descriptor(w2_blocks, tactic, activations)
    h_in = h1.codes if isinstance(h1, MxRows) else h1
    launch(
        _gemm2_combine_kernel,
        grid,
        h_in,
        w2_blocks,
        w2_blocks if w_desc is None else w_desc,
        w2_scales,
        w2_bias if has_bias else out,
        routing.counts,
        routing.sorted_picks,
        routing.topk_weights,
        out,
        h1.scales if isinstance(h1, MxRows) else None,
        H,
        K,
        E_local,
        h_in.stride(0),
        w2_blocks.stride(0),
        w2_scales.stride(0),
        w2_scales.stride(1),
        w2_bias.stride(0) if w2_bias is not None else 0,
        out.stride(0),
        w2_blocks.shape[2],
        w2_blocks.shape[1],
        routing.topk_ids,
        routing.expert_lo,
        TOP_K=routing.top_k,
        E_PAD=max(16, next_pow2(E_local)),
        BLOCK_M=tactic.block_m,
        BLOCK_N=tactic.block_n,
        BLOCK_K=tactic.block_k,
        SPLIT_K=tactic.split_k,
        UPCAST=upcast_id(tactic, small_scales),
        DOT_FP32=interpreting(),
        SWAP=swaps_operands(tactic, activations),
        JOIN=joins_halves(tactic),
        HAS_BIAS=has_bias,
        W_TMA=w_desc is not None,
        MASK_ALL=tactic.k_loop == "masked",
        PANEL_K=PANEL_K,
        ACT=act,
        **chain_launch(out.device),
        num_warps=tactic.num_warps,
        num_stages=tactic.num_stages,
        ONE_TOKEN=routing.logits is not None,
    )
    return out


def fused_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_bias: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor | None,
    *,
    top_k: int,
    expert_lo: int,
    valid_intermediate: int,
    gemm1: GemmTactic,
    gemm2: GemmTactic,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    out: torch.Tensor | None = None,
    small_scales: tuple[bool, bool] = (False, False),
    activations: ActivationPolicy = "bf16",
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """One MoE layer for this rank's experts. Returns the fp32 ``[T, H]`` sum over the token's picks
    that live on this rank (``out`` if given). ``w2_bias=None`` skips the down bias (TP ranks but
    one). Shapes as in the module docstring; ``router_logits`` is ``[T, E_total]`` over all experts.
    ``small_scales``: (w13, w2), see :func:`upcast_id`. ``activations``: the precision policy
    (module docstring); the tactics must be valid for it
    (:func:`prepkit.kernels.variants.invalid_reason`, :func:`~prepkit.kernels.variants.policy_variant`).
    ``workspace``: the buffers between launches (:class:`Workspace`, with GEMM1's rows), else new ones.
    """
    T, H = hidden_states.shape
    if router_logits.shape[0] != T:
        raise ValueError(f"router_logits has {router_logits.shape[0]} rows, hidden_states {T}")
    routing = route(
        router_logits,
        top_k=top_k,
        expert_lo=expert_lo,
        num_local_experts=w13_blocks.shape[0],
        hidden=H,
        out=out,
        hidden_states=hidden_states,
        activations=activations,
        workspace=workspace,
    )
    h1 = gemm1_swiglu(
        routing,
        hidden_states,
        w13_blocks,
        w13_scales,
        w13_bias,
        valid_intermediate=valid_intermediate,
        tactic=gemm1,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        small_scales=small_scales[0],
        activations=activations,
        h1_out=None if workspace is None else workspace.h1,
    )
    return gemm2_combine(
        routing, h1, w2_blocks, w2_scales, w2_bias, tactic=gemm2, small_scales=small_scales[1], activations=activations
    )


__all__ = [
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "Routing",
    "Workspace",
    "empty_h1",
    "fused_moe",
    "gemm1_swiglu",
    "gemm2_combine",
    "max_row_blocks",
    "route",
    "routes_in_gemms",
    "row_blocks",
    "upcast_id",
    "weight_descriptor",
]
