"""The bundled MX kernels in Triton: the MXFP4 MoE layer (routing, grouping, GEMM1 + SwiGLU, GEMM2 +
combine) and the dense MX linear, which share one K loop.

Four launches per layer (three when one routing program covers every token, two at one token:
see below), all with static grids so a CUDA graph can capture them:

1. ``_route_kernel`` (token blocks x column chunks): top-k of the router logits, softmax over the
   k picks in fp32, an atomic per-expert counter whose old value is the pick's rank inside its
   expert (chunk 0 only), and zeroing of the fp32 output rows that step 4 accumulates into (each
   program one chunk of its block's rows).
2. ``_scatter_kernel`` (picks): exclusive prefix sum of the counters, then each pick writes its
   index to ``sorted[start(expert) + rank]``; the rows of one expert become contiguous. When step
   1 runs as a single program (up to 32 tokens) it groups the picks in registers instead: no
   atomics, no second launch.
3. ``_gemm1_swiglu_kernel`` (row blocks x N tiles): gathers token rows, multiplies by the MXFP4
   gate/up rows of the expert, adds the bias and applies the gpt-oss SwiGLU in the epilogue;
   writes bf16 activations in sorted order.
4. ``_gemm2_combine_kernel`` (row blocks x N tiles x K splits): multiplies by the MXFP4 down rows,
   adds the bias (K split 0 only), scales by the routing weight and atomically adds into the
   token's fp32 output row, so the sum over a token's k experts needs no extra pass.

Every GEMM program finds its (expert, row block) from the per-expert counters alone, so grids are
sized by an upper bound and surplus programs return at once.

One token with bf16 activations (a decode step at batch 1) launches only steps 3 and 4: there is
nothing to group, so each GEMM1 program takes one of the token's picks from the router logits
itself (the same picks and weights as step 1, bit for bit), the programs of the first pick write
the picks and zero the output row between them, and GEMM2 reads the picks GEMM1 wrote
(:func:`~prepkit.kernels.mx.launch.routes_in_gemms`).

Weights are in the ``triton_moe_v3`` layout, whose shapes and byte order (K panels, nibble pairs,
MMA fragment order) :mod:`prepkit.layouts.triton_moe` describes: per expert,
``w13_blocks [ceil(H/256), 2*Ip, 128]``, ``w13_scales [H/32, 2*Ip]``, ``w13_bias [2*Ip]`` fp32,
``w2_blocks [ceil(Ip/256), H, 128]``, ``w2_scales [Ip/32, H]``, ``w2_bias [H]`` fp32.

Variant knobs (``GemmTactic``): tile sizes, warps, stages, split-K (GEMM2; GEMM1 too with bf16
activations and tiles of at most 32 rows: a tile's last split sums the partials and applies SwiGLU), the upcast
(``asm``: inline PTX, CUDA only, the default; ``bits``: Triton integer ops, runs in the CPU
interpreter; ``dot_scaled``: ``tl.dot_scaled``) and how weight tiles are loaded (``ptr``: pointer
loads the compiler pipelines; ``tma``: the Hopper/Blackwell tensor memory accelerator, one copy per
tile through a host-built descriptor) and how the K loop ends (``tail``: unmasked steps, then one
masked step after the loop; ``masked``: every step masked, one pipelined loop). Tiles of at most
32 rows swap operands; they run each K step as two dots, one per half of the scale groups
(``swapped_dot="split"``), or as one dot on the halves joined in registers (``"joined"``, what
tiles of more rows always do).
Results are not bitwise deterministic: the combine adds in fp32 atomics in arrival order.

Activation precision (``activations``, the user's policy, never a tactic): ``bf16`` as above;
``mxfp8``/``mxfp4`` quantize each token row once in step 1 (its column-chunk programs already
visit every row) and the SwiGLU output in step 3's epilogue to e4m3/e2m1 with one E8M0 scale per
32 values (:mod:`prepkit.kernels.activations`), and both GEMMs run ``tl.dot_scaled`` with
same-format operands: e4m3 x e4m3 (the weights widened from e2m1 in registers, exact) or
e2m1 x e2m1 (the stored weight bytes as they are). SM12x lowers both to block-scaled MMA; other
GPUs run Triton's decomposition of the same dot.

Modules: :mod:`~prepkit.kernels.mx.launch` (the host API, re-exported here), ``_routing``
(steps 1-2), ``_gemm`` (steps 3-4) over ``_mainloop`` (the K loops and their one dispatcher; their steps in
``_steps``), ``_buffers`` (the routing and the workspace), ``_ids`` (the
host names of the kernels' constexpr ids), ``_upcast`` (fp4 -> bf16,
with its inline PTX), ``_mx`` (MX quantizing and widening), ``_mx_rows`` (the MX row format),
``_chain`` (programmatic dependent launch), ``_target`` (the one place launches read the
device and the interpreter), and the dense MX linear that shares the K loops: ``_dense``
(its kernels) and :mod:`~prepkit.kernels.mx.dense` (``mx_linear``, re-exported here).
"""

from prepkit.constants import TRITON_MOE_LAYOUT_ID
from prepkit.kernels.mx._mx_rows import MxRows, from_mx_rows, group_order, to_mx_rows
from prepkit.kernels.mx.dense import DenseMxWeights, default_dense_tactic, mx_linear
from prepkit.kernels.mx.launch import (
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    Routing,
    Workspace,
    fused_moe,
    gemm1_swiglu,
    gemm2_combine,
    joins_halves,
    max_row_blocks,
    route,
    routes_in_gemms,
    swaps_operands,
    upcast_id,
    weight_descriptor,
)
from prepkit.kernels.mx.plan import MAX_PLANNED_TOKENS, LaunchPlan, plan_fused_moe

WEIGHT_LAYOUT = TRITON_MOE_LAYOUT_ID
# The kernel's version in tactic DB keys: bump it when a change alters what a tactic measures
# (the compiled code of some variant), so tuned rows of the old kernel stop matching.
KERNEL_VERSION = 7

__all__ = [
    "KERNEL_VERSION",
    "DenseMxWeights",
    "MAX_PLANNED_TOKENS",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "WEIGHT_LAYOUT",
    "LaunchPlan",
    "MxRows",
    "Routing",
    "default_dense_tactic",
    "from_mx_rows",
    "fused_moe",
    "gemm1_swiglu",
    "gemm2_combine",
    "group_order",
    "joins_halves",
    "max_row_blocks",
    "mx_linear",
    "plan_fused_moe",
    "route",
    "routes_in_gemms",
    "swaps_operands",
    "to_mx_rows",
    "upcast_id",
    "weight_descriptor",
    "Workspace",
]
