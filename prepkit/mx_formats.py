"""The MX formats: the one record of each weight format the dense kernel reads and each activation
policy quantizes to, and the one rule pairing a policy with a weight format.

Every list of formats (``prepare --dense``'s choices, ``tune --dense-formats``, the tactics DB's
``w_dtype`` names, the kernel's panel sizes, the compile check's choices) derives from
:data:`MX_FORMATS`, so a new format is one :class:`MxFormat` here, its codec in
:mod:`prepkit.mx_codec` and its kernel path. Standard library only: the tactics keys and the
tuner's planning import this without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The activation precision a layer runs with (a policy, never a tactic): bf16, or an MX format's name.
ActivationPolicy = Literal["bf16", "mxfp8", "mxfp4"]
ACTIVATION_POLICIES: tuple[ActivationPolicy, ...] = get_args(ActivationPolicy)
# Bytes of one stored K panel row (prepkit.layouts.triton_moe.PANEL_BYTES: the dense weights
# share the MoE weights' panels; tests/layouts/test_dense_mx.py holds the two equal).
PANEL_BYTES = 128
BLOCK_ELEMS = 32  # elements that share one E8M0 scale

MxElement = Literal["e2m1", "e4m3"]


@dataclass(frozen=True)
class MxFormat:
    """One MX format: OCP MX elements with one E8M0 scale per 32, as weights and as activations."""

    name: str  # "mxfp4": the weight format and the activation policy of these elements
    element: MxElement  # the element type as tl.dot_scaled spells it
    max_value: float  # the largest element magnitude
    emax: int  # the exponent of the largest normal element (OCP's scale rule subtracts it)
    mantissa_bits: int
    min_normal_exponent: int  # below 2 ** this, the grid step stops shrinking (subnormals)
    elements_per_byte: int
    w_dtype: str  # the weights' name in a tactics problem key

    @property
    def panel_k(self) -> int:
        """K elements per stored panel."""
        return PANEL_BYTES * self.elements_per_byte

    def stored_bytes(self, n: int, k: int) -> int:
        """Bytes of the blocks and scales of an ``[n, k]`` weight, panel padding included."""
        panels = -(-k // self.panel_k)
        return panels * n * PANEL_BYTES + (k // BLOCK_ELEMS) * n


MXFP4 = MxFormat("mxfp4", "e2m1", 6.0, 2, 1, 0, 2, "mxfp4_e2m1")
MXFP8 = MxFormat("mxfp8", "e4m3", 448.0, 8, 3, -6, 1, "mxfp8_e4m3")
MX_FORMATS: dict[str, MxFormat] = {f.name: f for f in (MXFP4, MXFP8)}
# The formats by element type (the activation quantizer's spelling).
BY_ELEMENT: dict[str, MxFormat] = {f.element: f for f in MX_FORMATS.values()}


def pairing_reason(activations: str, weights: str) -> str | None:
    """Why activations quantized by the ``activations`` policy cannot multiply ``weights``, or
    ``None`` when they can. MX activations of an element narrower than the weights' would need
    the weights narrowed (lossy): the matrix unit multiplies equal element types, and weights are
    only ever widened to the activations' (e2m1 -> e4m3 is exact)."""
    act = MX_FORMATS.get(activations)
    fmt = MX_FORMATS.get(weights)
    if act is None or fmt is None or act.elements_per_byte <= fmt.elements_per_byte:
        return None
    return (
        f"activations {activations!r} multiply {act.element} x {act.element}: they need {act.name} weights, "
        f"not {weights}"
    )
