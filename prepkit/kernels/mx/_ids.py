"""The host names of the kernels' constexpr ids: one map per constant, next to nothing else, so
the MoE and dense launchers pass the same numbers the kernel code compares against."""

from __future__ import annotations

import triton.language as tl

from prepkit.kernels.mx._mx import ACT_BF16, ACT_MXFP4, ACT_MXFP8
from prepkit.kernels.mx._upcast import UPCAST_ASM, UPCAST_BITS, UPCAST_DOT_SCALED

# The kernels' WFMT constant: the weights' element format (the MoE layer's weights are always mxfp4).
W_MXFP4: tl.constexpr = tl.constexpr(0)
W_MXFP8: tl.constexpr = tl.constexpr(1)

# ``GemmTactic.upcast`` -> UPCAST (``launch.upcast_id`` adds the folded-scale variant of asm).
UPCAST_IDS: dict[str, int] = {"bits": UPCAST_BITS.value, "dot_scaled": UPCAST_DOT_SCALED.value, "asm": UPCAST_ASM.value}
# The activation policy -> ACT.
ACT_IDS: dict[str, int] = {"bf16": ACT_BF16.value, "mxfp8": ACT_MXFP8.value, "mxfp4": ACT_MXFP4.value}
# The dense weight format -> WFMT.
WFMT_IDS: dict[str, int] = {"mxfp4": W_MXFP4.value, "mxfp8": W_MXFP8.value}
