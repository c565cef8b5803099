"""The dense MX linear on tiny shapes (the Triton CPU interpreter without a GPU): every weight
format and activation policy against the weight dequantized from its stored form."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prepkit.kernels.activations import fake_quantize
from prepkit.kernels.device import H100
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import dense_default, dense_invalid_reason, dense_sweep_space, enumerate_dense_tactics
from prepkit.layouts import dense_mx

N, K = 80, 352  # K: one mxfp4 panel and a partial one; not a multiple of any block_k
TOL = 2e-2  # relative to the output's largest value: bf16 output and activations; errors sit near 5e-3

POLICIES = [("mxfp4", "bf16"), ("mxfp4", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "bf16"), ("mxfp8", "mxfp8")]


def stored(fmt: str, n: int = N, k: int = K, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=g) * 0.05
    st = dense_mx.to_kernel_layout(w, dense_mx.mx_format(fmt))
    return st, dense_mx.dequantize_kernel_layout(st["blocks"], st["scales"], dense_mx.mx_format(fmt))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, activations: str) -> torch.Tensor:
    xr = fake_quantize(x.float(), activations, torch.float32)
    y = xr @ w.T
    return y if bias is None else y + bias.float()


def check_close(y: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    assert torch.isfinite(y).all(), label
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err < TOL, f"{label}: relative error {err:.2e}"


@pytest.mark.parametrize(("fmt", "activations"), POLICIES)
@pytest.mark.parametrize("tokens", [1, 3, 33])
def test_dense_matches_the_dequantized_weight(device: str, fmt: str, activations: str, tokens: int) -> None:
    from prepkit.kernels.mx import DenseMxWeights, default_dense_tactic, mx_linear

    st, w = stored(fmt)
    weights = DenseMxWeights(st["blocks"].to(device), st["scales"].to(device), fmt)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn((tokens, K), generator=g).to(torch.bfloat16).to(device)
    bias = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(device)
    base = default_dense_tactic(tokens, N, K, fmt, (9, 0), activations=activations)  # type: ignore[arg-type]
    for split in (1, 2):
        t = replace(base, split_k=split)
        for b in (None, bias):
            y = mx_linear(x, weights, b, activations=activations, tactic=t)  # type: ignore[arg-type]
            assert y.shape == (tokens, N) and y.dtype == torch.bfloat16
            ref = reference(x.cpu(), w, None if b is None else b.cpu(), activations)
            check_close(y.cpu(), ref, f"{fmt} {activations} T={tokens} {t.key()} bias={b is not None}")


@pytest.mark.parametrize(("fmt", "activations"), [("mxfp4", "bf16"), ("mxfp8", "bf16"), ("mxfp8", "mxfp8")])
def test_dense_tiles_and_loads(device: str, fmt: str, activations: str) -> None:
    """Tiles that do not swap operands, TMA weight loads and the masked K loop give the same sums."""
    from prepkit.kernels.mx import DenseMxWeights, mx_linear

    st, w = stored(fmt)
    weights = DenseMxWeights(st["blocks"].to(device), st["scales"].to(device), fmt)
    x = torch.randn((5, K), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    ref = reference(x.cpu(), w, None, activations)
    upcast = "bits" if activations == "bf16" else "dot_scaled"
    for t in (
        GemmTactic(64, 32, 64, 4, 3, 1, upcast, "ptr"),
        GemmTactic(16, 64, 64, 4, 3, 4, upcast, "tma"),
        GemmTactic(16, 32, 128, 4, 3, 1, upcast, "ptr", "masked"),
    ):
        assert dense_invalid_reason(t, fmt, H100, activations) is None, t.key()  # type: ignore[arg-type]
        y = mx_linear(x, weights, activations=activations, tactic=t)  # type: ignore[arg-type]
        check_close(y.cpu(), ref, f"{fmt} {activations} {t.key()}")


def test_dense_bf16_dot_scaled_and_joined_halves(device: str) -> None:
    from prepkit.kernels.mx import DenseMxWeights, mx_linear

    for fmt, t in (
        ("mxfp4", GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr", "tail", "joined")),
        ("mxfp4", GemmTactic(16, 32, 64, 4, 3, 1, "dot_scaled", "ptr")),
        ("mxfp8", GemmTactic(16, 32, 64, 4, 3, 1, "dot_scaled", "ptr")),
    ):
        st, w = stored(fmt)
        weights = DenseMxWeights(st["blocks"].to(device), st["scales"].to(device), fmt)
        x = torch.randn((2, K), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
        y = mx_linear(x, weights, tactic=t)
        check_close(y.cpu(), reference(x.cpu(), w, None, "bf16"), f"{fmt} {t.key()}")


def test_fused_qkv_equals_the_three_parts(device: str) -> None:
    from prepkit.kernels.mx import DenseMxWeights, mx_linear

    parts = []
    for i, n in enumerate((64, 32, 32)):
        st, _ = stored("mxfp4", n=n, seed=10 + i)
        parts.append(DenseMxWeights(st["blocks"].to(device), st["scales"].to(device), "mxfp4"))
    fused = DenseMxWeights.fuse(*parts)
    assert (fused.n, fused.k) == (128, K)
    x = torch.randn((3, K), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    t = GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr")
    whole = mx_linear(x, fused, tactic=t)
    split = torch.cat([mx_linear(x, p, tactic=t) for p in parts], dim=1)
    assert torch.equal(whole, split)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_rows_of_a_fused_weight_run_in_place(device: str, fmt: str) -> None:
    """q, k and v as views of the fused qkv (no second copy) give the parts' own outputs."""
    from prepkit.kernels.mx import DenseMxWeights, mx_linear

    parts = [stored(fmt, n=n, seed=20 + i)[0] for i, n in enumerate((64, 32, 48))]
    fused = DenseMxWeights.fuse(*(DenseMxWeights(p["blocks"], p["scales"], fmt) for p in parts))
    blocks, scales = fused.blocks.to(device), fused.scales.to(device)
    x = torch.randn((3, K), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    lo = 0
    for p in parts:
        n = p["scales"].shape[1]
        view = DenseMxWeights(blocks[:, lo : lo + n], scales[:, lo : lo + n], fmt)
        own = DenseMxWeights(p["blocks"].to(device), p["scales"].to(device), fmt)
        for t in (GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr"), GemmTactic(16, 32, 64, 4, 3, 2, "bits", "tma")):
            assert torch.equal(mx_linear(x, view, tactic=t), mx_linear(x, own, tactic=t)), (lo, t.key())
        lo += n


def test_leading_dims_and_out(device: str) -> None:
    from prepkit.kernels.mx import DenseMxWeights, mx_linear

    st, w = stored("mxfp8")
    weights = DenseMxWeights(st["blocks"].to(device), st["scales"].to(device), "mxfp8")
    x = torch.randn((2, 3, K), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(device)
    out = torch.empty((6, N), dtype=torch.bfloat16, device=device)
    y = mx_linear(x, weights, out=out, tactic=GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr"))
    assert y.shape == (2, 3, N) and y.data_ptr() == out.data_ptr()
    check_close(y.reshape(6, N).cpu(), reference(x.reshape(6, K).cpu(), w, None, "bf16"), "leading dims")


def test_bad_inputs_name_the_tensor(device: str) -> None:
    from prepkit.kernels.mx import DenseMxWeights, mx_linear

    st, _ = stored("mxfp4")
    blocks, scales = st["blocks"].to(device), st["scales"].to(device)
    with pytest.raises(ValueError, match="weight_blocks"):
        DenseMxWeights(blocks[:1], scales, "mxfp4")
    with pytest.raises(ValueError, match="weight_scales"):
        DenseMxWeights(blocks, scales.to(torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="weight_blocks"):
        DenseMxWeights(blocks, scales, "mxfp8")  # mxfp8 panels hold half the K: the count is wrong
    with pytest.raises(ValueError, match="not one the kernel runs"):
        DenseMxWeights(blocks, scales, "bf16")
    weights = DenseMxWeights(blocks, scales, "mxfp4")
    x = torch.zeros((2, K), dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="x: dtype"):
        mx_linear(x.float(), weights)
    with pytest.raises(ValueError, match=r"x: shape \[2, 320\]"):
        mx_linear(x[:, :320], weights)
    with pytest.raises(ValueError, match="bias: shape"):
        mx_linear(x, weights, torch.zeros(N + 1, device=device))
    with pytest.raises(ValueError, match="out:"):
        mx_linear(x, weights, out=torch.empty((2, N), device=device))
    st8, _ = stored("mxfp8")
    w8 = DenseMxWeights(st8["blocks"].to(device), st8["scales"].to(device), "mxfp8")
    with pytest.raises(ValueError, match="need mxfp4 weights"):
        mx_linear(x, w8, activations="mxfp4")
    with pytest.raises(ValueError, match="does not divide"):
        mx_linear(x, w8, tactic=GemmTactic(16, 32, 256, 4, 3, 1, "bits", "ptr"))
    with pytest.raises(ValueError, match="fuse"):
        DenseMxWeights.fuse(weights, w8)


def test_dense_variants_follow_the_format() -> None:
    for fmt, panel in (("mxfp4", 256), ("mxfp8", 128)):
        space = enumerate_dense_tactics(fmt, H100, tokens=1)
        assert space and all(panel % t.block_k == 0 and t.block_m == 16 for t in space)
        assert any(t.split_k > 1 for t in space)
        if fmt == "mxfp8":
            assert all(t.upcast != "asm" and t.swapped_dot == "split" for t in space)
    assert not enumerate_dense_tactics("mxfp8", H100, tokens=1, activations="mxfp4")
    assert all(t.upcast == "dot_scaled" for t in enumerate_dense_tactics("mxfp4", H100, tokens=1, activations="mxfp8"))


@pytest.mark.parametrize(
    ("n", "k", "splits"), [(2880, 4096, {"mxfp4": 8, "mxfp8": 8}), (5120, 2880, {"mxfp4": 4, "mxfp8": 8}),
                           (201088, 2880, {"mxfp4": 1, "mxfp8": 1})]
)  # fmt: skip
def test_dense_default_splits_k_for_narrow_outputs(n: int, k: int, splits: dict[str, int]) -> None:
    """gpt-oss's o_proj, fused qkv and lm_head at one token on an H100 (132 SMs): mxfp8 tiles
    are twice as wide (128 columns), so qkv splits further."""
    for fmt, split in splits.items():
        t = dense_default(1, n, k, fmt, H100)
        assert t.split_k == split and t.block_m == 16, (fmt, t.key())
        assert dense_invalid_reason(t, fmt, H100) is None
        space = dense_sweep_space(fmt, H100, 1, n, k)
        assert space and all(t.block_m == 16 for t in space)
        assert (split == 1) == all(s.split_k == 1 for s in space)


def test_k_splits_reduce_in_one_launch_and_reset_their_counters(device: str) -> None:
    """The last split of a tile sums the partials and resets its counter: repeated calls agree
    with the unsplit kernel (up to fp32 summation order) and leave every counter at zero."""
    from prepkit.kernels.mx import DenseMxWeights, mx_linear
    from prepkit.kernels.mx.dense import split_counters

    st, w = stored("mxfp4")
    weights = DenseMxWeights(st["blocks"].to(device), st["scales"].to(device), "mxfp4")
    g = torch.Generator().manual_seed(6)
    x = torch.randn((17, K), generator=g).to(torch.bfloat16).to(device)
    bias = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(device)
    whole = mx_linear(x, weights, bias, tactic=GemmTactic(16, 32, 64, 4, 3, 1, "bits", "ptr"))
    for split in (2, 4):
        t = GemmTactic(16, 32, 64, 4, 3, split, "bits", "ptr")
        first = mx_linear(x, weights, bias, tactic=t)
        assert torch.equal(mx_linear(x, weights, bias, tactic=t), first)
        assert float((first.float() - whole.float()).abs().max()) <= 2e-2 * float(whole.float().abs().max())
        assert not bool(split_counters(x.device, 1).any())
