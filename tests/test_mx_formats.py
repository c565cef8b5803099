"""The MX format record: every list of formats derives from it, and one rule pairs policies with
weight formats."""

from __future__ import annotations

import pytest

from prepkit.mx_formats import ACTIVATION_POLICIES, MX_FORMATS, PANEL_BYTES, pairing_reason


@pytest.mark.parametrize(
    ("activations", "weights", "ok"),
    [("bf16", "mxfp4", True), ("bf16", "mxfp8", True), ("mxfp8", "mxfp4", True), ("mxfp8", "mxfp8", True),
     ("mxfp4", "mxfp4", True), ("mxfp4", "mxfp8", False)],
)  # fmt: skip
def test_one_rule_pairs_policies_and_weights(activations: str, weights: str, ok: bool) -> None:
    reason = pairing_reason(activations, weights)
    assert (reason is None) == ok
    if not ok:
        assert reason == "activations 'mxfp4' multiply e2m1 x e2m1: they need mxfp4 weights, not mxfp8"


def test_every_consumer_reads_the_record() -> None:
    from prepkit.kernels.variants import dense_invalid_reason
    from prepkit.layouts import dense_mx, triton_moe
    from prepkit.tune.dense import DENSE_CHOICES, MX_DENSE_FORMATS

    assert PANEL_BYTES == triton_moe.PANEL_BYTES
    assert ("bf16", *MX_FORMATS) == dense_mx.DENSE_FORMATS
    assert tuple(MX_FORMATS) == MX_DENSE_FORMATS and set(DENSE_CHOICES) == {"none", "all", *MX_FORMATS}
    assert {f.panel_k for f in MX_FORMATS.values()} == {256, 128}
    assert set(MX_FORMATS) < set(ACTIVATION_POLICIES)
    from prepkit.kernels.device import H100
    from prepkit.kernels.tactic import GemmTactic

    t = GemmTactic(16, 64, 128, 4, 3, 1, "dot_scaled")
    assert dense_invalid_reason(t, "mxfp8", H100, "mxfp4") == pairing_reason("mxfp4", "mxfp8")
