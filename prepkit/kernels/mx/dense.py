"""The host side of the dense MX linear (:mod:`~prepkit.kernels.mx._dense`): the weights,
argument checks, the default variant and the launches.

``mx_linear(x, weights, bias)`` is ``x @ W^T + bias`` for bf16 ``x [..., K]`` and a weight stored
by :mod:`prepkit.layouts.dense_mx` (``mxfp4`` or ``mxfp8``). Activation policies as in the MoE
layer (:mod:`prepkit.kernels.activations`): ``bf16`` multiplies the widened weights; ``mxfp8``
quantizes each row to e4m3 with one E8M0 scale per 32 values (one small launch before the GEMM)
and runs ``tl.dot_scaled`` e4m3 x e4m3, SM12x's native block-scaled MMA; ``mxfp4`` (mxfp4 weights
only) e2m1 x e2m1. With a K split, the last split of each tile to finish reduces the others'
fp32 partial sums and writes the output, in the same launch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.device import ARCH_DEVICES, H100, DeviceInfo
from prepkit.kernels.mx._chain import chain_launch
from prepkit.kernels.mx._dense import _dense_kernel, _quantize_rows_kernel
from prepkit.kernels.mx._ids import ACT_IDS, UPCAST_IDS, WFMT_IDS
from prepkit.kernels.mx._mx_rows import MxRows
from prepkit.kernels.mx._record import launch
from prepkit.kernels.mx._target import interpreting, launch_capability, stream_key
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import dense_default, dense_invalid_reason, joins_halves, swaps_operands
from prepkit.layouts.dense_mx import mx_format
from prepkit.layouts.triton_moe import PANEL_BYTES
from prepkit.mx_formats import MX_FORMATS, pairing_reason

# Rows and columns one program of the row quantizer covers.
_QUANT_ROWS = 16
_QUANT_COLS = 128


@dataclass(frozen=True)
class DenseMxWeights:
    """One dense weight ``[n, k]`` in the stored MX form: ``blocks [P, n, 128]`` uint8 K panels,
    ``scales [k/32, n]`` uint8 E8M0, ``fmt`` ``"mxfp4"`` or ``"mxfp8"``."""

    blocks: torch.Tensor
    scales: torch.Tensor
    fmt: str

    def __post_init__(self) -> None:
        check_weights(self.blocks, self.scales, self.fmt)

    @property
    def n(self) -> int:
        return self.scales.shape[1]

    @property
    def k(self) -> int:
        return self.scales.shape[0] * 32

    @classmethod
    def fuse(cls, *weights: DenseMxWeights) -> DenseMxWeights:
        """One weight whose outputs are those of ``weights`` one after the other (q, k, v -> qkv):
        panels and scales concatenated along N.

        Raises:
            ValueError: no weights, or weights of different formats or K.
        """
        if not weights:
            raise ValueError("fuse() needs at least one weight")
        first = weights[0]
        for i, w in enumerate(weights[1:], 1):
            if w.fmt != first.fmt or w.k != first.k:
                raise ValueError(f"fuse: weight {i} is {w.fmt} with K {w.k}, weight 0 {first.fmt} with K {first.k}")
        blocks = torch.cat([w.blocks for w in weights], dim=1)
        scales = torch.cat([w.scales for w in weights], dim=1)
        return cls(blocks, scales, first.fmt)


def check_weights(blocks: torch.Tensor, scales: torch.Tensor, fmt: str, name: str = "weight") -> None:
    """Raises ``ValueError`` naming the tensor when ``blocks``/``scales`` are not one stored
    ``fmt`` weight on one device, contiguous."""
    if fmt not in MX_FORMATS:
        raise ValueError(f"{name}: dense format {fmt!r} is not one the kernel runs (one of {', '.join(MX_FORMATS)})")
    panel_k = mx_format(fmt).panel_k
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != PANEL_BYTES:
        raise ValueError(f"{name}_blocks: {list(blocks.shape)} {blocks.dtype}, expected [P, N, {PANEL_BYTES}] uint8")
    if scales.dtype != torch.uint8 or scales.dim() != 2:
        raise ValueError(f"{name}_scales: {list(scales.shape)} {scales.dtype}, expected [K/32, N] uint8")
    k, n = scales.shape[0] * 32, scales.shape[1]
    if blocks.shape[1] != n or blocks.shape[0] != -(-k // panel_k):
        raise ValueError(
            f"{name}_blocks: {list(blocks.shape)} do not hold the [{n}, {k}] weight its scales describe "
            f"(expected [{-(-k // panel_k)}, {n}, {PANEL_BYTES}] for {fmt})"
        )
    if blocks.device != scales.device:
        raise ValueError(f"{name}: blocks on {blocks.device}, scales on {scales.device}")
    # Rows of a wider weight (q of a fused qkv) are fine: whole 128-byte panel rows, unit inner strides.
    if blocks.stride(2) != 1 or blocks.stride(1) != PANEL_BYTES or blocks.stride(0) % PANEL_BYTES:
        raise ValueError(f"{name}_blocks: strides {blocks.stride()} are not those of whole panel rows")
    if scales.stride(1) != 1 and n > 1:
        raise ValueError(f"{name}_scales: strides {scales.stride()}, the N axis must be contiguous")


def reference_device(capability: tuple[int, int], sm_count: int | None = None) -> DeviceInfo:
    """The reference device of an architecture (an H100 for others), with ``sm_count`` if given."""
    device = next((d for d in ARCH_DEVICES.values() if d.capability == tuple(capability)), None)
    device = device or replace(H100, capability=tuple(capability))  # type: ignore[arg-type]
    return device if sm_count is None else replace(device, sm_count=sm_count)


def default_dense_tactic(
    tokens: int,
    n: int,
    k: int,
    fmt: str,
    capability: tuple[int, int],
    *,
    activations: ActivationPolicy = "bf16",
    sm_count: int | None = None,
) -> GemmTactic:
    """The built-in variant for ``tokens`` rows of an ``[n, k]`` ``fmt`` weight on a GPU of
    ``capability`` (:func:`prepkit.kernels.variants.dense_default`); valid, not tuned. Under the
    Triton interpreter the inline-PTX upcast becomes its integer-op twin."""
    t = dense_default(tokens, n, k, fmt, reference_device(capability, sm_count), check_policy(activations))
    return replace(t, upcast="bits") if t.upcast == "asm" and interpreting() else t


def check_tactic(t: GemmTactic, fmt: str, activations: ActivationPolicy) -> None:
    """Raises ``ValueError`` when ``t`` cannot run the dense kernel (any device's rules)."""
    reason = dense_invalid_reason(t, fmt, _ANY_DEVICE, activations)
    if reason is not None:
        raise ValueError(f"dense tactic {t.key()} cannot run {fmt} weights with activations {activations!r}: {reason}")
    if t.upcast == "asm" and interpreting():
        raise ValueError("dense tactic: upcast 'asm' is inline PTX and cannot run under TRITON_INTERPRET")


# Device-independent checks: any sm_90+ part with room for every tile.
_ANY_DEVICE = DeviceInfo("any", (9, 0), 1, 1 << 30)


def weight_descriptor(weights: DenseMxWeights, tactic: GemmTactic, activations: ActivationPolicy) -> object | None:
    """A TMA descriptor of the panels as ``[P*N, 128]`` with one K step's ``[block_n, bytes]``
    boxes when ``tactic`` asks for TMA loads and the device has the unit; else ``None``."""
    if tactic.weight_load != "tma" or (tactic.upcast == "dot_scaled" and activations == "bf16"):
        return None
    blocks = weights.blocks
    if blocks.data_ptr() % 16 or not blocks.is_contiguous():
        return None
    cap = launch_capability(blocks.device)
    if not interpreting() and not (cap is not None and cap >= (9, 0)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    box_k = tactic.block_k // mx_format(weights.fmt).elements_per_byte
    return TensorDescriptor.from_tensor(blocks.view(-1, PANEL_BYTES), [tactic.block_n, box_k])


def quantize_rows(
    x: torch.Tensor, activations: ActivationPolicy, *, natural: bool, out: MxRows | None = None
) -> MxRows:
    """bf16 rows ``x [T, K]`` -> :class:`MxRows` by the MoE layer's rule; ``natural``: codes in
    natural order inside each group (for mxfp8 weights) instead of the MoE weights' group order."""
    T, K = x.shape
    rows = out if out is not None else MxRows.empty(max(T, 1), K, activations, x.device)
    if T:
        launch(
            _quantize_rows_kernel,
            (triton.cdiv(T, _QUANT_ROWS), triton.cdiv(K, _QUANT_COLS)),
            x, rows.codes, rows.scales, T, K, x.stride(0),
            BLOCK_T=_QUANT_ROWS, BLOCK_K=_QUANT_COLS, ACT=ACT_IDS[activations], NATURAL=natural,
            **chain_launch(x.device),
        )  # fmt: skip
    return rows


def launch_dense(
    x: torch.Tensor,
    weights: DenseMxWeights,
    bias: torch.Tensor | None,
    tactic: GemmTactic,
    activations: ActivationPolicy,
    out: torch.Tensor,
) -> torch.Tensor:
    """The launches of one call on checked arguments: ``x [T, K]`` bf16 (last dim contiguous),
    ``out [T, N]`` (last dim contiguous). Returns ``out``."""
    T, K = x.shape
    N = weights.n
    if T == 0:
        return out
    act = ACT_IDS[activations]
    if act:
        xq = quantize_rows(x, activations, natural=weights.fmt == "mxfp8")
        x_in, xs_in, stride_x = xq.codes, xq.scales, xq.codes.stride(0)
    else:
        x_in, xs_in, stride_x = x, x, x.stride(0)
    split = tactic.split_k
    grid = (triton.cdiv(N, tactic.block_n), triton.cdiv(T, tactic.block_m), split)
    part = torch.empty((split, T, N), dtype=torch.float32, device=x.device) if split > 1 else out
    counts = split_counters(x.device, grid[0] * grid[1]) if split > 1 else out
    w_desc = weight_descriptor(weights, tactic, activations)
    launch(
        _dense_kernel,
        grid,
        x_in, xs_in, weights.blocks, weights.blocks if w_desc is None else w_desc, weights.scales,
        bias if bias is not None else out, out, part, counts, T, N, K, stride_x, out.stride(0),
        weights.blocks.stride(0) // PANEL_BYTES, weights.scales.stride(0),
        BLOCK_M=tactic.block_m, BLOCK_N=tactic.block_n, BLOCK_K=tactic.block_k, SPLIT_K=tactic.split_k,
        UPCAST=UPCAST_IDS[tactic.upcast], DOT_FP32=interpreting(), SWAP=swaps_operands(tactic, activations),
        JOIN=joins_halves(tactic), W_TMA=w_desc is not None, MASK_ALL=tactic.k_loop == "masked",
        PANEL_K=mx_format(weights.fmt).panel_k, ACT=act, WFMT=WFMT_IDS[weights.fmt], HAS_BIAS=bias is not None,
        **chain_launch(x.device), num_warps=tactic.num_warps, num_stages=tactic.num_stages,
    )  # fmt: skip
    return out


# Per device and stream, as the MoE layer's workspaces (plan.shared_workspace): arrival counters
# of the K splits' tiles, zero between calls (each call's last split resets its tile's). Calls on
# one stream run one after another (programmatic dependent launch waits for the kernel before), so
# they can share one buffer; calls on two streams may overlap, so they must not.
_SPLIT_COUNTERS: dict[tuple[str, int, int], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` zeroed int32 counters for launches on ``device``'s current stream (grown,
    zeroed, when short)."""
    key = stream_key(device)
    counts = _SPLIT_COUNTERS.get(key)
    if counts is None or counts.numel() < tiles:
        counts = _SPLIT_COUNTERS[key] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    return counts


def mx_linear(
    x: torch.Tensor,
    weights: DenseMxWeights,
    bias: torch.Tensor | None = None,
    *,
    activations: ActivationPolicy = "bf16",
    tactic: GemmTactic | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for bf16 ``x [..., K]``: ``[..., N]`` in ``x``'s dtype (``out`` if
    given: ``[T, N]`` of that dtype, T the rows of ``x``). ``tactic``: the variant, else
    :func:`default_dense_tactic` for the rows.

    Raises:
        ValueError: shapes, dtypes, devices or a tactic that do not fit (the message names the tensor).
    """
    activations = check_policy(activations)
    pairing = pairing_reason(activations, weights.fmt)
    if pairing is not None:
        raise ValueError(pairing)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: dtype {x.dtype}, the dense kernel reads bfloat16 activations")
    if x.dim() < 1 or x.shape[-1] != weights.k:
        raise ValueError(f"x: shape {list(x.shape)}, expected [..., {weights.k}] (the weight's K)")
    if x.device != weights.blocks.device:
        raise ValueError(f"x on {x.device}, weights on {weights.blocks.device}")
    n = weights.n
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != n:
            raise ValueError(f"bias: shape {list(bias.shape)}, expected [{n}]")
        if bias.device != x.device:
            raise ValueError(f"bias on {bias.device}, x on {x.device}")
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weights.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if out is None:
        out = torch.empty((T, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (T, n) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1:
        raise ValueError(
            f"out: {list(out.shape)} {out.dtype} on {out.device}, expected [{T}, {n}] {x.dtype} on {x.device} "
            "with a contiguous last dim"
        )
    if tactic is None:
        cap = launch_capability(x.device) or (9, 0)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else None
        tactic = default_dense_tactic(T, n, weights.k, weights.fmt, cap, activations=activations, sm_count=sms)
    check_tactic(tactic, weights.fmt, activations)
    launch_dense(x2, weights, bias, tactic, activations, out)
    return out.view(*lead, n)
