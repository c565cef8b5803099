"""Programmatic dependent launch: the device-side wait of every kernel of the layer, and the launch
arguments that turn it on."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prepkit.kernels.mx._target import interpreting, launch_capability


@triton.jit
def _chain_enter(PDL: tl.constexpr):
    """With programmatic dependent launch (sm_90+), a kernel's programs may start while the kernel
    before it still runs: wait here until that kernel has finished and its writes are visible, then
    let the next kernel of the layer start its programs (they wait in turn). This hides the launch
    gap between the layer's kernels; every kernel waits before it reads anything."""
    if PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


def chain_launch(device: torch.device) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (``_chain_enter``): on CUDA devices of
    sm_90 and newer, off in the interpreter and elsewhere."""
    cap = launch_capability(device)
    on = not interpreting() and cap is not None and cap >= (9, 0)
    return {"PDL": on, "launch_pdl": on}
