"""The compile check's helpers on literal inputs and small shapes (no compiling: the kernel
tests' conftest imports triton under TRITON_INTERPRET, which stops ahead-of-time compiles in this
process; tests/tune/test_compile_only.py compiles, in fresh processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prepkit.kernels import compile_check as cc
from prepkit.kernels.compile_check import candidates as cc_candidates
from prepkit.kernels.device import ARCH_DEVICES
from prepkit.kernels.tactic import GemmTactic
from prepkit.kernels.variants import dense_invalid_reason, invalid_reason
from prepkit.layer import rank_layer
from prepkit.layouts.base import ModelDims
from prepkit.recipes import load_recipe
from prepkit.tune.dense import dense_shapes

SMALL = rank_layer(ModelDims(1, 8, 256, 512, 2))
# gpt-oss-120b's dense shapes, from the one function that derives them from a model config.
GPT_OSS_DENSE = {s.name: (s.n, s.k) for s in dense_shapes(load_recipe("gpt-oss-120b").reference_dims)}


def test_ranges_joins_consecutive_points() -> None:
    assert cc_candidates._ranges([1, 2, 3, 8, 12]) == "1-3,8,12"
    assert cc_candidates._ranges([5]) == "5"
    assert cc_candidates._ranges([4, 5, 7, 8, 9]) == "4-5,7-9"


def test_spread_keeps_ends_and_count() -> None:
    items = [GemmTactic(16, 64 * (i + 1), 128, 4, 3, 1, "asm", "ptr") for i in range(10)]
    for count in (2, 3, 4, 7):
        picked = cc_candidates._spread(items, count)
        assert len(picked) == count
        assert picked[0] is items[0] and picked[-1] is items[-1]
        idx = [items.index(t) for t in picked]
        assert idx == sorted(set(idx))
        # evenly spread: no gap exceeds the even gap by more than one
        gaps = [b - a for a, b in zip(idx, idx[1:], strict=False)]
        assert max(gaps) - min(gaps) <= 1
    assert cc_candidates._spread(items, 1) == [items[0]]
    assert cc_candidates._spread(items, 0) == []
    assert cc_candidates._spread(items, 50) == items
    assert cc_candidates._spread([], 3) == []


@pytest.mark.parametrize(
    ("ptx", "label"),
    [
        ("mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0 {",
         "block_scale mxf8f6f4"),
        ("mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::2X.f32.e2m1.e2m1.f32.ue8m0 {",
         "block_scale mxf4nvf4"),
        ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {", "wgmma"),
        ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {", "mma.sync bf16"),
        ("mov.u32 %r1, 0;", ""),
    ],
)  # fmt: skip
def test_mma_kind_labels_the_instruction(ptx: str, label: str) -> None:
    found, instruction = cc.mma_kind(f"//\n.target sm_120a\n\t{ptx}\n\tret;\n")
    assert found == label
    assert (instruction != "") == bool(label) and ptx.startswith(instruction)


def test_mma_kind_prefers_the_block_scaled_mma_over_a_bf16_one() -> None:
    ptx = (
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {};\n"
        "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0 {};\n"
    )
    assert cc.mma_kind(ptx)[0] == "block_scale mxf8f6f4"


def _sass(lines: list[str]) -> str:
    out, addr = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    return "\n".join(out)


def test_k_loop_is_the_innermost_back_edge_loop_holding_mma() -> None:
    sass = _sass(
        [
            "MOV R1, c[0x0][0x28]",
            ".L_x_0:",  # outer loop: 9 instructions, 2 MMA
            "IADD3 R2, R2, 0x1, RZ",
            ".L_x_1:",  # inner loop (the K step): 5 instructions, 2 MMA
            "LDS.128 R4, [R3]",
            "HMMA.16816.F32.BF16 R8, R4, R6, R8",
            "HMMA.16816.F32.BF16 R12, R4, R6, R12",
            "ISETP.GE.AND P0, PT, R2, 0x4, PT",
            "@!P0 BRA `(.L_x_1)",
            "STS [R3], R8",
            "ISETP.GE.AND P1, PT, R2, 0x8, PT",
            "@!P1 BRA `(.L_x_0)",
            ".L_x_2:",  # a loop without MMA: ignored
            "IADD3 R9, R9, 0x1, RZ",
            "@P2 BRA `(.L_x_2)",
            "EXIT",
        ]
    )
    assert cc.k_loop(sass) == (5, 2)


def test_k_loop_is_none_without_a_loop_holding_mma() -> None:
    straight = _sass(["HMMA.16816.F32.BF16 R8, R4, R6, R8", ".L_x_0:", "IADD3 R2, R2, 0x1, RZ", "@P0 BRA `(.L_x_0)"])
    forward = _sass(["@P0 BRA `(.L_x_3)", "HMMA.16816.F32.BF16 R8, R4, R6, R8", ".L_x_3:", "EXIT"])
    assert cc.k_loop(straight) is None
    assert cc.k_loop(forward) is None


def _report(**kw: object) -> cc.CompileReport:
    t = GemmTactic(16, 128, 128, 4, 3, 1, "dot_scaled", "ptr")
    base = cc.CompileReport(
        "sm121", "mxfp8", "gemm1", t.to_json(), "default T=1-8", "compiled", kernel="_gemm1_swiglu_kernel",
        mma="block_scale mxf8f6f4",
    )  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def test_check_failures_names_failed_defaults_and_routing_not_samples() -> None:
    ok = _report()
    route = _report(stage="route", tactic="", origin="T=1", kernel="_route_kernel", mma="")
    assert cc.check_failures([ok, route]) == []
    bad = _report(status="failed", message="PassManager::run failed\nmore")
    pruned = _report(stage="gemm2", status="pruned", message="too much shared memory", kernel="")
    sample = _report(origin="sample dot_scaled/ptr/tail/swap", status="failed", message="ptxas error")
    bad_route = replace(route, status="failed", message="launcher refused: no")
    lines = cc.check_failures([ok, bad, pruned, sample, bad_route])
    assert len(lines) == 3
    key = GemmTactic.from_json(ok.tactic).key()
    assert "gemm1 _gemm1_swiglu_kernel " + key in lines[0] and "PassManager::run failed" in lines[0]
    assert "more" not in lines[0]
    assert "gemm2" in lines[1] and "pruned: too much shared memory" in lines[1]
    assert "route _route_kernel" in lines[2]


def test_check_failures_wants_the_native_mma_of_mx_defaults_on_sm12x_only() -> None:
    decomposed = _report(mma="mma.sync bf16")
    assert len(cc.check_failures([decomposed])) == 1
    assert "not the native block_scale mxf8f6f4" in cc.check_failures([decomposed])[0]
    assert "not the native block_scale mxf4nvf4" in cc.check_failures([replace(decomposed, activations="mxfp4")])[0]
    assert cc.check_failures([replace(decomposed, arch="sm120")]) != []
    # Hopper has no native path; bf16 wants none; a sampled variant never fails the check
    assert cc.check_failures([replace(decomposed, arch="sm90")]) == []
    assert cc.check_failures([replace(decomposed, activations="bf16")]) == []
    assert cc.check_failures([replace(decomposed, origin="sample dot_scaled/ptr/tail/swap")]) == []


@pytest.mark.parametrize("activations", ["bf16", "mxfp8", "mxfp4"])
def test_samples_are_valid_bounded_per_family_and_spread(activations: str) -> None:
    device = ARCH_DEVICES["sm121"]
    for per_family in (1, 2):
        cands = cc.sample_candidates("sm121", SMALL, activations, per_family, num_tokens=64)  # type: ignore[arg-type]
        assert cands
        by_family: dict[tuple[str, str], list[GemmTactic]] = {}
        for c in cands:
            assert invalid_reason(c.tactic, c.gemm, device, activations) is None  # type: ignore[arg-type]
            assert c.origin == "sample " + cc.family(c.tactic, activations)  # type: ignore[arg-type]
            by_family.setdefault((c.gemm, c.origin), []).append(c.tactic)
        assert all(1 <= len(v) <= per_family for v in by_family.values())
    # one per family is each family's first member; two add a different, later one
    one = {(c.gemm, c.origin): c.tactic for c in cc.sample_candidates("sm121", SMALL, activations, 1, 64)}  # type: ignore[arg-type]
    two = cc.sample_candidates("sm121", SMALL, activations, 2, 64)  # type: ignore[arg-type]
    for c in two:
        assert (c.gemm, c.origin) in one
    assert {(c.gemm, c.origin) for c in two} == set(one)


def test_check_candidates_puts_defaults_first_and_compiles_each_variant_once() -> None:
    cands = cc.check_candidates("sm120", SMALL, "mxfp8", 2, (1, 2, 64, 512), sample_tokens=(1, 512))
    origins = [c.origin.split()[0] for c in cands]
    assert origins == sorted(origins)  # "default" < "sample"
    keys = [(c.gemm, c.tactic) for c in cands]
    assert len(keys) == len(set(keys))
    defaults = cc.default_candidates("sm120", SMALL, "mxfp8", (1, 2, 64, 512))
    assert cands[: len(defaults)] == defaults
    # the large-token space adds tiles of more than 16 rows that one token never uses
    assert max(c.tactic.block_m for c in cands if c.origin.startswith("sample")) > 16


def test_dense_candidates_cover_the_dense_shapes_once_each() -> None:
    for fmt, act in (("mxfp4", "bf16"), ("mxfp8", "mxfp8")):
        cands = cc.dense_candidates("sm121", fmt, act, GPT_OSS_DENSE)  # type: ignore[arg-type]
        assert cands and len({c.tactic for c in cands}) == len(cands)
        assert {c.origin.split()[1] for c in cands} == set(GPT_OSS_DENSE)
        assert all(dense_invalid_reason(c.tactic, fmt, ARCH_DEVICES["sm121"], act) is None for c in cands)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm120", "sm121"])
@pytest.mark.parametrize(
    ("weights", "activations", "mma"),
    [("mxfp8", "mxfp8", "kind::mxf8f6f4.block_scale"), ("mxfp4", "mxfp8", "kind::mxf8f6f4.block_scale"),
     ("mxfp4", "mxfp4", "kind::mxf4nvf4.block_scale"), ("mxfp8", "bf16", ".bf16.bf16")],
)  # fmt: skip
def test_dense_defaults_compile_for_sm12x(arch: str, weights: str, activations: str, mma: str) -> None:
    """The dense defaults compile for the target (a fresh process: this one interprets), with the
    native block-scaled MMA for the MX policies."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json, sys\n"
        "from prepkit.kernels import compile_check as cc\n"
        f"cands = cc.dense_candidates({arch!r}, {weights!r}, {activations!r}, {GPT_OSS_DENSE!r})\n"
        f"r = cc.compile_dense({arch!r}, {weights!r}, {activations!r}, cands)\n"
        "print(json.dumps({'reports': [x.to_dict() for x in r], 'failures': cc.check_failures(r)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["failures"] == []
    gemms = [r for r in res["reports"] if r["kernel"] == "_dense_kernel"]
    assert gemms
    for r in gemms:
        assert r["status"] == "compiled" and r["spill_bytes"] == 0, r
        assert r["ptx_target"] == arch.replace("sm", "sm_") + "a"
        assert mma in r["mma_instruction"], r["mma_instruction"]


