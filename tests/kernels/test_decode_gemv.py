"""The decode projections (prepkit.kernels.decode.gemv) against their torch references on small
random problems: every weight format, one and three rows, with and without the optional operands,
K and N tails, and every candidate variant of a small problem."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from prepkit.kernels.decode import gemv
from prepkit.kernels.decode.gemv_registry import (
    LINEAR_RESIDUAL,
    NORM_LINEAR,
    TOLERANCE,
    dequantized,
    linear_residual_reference,
    norm_linear_reference,
    problem_of,
    project_reference,
    random_weight,
    relative_error,
)
from prepkit.kernels.decode.problems import STREAMING_BLOCKS, on_tensor_cores, row_count
from prepkit.kernels.decode.variants import KERNELS, DecodeProblem, DecodeVariant

FORMATS = ("bf16", "mxfp8", "mxfp4")


def _inputs(kernel: str, fmt: str, batch: int, n: int, k: int, device: str, seed: int, **flags: int) -> dict:
    problem = DecodeProblem(kernel, n, k, batch, fmt, tuple(sorted(flags.items())))
    return KERNELS[kernel].inputs(problem, device, seed)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("add", "bias", "normed"), [(1, 1, 1), (0, 0, 0), (1, 0, 1)])
def test_norm_linear_matches_the_reference(device: str, fmt: str, batch: int, add: int, bias: int, normed: int) -> None:
    # N = 40 and K = 96 are tails of every row block and K step the default takes.
    inputs = _inputs("norm_linear", fmt, batch, 40, 96, device, seed=batch, add=add, bias=bias, normed=normed)
    summed, out, got_normed = gemv.norm_linear(**inputs)
    want = norm_linear_reference(**inputs)
    assert (inputs["add"] is None) == (not add) and (inputs["bias"] is None) == (not bias)
    assert out.shape == (batch, 40) and out.dtype == torch.bfloat16
    # The residual add is exact bf16 arithmetic: same bits.
    assert torch.equal(summed, want[0])
    assert relative_error(out, want[1]) <= TOLERANCE
    if normed:
        assert got_normed is not None and relative_error(got_normed, want[2]) <= TOLERANCE
    else:
        assert got_normed is None


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("add", [1, 0])
def test_add_norm_writes_the_norm_linear_rows_bit_for_bit(device: str, batch: int, add: int) -> None:
    # The norm alone (before a weight the tensor cores run) against the fused prologue's rows; K 96
    # is one norm block, and 40 x 96 random values make a mismatch anywhere visible.
    inputs = _inputs("norm_linear", "bf16", batch, 40, 96, device, seed=20 + batch, add=add, normed=1)
    summed, _, normed = gemv.norm_linear(**inputs)
    got = gemv.add_norm(inputs["hidden"], inputs["add"], inputs["norm_weight"], inputs["eps"])
    assert normed is not None and torch.equal(got[0], summed) and torch.equal(got[1], normed)
    want = norm_linear_reference(**inputs)
    assert torch.equal(got[0], want[0]) and relative_error(got[1], want[2]) <= TOLERANCE
    with pytest.raises(ValueError, match="norm_weight: shape"):
        gemv.add_norm(inputs["hidden"], inputs["add"], inputs["norm_weight"][:5], inputs["eps"])


def test_only_an_mxfp4_stream_runs_on_tensor_cores() -> None:
    # The lm_head (201,088 rows, and its halves under TP 2) in mxfp4; not mxfp8, whose GEMV streams
    # at the copy bandwidth, nor q/k/v, o or the router.
    assert on_tensor_cores(201088, "mxfp4") and on_tensor_cores(100544, "mxfp4")
    assert not on_tensor_cores(201088, "mxfp8") and not on_tensor_cores(201088, "bf16")
    for n in (5120, 2880, 128):
        assert not on_tensor_cores(n, "mxfp4")
    assert row_count(8 * STREAMING_BLOCKS) == "many" and row_count(8 * STREAMING_BLOCKS + 1) == "stream"


ONE_ROW_VARIANTS = [
    DecodeVariant(8, 16, 4),
    DecodeVariant(2, 64, 4),
    DecodeVariant(8, 32, 4, 2),
    DecodeVariant(4, 16, 4, 3),
]


@pytest.mark.parametrize("variant", ONE_ROW_VARIANTS)
@pytest.mark.parametrize("add", [1, 0])
def test_one_normed_bf16_row_over_many_k_steps_matches(
    device: str, variant: DecodeVariant, add: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One bf16 row's own K loop loads each step's inputs a step ahead: many steps, a masked last
    # step (96 = 64 + 32) and K splits, including a split whose steps end early. The default rule
    # gives it normed rows only in one step, so the test asks for it.
    chosen: list[bool] = []
    rule = gemv.own_row_loop
    monkeypatch.setattr(gemv, "own_row_loop", lambda *a: chosen.append(rule(*a)) or True)
    inputs = _inputs("norm_linear", "bf16", 1, 40, 96, device, seed=9, add=add, bias=1, normed=1)
    summed, out, normed = gemv.norm_linear(**inputs, variant=variant)
    want = norm_linear_reference(**inputs)
    assert torch.equal(summed, want[0])
    assert relative_error(out, want[1]) <= TOLERANCE
    assert normed is not None and relative_error(normed, want[2]) <= TOLERANCE
    assert chosen == [False]  # the rule alone would not have taken it


def test_the_own_row_loop_serves_o_and_the_router_not_q_k_v() -> None:
    one_step, steps = DecodeVariant(2, 4096, 8), DecodeVariant(8, 256, 8)
    assert gemv.own_row_loop(one_step, 1, "bf16", True, 2880)  # the router: the whole row in one step
    assert not gemv.own_row_loop(steps, 1, "bf16", True, 2880)  # q/k/v: normed over 12 steps
    assert gemv.own_row_loop(DecodeVariant(4, 512, 8), 1, "bf16", False, 4096)  # o: no norm
    assert not gemv.own_row_loop(steps, 2, "bf16", False, 2880)  # two rows
    assert not gemv.own_row_loop(steps, 1, "mxfp8", False, 2880)  # MX weights
    assert not gemv.own_row_loop(DecodeVariant(64, 256, 1), 1, "bf16", False, 2880)  # too wide to defer


def test_one_normed_bf16_row_in_one_k_step_takes_the_own_loop_and_matches(device: str) -> None:
    variant = DecodeVariant(2, 128, 4)  # K = 96: the norm's whole row in one step
    assert gemv.own_row_loop(variant, 1, "bf16", True, 96)
    inputs = _inputs("norm_linear", "bf16", 1, 40, 96, device, seed=12, add=1, bias=1, normed=1)
    summed, out, normed = gemv.norm_linear(**inputs, variant=variant)
    want = norm_linear_reference(**inputs)
    assert torch.equal(summed, want[0]) and relative_error(out, want[1]) <= TOLERANCE
    assert normed is not None and relative_error(normed, want[2]) <= TOLERANCE


@pytest.mark.parametrize("variant", ONE_ROW_VARIANTS)
def test_one_bf16_row_with_the_residual_over_many_k_steps_matches(device: str, variant: DecodeVariant) -> None:
    # The same loop without the norm: its activations a step ahead in the weight tile's layout.
    inputs = _inputs("linear_residual", "bf16", 1, 40, 96, device, seed=10, bias=1)
    assert relative_error(gemv.linear_residual(**inputs, variant=variant), linear_residual_reference(**inputs)) <= (
        TOLERANCE
    )


@pytest.mark.parametrize("row_block", [32, 64])
def test_rows_longer_than_one_norm_block_match_the_reference(
    device: str, row_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The norm's prologue and its row writes take a whole row at once up to MAX_ROW_BLOCK and loop
    # beyond it: 96 values are three blocks of 32, or one full and one masked block of 64.
    monkeypatch.setattr(gemv, "MAX_ROW_BLOCK", row_block)
    inputs = _inputs("norm_linear", "bf16", 3, 40, 96, device, seed=5, add=1, bias=1, normed=1)
    summed, out, normed = gemv.norm_linear(**inputs)
    want = norm_linear_reference(**inputs)
    assert torch.equal(summed, want[0])
    assert relative_error(out, want[1]) <= TOLERANCE
    assert normed is not None and relative_error(normed, want[2]) <= TOLERANCE


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("bias", [0, 1])
def test_linear_residual_matches_the_reference(device: str, fmt: str, batch: int, bias: int) -> None:
    inputs = _inputs("linear_residual", fmt, batch, 40, 160, device, seed=10 + batch, bias=bias)
    got = gemv.linear_residual(**inputs)
    assert relative_error(got, linear_residual_reference(**inputs)) <= TOLERANCE
    # The projection rounds to bf16 before the add (in bf16): the same bits as the plain
    # projection of the same variant plus the residual.
    proj = gemv.linear(inputs["x"], inputs["weight"], inputs["bias"])
    assert torch.equal(got, inputs["residual"] + proj)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_the_reference_and_the_weight_is_read(device: str, fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    weight = random_weight(24, 64, fmt, g, device)
    x = torch.randn((2, 64), generator=g).to(torch.bfloat16).to(device)
    got = gemv.linear(x, weight, None)
    assert relative_error(got, project_reference(x, weight, None)) <= TOLERANCE
    # Another weight gives another result (the kernel does not ignore what it reads).
    other = random_weight(24, 64, fmt, g, device)
    assert relative_error(gemv.linear(x, other, None), project_reference(x, weight, None)) > 0.1


@pytest.mark.parametrize("kernel", ["norm_linear", "linear_residual"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_candidate_of_a_small_problem_matches(device: str, kernel: str, fmt: str) -> None:
    k = {"bf16": 256, "mxfp8": 512, "mxfp4": 1024}[fmt]  # room for K splits of every K step
    problem = DecodeProblem(kernel, 24, k, 2, fmt, (("normed", 1),) if kernel == "norm_linear" else ())
    impl = KERNELS[kernel]
    inputs = impl.inputs(problem, device, seed=5)
    want = impl.reference(inputs)
    cands = impl.candidates(problem)
    assert impl.default(problem) in cands
    assert any(v.split_k > 1 for v in cands)
    for v in cands:
        assert gemv.variant_reason(v, fmt) is None
        err = relative_error(impl.launch(inputs, v), want)
        assert err <= impl.tolerance(problem), (v.name(), err)


def test_split_k_counters_are_reset_for_the_next_call(device: str) -> None:
    inputs = _inputs("linear_residual", "bf16", 2, 16, 256, device, seed=7)
    v = DecodeVariant(8, 32, 4, 4)
    first = gemv.linear_residual(**inputs, variant=v)
    second = gemv.linear_residual(**inputs, variant=v)
    # A fixed reduction order: the same bits call after call.
    assert torch.equal(first, second)
    assert relative_error(first, linear_residual_reference(**inputs)) <= TOLERANCE


def test_registered_under_their_names() -> None:
    assert KERNELS["norm_linear"] is NORM_LINEAR and KERNELS["linear_residual"] is LINEAR_RESIDUAL
    w = torch.zeros((40, 96), dtype=torch.bfloat16)
    problem = problem_of("norm_linear", w, 3, normed=1, add=0)
    assert (problem.rows, problem.cols, problem.batch, problem.fmt) == (40, 96, 3, "bf16")
    assert problem.key() == "norm_linear-r40-c96-b3-bf16-add0-normed1"


def test_defaults_spread_the_real_shapes_over_the_gpu() -> None:
    # qkv, o, router and lm_head of gpt-oss at one row, MX weights: enough programs for two per
    # H100 SM, or the K splits that come closest (at most 8, each of two K steps or more).
    for n, k in ((5120, 2880), (2880, 4096), (128, 2880), (201088, 2880)):
        for fmt in ("mxfp8", "mxfp4"):
            v = gemv.default_variant(n, k, 1, fmt)
            assert gemv.variant_reason(v, fmt) is None
            wide = n in (5120, 2880)  # q/k/v and o: wider steps, each loaded in its step
            assert not gemv.mx_ahead(v, 1, fmt)
            step_bytes = v.block_k // (2 if fmt == "mxfp4" else 1)
            tile_bytes = gemv.MX_WIDE_STEP_BYTES // (2 if (fmt, n) == ("mxfp4", 5120) else 1)
            assert step_bytes * (v.block_n if wide else 1) == (tile_bytes if wide else 256)
            programs = -(-n // v.block_n) * v.split_k
            steps = -(-k // v.block_k)
            assert steps >= 2 * v.split_k
            assert programs >= gemv.TARGET_PROGRAMS // 2 or v.split_k == 8 or steps < 4 * v.split_k, (n, k, fmt, v)
            assert (v.split_k > 1) == (n == 128)  # only the router splits


def test_one_mx_row_takes_the_step_winners() -> None:
    # The fastest of the wide-step variants on an H200 (docs/decode.md): q/k/v 16 rows of 1,024
    # values a step on 4 warps, o 16 KB of codes a step on 8 (mxfp4: 180 programs, one wave).
    for fmt in ("mxfp4", "mxfp8"):
        assert gemv.default_variant(5120, 2880, 1, fmt) == DecodeVariant(16, 1024, 4, 1)  # q/k/v
    assert gemv.default_variant(2880, 4096, 1, "mxfp4") == DecodeVariant(16, 2048, 8, 1)  # o
    assert gemv.default_variant(2880, 4096, 1, "mxfp8") == DecodeVariant(8, 2048, 8, 1)
    # The router, the lm_head and more rows keep the general rule; short rows cap the step.
    assert gemv.default_variant(128, 2880, 1, "mxfp4").block_n == 8
    assert gemv.default_variant(201088, 2880, 1, "mxfp4") == DecodeVariant(16, 512, 4, 1)
    assert gemv.default_variant(5120, 2880, 2, "mxfp4").block_k == 512
    assert gemv.default_variant(3000, 96, 1, "mxfp4") == DecodeVariant(16, 128, 8, 1)
    for (n, k), fmt in itertools.product(((5120, 2880), (2880, 4096), (3000, 96), (1200, 4096)), ("mxfp4", "mxfp8")):
        v = gemv.default_variant(n, k, 1, fmt)
        assert gemv.variant_reason(v, fmt) is None
        assert v in gemv.candidate_variants(n, k, 1, fmt)  # the tuner can confirm or beat it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU twins: the small problems here)")
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_one_mx_row_defaults_at_gpt_oss_shapes_match_the_reference(fmt: str) -> None:
    # The wide one-row defaults at the real q/k/v and o shapes: full steps, no tails.
    for kernel, (n, k) in (("norm_linear", (5120, 2880)), ("linear_residual", (2880, 4096))):
        problem = DecodeProblem(kernel, n, k, 1, fmt, (("normed", 1),) if kernel == "norm_linear" else ())
        impl = KERNELS[kernel]
        inputs = impl.inputs(problem, "cuda", seed=60)
        got = impl.launch(inputs, impl.default(problem))
        assert relative_error(got, impl.reference(inputs)) <= TOLERANCE, (kernel, impl.default(problem).name())


def test_one_bf16_row_takes_the_sweeps_winners() -> None:
    # The fastest variants of an H100 run at gpt-oss's shapes (docs/decode.md): 8 warps but for
    # the lm_head's long stream, 4-row blocks for o's fewer rows, the router's whole row a step.
    assert gemv.default_variant(5120, 2880, 1, "bf16") == DecodeVariant(8, 256, 8, 1)  # q/k/v
    assert gemv.default_variant(2880, 4096, 1, "bf16") == DecodeVariant(4, 512, 8, 1)  # o
    assert gemv.default_variant(128, 2880, 1, "bf16") == DecodeVariant(2, 4096, 8, 1)  # router
    assert gemv.default_variant(201088, 2880, 1, "bf16") == DecodeVariant(8, 256, 4, 1)  # lm_head
    for n, k in ((5120, 2880), (2880, 4096), (128, 2880), (13, 77), (128, 9000)):
        v = gemv.default_variant(n, k, 1, "bf16")
        assert gemv.variant_reason(v, "bf16") is None
        assert v in gemv.candidate_variants(n, k, 1, "bf16")  # the tuner can confirm or beat it


def test_one_mx_row_loads_a_step_ahead_only_where_the_variant_asks() -> None:
    ahead = DecodeVariant(16, 512, 4, 1, 2)
    assert gemv.mx_ahead(ahead, 1, "mxfp8") and gemv.mx_ahead(ahead, 1, "mxfp4")
    assert not gemv.mx_ahead(DecodeVariant(16, 512, 4), 1, "mxfp8")  # one stage: loads in the step
    assert not gemv.mx_ahead(ahead, 2, "mxfp8")  # two rows
    assert not gemv.mx_ahead(ahead, 1, "bf16")  # bf16 loops load ahead on their own
    assert gemv.variant_reason(DecodeVariant(16, 512, 4, 1, 3), "mxfp8") == (
        "num_stages 3 is not 1 (loads in the step) or 2 (a step ahead)"
    )
    # The tuner sweeps both stages for one MX row, and one stage elsewhere.
    for fmt, batch, stages in (("mxfp8", 1, {1, 2}), ("mxfp4", 1, {1, 2}), ("mxfp8", 2, {1}), ("bf16", 1, {1})):
        assert {v.num_stages for v in gemv.candidate_variants(2880, 4096, batch, fmt)} == stages


MX_AHEAD_VARIANTS = [
    DecodeVariant(8, 64, 4, 1, 2),  # 4 steps of 64, the last masked (224 = 3 x 64 + 32)
    DecodeVariant(8, 64, 4, 2, 2),  # K splits of 2 steps, the second split's last step masked
    DecodeVariant(16, 128, 4, 3, 2),  # three splits over two steps: the last split has none
    DecodeVariant(32, 256, 4, 1, 2),  # one masked step, rows past N
]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("variant", MX_AHEAD_VARIANTS)
def test_one_mx_row_loaded_a_step_ahead_matches(device: str, fmt: str, variant: DecodeVariant) -> None:
    # Codes, scales and inputs (activations, the residual add and the norm weight) of each step
    # are loaded a step ahead: with the norm, with and without the add, and with the residual.
    assert gemv.mx_ahead(variant, 1, fmt)
    for add in (1, 0):
        inputs = _inputs("norm_linear", fmt, 1, 40, 224, device, seed=30 + add, add=add, bias=1, normed=1)
        got, want = gemv.norm_linear(**inputs, variant=variant), norm_linear_reference(**inputs)
        assert torch.equal(got[0], want[0])
        assert relative_error(got, want) <= TOLERANCE, add
    inputs = _inputs("linear_residual", fmt, 1, 40, 224, device, seed=32, bias=1)
    got = gemv.linear_residual(**inputs, variant=variant)
    assert relative_error(got, linear_residual_reference(**inputs)) <= TOLERANCE
    # The same sums as loading in the step: only where the loads are issued differs.
    in_step = gemv.linear_residual(**inputs, variant=DecodeVariant(*dataclasses.astuple(variant)[:4], 1))
    assert torch.equal(got, in_step)


def test_one_mx_row_takes_its_first_tile_early_except_in_a_long_stream() -> None:
    one_stage = DecodeVariant(16, 512, 4)
    for n in (5120, 2880, 128):  # q/k/v, o, the router
        assert gemv.early_tile(one_stage, 1, "mxfp4", n) and gemv.early_tile(one_stage, 1, "mxfp8", n)
    assert not gemv.early_tile(one_stage, 1, "mxfp4", 201088)  # the lm_head: many waves
    assert not gemv.early_tile(one_stage, 2, "mxfp4", 5120)  # two rows
    assert not gemv.early_tile(one_stage, 1, "bf16", 5120)  # bf16 loops have their own
    assert not gemv.early_tile(DecodeVariant(16, 512, 4, 1, 2), 1, "mxfp8", 5120)  # a step ahead already


EARLY_TILE_VARIANTS = [
    DecodeVariant(8, 64, 4),  # 4 steps of 64, the last masked (224 = 3 x 64 + 32)
    DecodeVariant(8, 64, 4, 2),  # K splits of 2 steps, the second split's last step masked
    DecodeVariant(16, 128, 4, 3),  # three splits over two steps: the last split has none
    DecodeVariant(32, 256, 4),  # one masked step, rows past N
    DecodeVariant(16, 1024, 8),  # the wide one-row mxfp4 default's form: one masked step, 8 warps
]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("variant", EARLY_TILE_VARIANTS)
def test_one_mx_row_with_its_first_tile_early_matches(
    device: str, fmt: str, variant: DecodeVariant, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first step's tile loaded before the wait, the rest in their steps: the same sums as every
    # step loading its own, bit for bit, and the reference's values.
    assert gemv.early_tile(variant, 1, fmt, 40)
    for add in (1, 0):
        inputs = _inputs("norm_linear", fmt, 1, 40, 224, device, seed=40 + add, add=add, bias=1, normed=1)
        early = gemv.norm_linear(**inputs, variant=variant)
        assert torch.equal(early[0], norm_linear_reference(**inputs)[0])
        assert relative_error(early, norm_linear_reference(**inputs)) <= TOLERANCE, add
        with monkeypatch.context() as m:
            m.setattr(gemv, "early_tile", lambda *a: False)
            in_step = gemv.norm_linear(**inputs, variant=variant)
        assert all(torch.equal(a, b) for a, b in zip(early, in_step, strict=True))
    inputs = _inputs("linear_residual", fmt, 1, 40, 224, device, seed=42, bias=1)
    early_out = gemv.linear_residual(**inputs, variant=variant)
    assert relative_error(early_out, linear_residual_reference(**inputs)) <= TOLERANCE
    monkeypatch.setattr(gemv, "early_tile", lambda *a: False)
    assert torch.equal(early_out, gemv.linear_residual(**inputs, variant=variant))


def test_weights_of_few_rows_get_wide_k_steps_to_choose_from() -> None:
    # The router's 16 row blocks: candidates down to 2-row blocks and up to the whole row a step;
    # o's 360: down to 4-row blocks, steps up to 512; q/k/v's 640 keep the usual grid.
    router = gemv.candidate_variants(128, 2880, 1, "bf16")
    assert {v.block_k for v in router} >= {1024, 2048, 4096} and min(v.block_n for v in router) == 2
    o = gemv.candidate_variants(2880, 4096, 1, "bf16")
    assert max(v.block_k for v in o) == 512 and min(v.block_n for v in o) == 4
    qkv = gemv.candidate_variants(5120, 2880, 1, "bf16")
    assert max(v.block_k for v in qkv) == 256 and min(v.block_n for v in qkv) == 8
    for v in router + o + qkv:
        assert gemv.variant_reason(v, "bf16") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(hidden=a["hidden"][:, :64]), "K 96 is not hidden's width 64"),
        (lambda a: a.update(hidden=torch.zeros((9, 96), dtype=torch.bfloat16)), "9 rows"),
        (lambda a: a.update(hidden=a["hidden"].float()), "hidden: "),
        (lambda a: a.update(add=a["add"][:, :10]), "add: shape"),
        (lambda a: a.update(add=a["add"].half()), "add: dtype"),
        (lambda a: a.update(bias=a["bias"][:5]), "bias: shape"),
        (lambda a: a.update(norm_weight=a["norm_weight"][:5]), "norm_weight: shape"),
        (lambda a: a.update(weight=a["weight"].float()), "weight: "),
        (lambda a: a.update(weight=a["weight"].t()), "weight: "),
    ],
)
def test_norm_linear_names_what_does_not_fit(change: object, message: str) -> None:
    inputs = _inputs("norm_linear", "bf16", 1, 40, 96, "cpu", seed=0)
    change(inputs)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        gemv.norm_linear(**inputs)


def test_bad_variants_and_residuals_are_refused() -> None:
    inputs = _inputs("linear_residual", "mxfp4", 1, 40, 96, "cpu", seed=0)
    with pytest.raises(ValueError, match="block_k 32 is below 64"):
        gemv.linear_residual(**inputs, variant=DecodeVariant(8, 32, 4))
    with pytest.raises(ValueError, match="block_n 24 is not a power of two"):
        gemv.linear_residual(**inputs, variant=DecodeVariant(24, 64, 4))
    with pytest.raises(ValueError, match="residual: shape"):
        gemv.linear_residual(inputs["x"], inputs["weight"], None, inputs["residual"][:, :8])
    # Any object with blocks, scales and fmt is a stored weight, and it is checked.
    w = inputs["weight"]
    with pytest.raises(ValueError, match="weight_blocks"):
        gemv.linear(inputs["x"], _Stored(w.blocks[:, :, :64], w.scales, "mxfp4"), None)
    with pytest.raises(ValueError, match="mxfp6"):
        gemv.linear(inputs["x"], _Stored(w.blocks, w.scales, "mxfp6"), None)


class _Stored:
    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, fmt: str) -> None:
        self.blocks, self.scales, self.fmt = blocks, scales, fmt


def _smoke_rows(device: str, tmp_path: Path, *argv: str) -> list[dict]:
    """The rows of a CPU smoke run of the decode ops benchmark with ``argv``."""
    if device != "cpu":
        pytest.skip("the CPU smoke run of the benchmark; on a GPU it measures")
    from benchmarks.bench_decode_ops import main

    out = tmp_path / "rows.json"
    assert main([*argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())["rows"]


def test_benchmark_smoke_run_writes_its_rows(device: str, tmp_path: Path) -> None:
    argv = ["--shapes", "o,router", "--formats", "mxfp4", "--batches", "3", "--sweep-limit", "2"]
    rows = _smoke_rows(device, tmp_path, *argv)
    assert [(r["shape"], r["op"], r["batch"], r["weights"]) for r in rows] == [
        ("o", "linear_residual", 3, "mxfp4"),
        ("router", "norm_linear", 3, "mxfp4"),
    ]
    for r in rows:
        assert r["rel_err"] <= TOLERANCE and r["best_rel_err"] <= TOLERANCE
        assert r["us"] > 0 and r["torch_us"] > 0 and DecodeVariant.parse(r["best_variant"])


def test_benchmark_times_the_variants_it_is_named(device: str, tmp_path: Path) -> None:
    named = ["n8-k64-w4-s1-p2", "n16-k64-w4-s2-p1"]
    (row,) = _smoke_rows(
        device, tmp_path, "--shapes", "o", "--formats", "mxfp8", "--batches", "1", "--variants", ",".join(named)
    )
    assert set(row["timed"]) == {row["variant"], *named} and all(us > 0 for us in row["timed"].values())
    assert row["best_variant"] in row["timed"] and row["best_rel_err"] <= TOLERANCE


def test_benchmark_refuses_a_variant_it_cannot_read(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_decode_ops import main

    assert main(["--variants", "n8-k64"]) == 2
    assert "--variants: not a decode variant name: 'n8-k64'" in capsys.readouterr().err


def test_the_benchmark_times_calls_apart_less_the_separator() -> None:
    from benchmarks.bench_decode_ops import per_call_us, programs

    cost = {"op": 10.0, "sep": 2.0}

    class FakeTimer:  # the mean cost of the calls it is given, as a graph of them would report
        def per_call_us(self, calls: list) -> float:
            return sum(cost[c()] for c in calls) / len(calls)

    def op() -> str:
        return "op"

    def sep() -> str:
        return "sep"

    assert per_call_us(FakeTimer(), [op] * 4, None) == 10.0  # type: ignore[arg-type]
    assert per_call_us(FakeTimer(), [op] * 4, sep) == pytest.approx(10.0)  # type: ignore[arg-type]
    assert programs(5120, DecodeVariant(8, 256, 8)) == 640 and programs(2880, DecodeVariant(64, 64, 4, 3)) == 135


def test_benchmark_smoke_run_apart_names_its_programs(device: str, tmp_path: Path) -> None:
    from benchmarks.bench_decode_ops import TINY

    (row,) = _smoke_rows(
        device, tmp_path, "--shapes", "o", "--formats", "bf16", "--batches", "1", "--no-sweep", "--apart"
    )
    n = TINY["o"][0]
    assert row["apart"] is True and row["programs"] == -(-n // DecodeVariant.parse(row["variant"]).block_n)
    assert row["us"] > 0 and row["rel_err"] <= TOLERANCE


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_both_k_loops_match_the_reference(device: str, fmt: str, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher picks the K loop (sums every step, or once after the loop) by registers; both
    # must give the op's result for every row count up to eight.
    inputs = _inputs("norm_linear", fmt, batch, 24, 256, device, seed=20 + batch, normed=1)
    want = norm_linear_reference(**inputs)
    for deferred in (False, True):
        monkeypatch.setattr(gemv, "defers", lambda *_, d=deferred: d)
        got = gemv.norm_linear(**inputs, variant=DecodeVariant(8, 64 if fmt == "mxfp4" else 32, 4, 2))
        assert torch.equal(got[0], want[0])
        assert relative_error(got, want) <= TOLERANCE, deferred


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_mx_group_sums_differ_from_one_accumulation_only_in_fp32_order(device: str, fmt: str, batch: int) -> None:
    # MX products are summed per 32-value scale group in fp32 chains and each group sum scaled once:
    # against the exact sum, only the fp32 order differs, so every bf16 output is within one unit
    # in the last place and nearly all round the same. A code or scale paired with the wrong
    # activation misses by far more.
    g = torch.Generator().manual_seed(40 + batch)
    n, k = 24, 1024
    weight = random_weight(n, k, fmt, g, device)
    # Rows of very different magnitudes: the group scaling must not lose small rows.
    x = (torch.randn((batch, k), generator=g) * torch.logspace(-6, 6, batch, base=2.0)[:, None]).to(torch.bfloat16)
    got = gemv.linear(x.to(device), weight, None, variant=DecodeVariant(16, 512 if fmt == "mxfp4" else 256, 4))
    exact = x.double() @ dequantized(weight).double().cpu().T
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert ((got.cpu().double() - exact).abs() <= ulp).all()
    assert (got.cpu() == exact.to(torch.bfloat16)).float().mean() >= 0.98


def test_deferred_sums_only_where_the_registers_allow() -> None:
    v = DecodeVariant(16, 128, 4)
    assert gemv.defers(v, 1, "bf16") and gemv.defers(v, 2, "bf16") and not gemv.defers(v, 4, "bf16")
    # One row of MX weights sums scale groups instead; more rows share the scaled tile.
    assert not gemv.defers(v, 1, "mxfp4") and gemv.defers(v, 2, "mxfp4")


@pytest.mark.parametrize("kernel", ["norm_linear", "linear_residual"])
def test_odd_bf16_shapes_are_masked(device: str, kernel: str) -> None:
    # K 77 and N 13 are tails of every block; bf16 weights take any shape.
    problem = DecodeProblem(kernel, 13, 77, 3, "bf16", (("normed", 1),) if kernel == "norm_linear" else ())
    impl = KERNELS[kernel]
    inputs = impl.inputs(problem, device, seed=9)
    want = impl.reference(inputs)
    for v in (impl.default(problem), DecodeVariant(8, 16, 4, 2)):
        assert relative_error(impl.launch(inputs, v), want) <= TOLERANCE, v.name()


class _RecordedLaunch:
    """Stands in for a Triton kernel: records the keyword arguments of each launch."""

    def __init__(self) -> None:
        self.kwargs: list[dict[str, object]] = []

    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.mark.parametrize(("capability", "on"), [((9, 0), True), ((12, 1), True), ((8, 9), False)])
def test_launches_chain_on_sm90_and_newer(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], on: bool
) -> None:
    # Off the interpreter, a capability pinned as the compile check pins it: the launch turns
    # programmatic dependent launch on (kernel constant and launch option together) from sm_90.
    from prepkit.kernels.mx import _chain
    from prepkit.kernels.mx._target import pinned_capability

    kernel = _RecordedLaunch()
    monkeypatch.setattr(gemv, "_gemv_kernel", kernel)
    monkeypatch.setattr(_chain, "interpreting", lambda: False)
    x = torch.zeros((2, 64), dtype=torch.bfloat16)
    with pinned_capability(capability):
        gemv.linear(x, torch.zeros((16, 64), dtype=torch.bfloat16), None)
    assert [(kw["PDL"], kw["launch_pdl"]) for kw in kernel.kwargs] == [(on, on)]


def test_the_interpreter_launches_without_chaining(monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit.kernels.mx._target import pinned_capability

    kernel = _RecordedLaunch()
    monkeypatch.setattr(gemv, "_gemv_kernel", kernel)
    monkeypatch.setattr(gemv, "interpreting", lambda: True)
    monkeypatch.setattr("prepkit.kernels.mx._chain.interpreting", lambda: True)
    with pinned_capability((9, 0)):
        gemv.linear(torch.zeros((1, 64), dtype=torch.bfloat16), torch.zeros((16, 64), dtype=torch.bfloat16), None)
    assert [(kw["PDL"], kw["launch_pdl"]) for kw in kernel.kwargs] == [(False, False)]
