"""The fixed choices of ``prepare``'s options, spelled here so that ``--help`` and shell completion
answer without importing torch (the layout registry imports it). A test keeps each list equal to
the registry it mirrors."""

from __future__ import annotations

# prepkit.layouts.LAYOUTS, by CLI name
LAYOUT_NAMES = ("cutlass-sm12x", "cutlass-sm90", "triton-moe", "trtllm-gen")
# prepkit.layouts.dense_mx.DENSE_FORMATS
DENSE_FORMATS = ("bf16", "mxfp4", "mxfp8")
# prepkit.layouts.trtllm_gen.TRTLLM_VERSIONS
TRTLLM_VERSIONS = ("main", "1.2")