@pytest.mark.slow
def test_gemm1_k_split_compiles_for_every_target() -> None:
    """GEMM1 with a K split (partials, arrival counter, the last split's SwiGLU) compiles for
    sm_90, sm_120 and sm_121 without spills (a fresh process: this one interprets), and so does
    the one-token default of an RTX PRO 6000's TP 2 rank on the SM12x targets."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tactic = (
        '{"block_k":256,"block_m":16,"block_n":64,"k_loop":"masked","num_stages":3,"num_warps":4,'
        '"split_k":2,"swapped_dot":"joined","upcast":"asm","weight_load":"ptr"}'
    )
    code = (
        "import json\n"
        "from prepkit.dims import ModelDims\n"
        "from prepkit.kernels.compile_check import moe\n"
        "from prepkit.kernels.compile_check.candidates import Candidate\n"
        "from prepkit.kernels.device import RTX_PRO_6000\n"
        "from prepkit.kernels.tactic import GemmTactic\n"
        "from prepkit.kernels.variants import default_tactics\n"
        "from prepkit.layer import rank_layer, resolve_layer\n"
        "from prepkit.layouts.base import RankSpec\n"
        "shape = resolve_layer(model='gpt-oss-120b', shards=None, tp=2).layer\n"
        f"t = GemmTactic.from_json({tactic!r})\n"
        "rank = rank_layer(ModelDims(1, 128, 2880, 2880, 4), RankSpec(tp_size=2, tp_rank=0))\n"
        "d = default_tactics(rank.problem(1), RTX_PRO_6000)[0]\n"
        "assert d.split_k == 2, d\n"
        "out = []\n"
        "for arch in ('sm90', 'sm120', 'sm121'):\n"
        "    cands = [Candidate('gemm1', t, 'split', 1)]\n"
        "    cands += [Candidate('gemm1', d, 'default', 1)] if arch != 'sm90' else []\n"
        "    r = moe.compile_variants(arch, shape, 'bf16', cands, routing=False)\n"
        "    out += [x.to_dict() for x in r]\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr
    reports = json.loads(out.stdout.splitlines()[-1])
    assert [r["ptx_target"] for r in reports] == ["sm_90a", "sm_120a", "sm_120a", "sm_121a", "sm_121a"]
    for r in reports:
        assert r["status"] == "compiled" and r["spill_bytes"] == 0, r
