"""A one-tile kernel around the bundled kernel's upcast, for the byte-by-byte GPU check.

Imported only by GPU tests: importing the kernel module decides between compiler and interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from prepkit.kernels.mx._upcast import _upcast_pair


@triton.jit
def upcast_tile(w_ptr, s_ptr, lo_ptr, hi_ptr, UPCAST: tl.constexpr, N: tl.constexpr, C: tl.constexpr):
    """``[N, C]`` bytes and E8M0 scales -> the bf16 values of their low and high nibbles."""
    offs = tl.arange(0, N)[:, None] * C + tl.arange(0, C)[None, :]
    lo, hi = _upcast_pair(tl.load(w_ptr + offs), tl.load(s_ptr + offs), UPCAST)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)
