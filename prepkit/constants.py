"""Names spelled in more than one module: layout ids and file names. Standard library only."""

from __future__ import annotations

# The bundled Triton kernel's weight layout (prepkit.layouts.triton_moe); manifests and tactics.db
# store it, the kernel and the runtime check it.
TRITON_MOE_LAYOUT_ID = "triton_moe_v3"
