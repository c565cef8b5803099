"""``prepkit tune --compile-only``: no GPU, no DB; what it prints, its exit codes, and every SM12x
default of gpt-oss-120b TP1 compiled for its target.

Runs that compile go in a fresh process, as a user runs them: once triton is imported under
TRITON_INTERPRET (the kernel tests' conftest sets it), nothing compiles ahead of time in that
process. Those processes refuse any question to torch.cuda.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli
from prepkit.layer import rank_layer

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
# One token and no sample: the two default GEMMs and the routing kernel, a few seconds.
FAST = ("--compile-only", "--tokens", "1", "--sample", "0")

_SCRIPT = r"""
import sys
import torch

def refuse(*a, **k):
    raise AssertionError("the compile-only run asked torch.cuda")

for name in ("is_available", "get_device_properties", "current_device", "device_count", "init"):
    setattr(torch.cuda, name, refuse)
PATCH
from prepkit.cli import main
sys.argv = ["prepkit", "tune", *sys.argv[1:]]
main()
"""


def run_tune(
    *args: str, patch: str = "", interpret: bool = False, db: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if db is not None:
        env["PREPKIT_TACTICS_DB"] = str(db)
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # the command turns it off before triton loads
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = _SCRIPT.replace("PATCH", patch)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT
    )


def invoke(*args: str):
    return CliRunner().invoke(cli, ["tune", *args], catch_exceptions=False)


def test_compile_only_prints_table_and_progress_and_exits_0(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    r = run_tune("--arch", "sm121", "--model", "gpt-oss-120b", "--tp", "1", "--activations", "mxfp4", *FAST, db=db)
    assert r.returncode == 0, r.stderr
    table = r.stdout.splitlines()
    assert table[0].split()[:3] == ["arch", "act", "stage"]
    gemm_rows = [line for line in table if " gemm1 " in line or " gemm2 " in line]
    assert len(gemm_rows) == 2 and all("block_scale mxf4nvf4" in line for line in gemm_rows), r.stdout
    assert "sm121 (NVIDIA GB10) mxfp4, gpt-oss-120b TP1 rank 0: defaults 2/2 compiled" in r.stdout
    # progress: one line per kernel on stderr, never on stdout
    assert "[1/2] route route (T=1): compiled" in r.stderr
    assert "[2/2] gemm2" in r.stderr and "[2/2]" not in r.stdout
    assert not db.exists()


def test_compile_only_json_parses_and_works_with_triton_interpret_set() -> None:
    r = run_tune("--arch", "sm120", "--activations", "mxfp8", "--json", "-q", *FAST, interpret=True)
    assert r.returncode == 0, r.stderr
    reports = json.loads(r.stdout)
    assert {x["stage"] for x in reports} == {"route", "gemm1", "gemm2"}
    assert all(x["status"] == "compiled" and x["arch"] == "sm120" for x in reports)
    assert {x["mma"] for x in reports if x["stage"] != "route"} == {"block_scale mxf8f6f4"}
    assert all(x["ptx_target"] == "sm_120a" for x in reports)
    assert "[1/" not in r.stderr  # --quiet: no progress


def test_a_failing_default_exits_6_naming_kernel_and_tactic() -> None:
    patch = (
        "from prepkit.kernels.compile_check import moe as cc\n"
        "real = cc.invalid_reason\n"
        "cc.invalid_reason = lambda t, gemm, device, act: "
        "'rejected for the test' if gemm == 'gemm2' else real(t, gemm, device, act)\n"
    )
    r = run_tune("--arch", "sm121", "--activations", "bf16", *FAST, patch=patch)
    assert r.returncode == 6, r.stderr
    from prepkit.kernels import compile_check as cc

    shape = rank_layer(_dims())
    g2 = [c.tactic for c in cc.default_candidates("sm121", shape, "bf16", (1,)) if c.gemm == "gemm2"]
    assert len(g2) == 1
    assert "1 default kernel(s) failed the sm121 compile check" in r.stderr
    assert f"sm121 bf16 gemm2 {g2[0].key()} (default T=1): pruned: rejected for the test" in r.stderr
    assert "gemm1" not in r.stderr.split("failed the sm121 compile check")[1]
    assert "pruned: rejected for the test" in r.stdout  # the table still shows every kernel


def test_an_mx_default_without_the_native_mma_exits_6() -> None:
    # stand in a compiler that decomposes: the PTX then holds a bf16 mma.sync
    patch = (
        "from prepkit.kernels.compile_check import sass as cc\n"
        "real = cc.mma_kind\n"
        "cc.mma_kind = lambda ptx: ('mma.sync bf16', 'mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32') "
        "if 'block_scale' in ptx else real(ptx)\n"
    )
    r = run_tune("--arch", "sm121", "--activations", "mxfp8", *FAST, patch=patch)
    assert r.returncode == 6, r.stderr
    assert "2 default kernel(s) failed" in r.stderr
    assert "gemm1 _gemm1_swiglu_kernel m16" in r.stderr
    assert "PTX holds mma.sync bf16, not the native block_scale mxf8f6f4" in r.stderr


def _dims():
    from prepkit.recipes import load_recipe, model_dims

    return model_dims(load_recipe("gpt-oss-120b").reference_dims)


@pytest.mark.parametrize("arch", [None, "auto", "sm100"])
def test_compile_only_needs_an_arch_with_a_reference_device(arch: str | None) -> None:
    r = invoke(*(["--arch", arch] if arch else []), "--compile-only")
    assert r.exit_code == 5
    assert f"--compile-only with --arch {arch or 'auto'}" in r.stderr
    for name in ("sm90", "sm120", "sm121", "GB10", "RTX PRO 6000"):
        assert name in r.stderr


def test_compile_only_refuses_options_of_a_measuring_run(tmp_path: Path) -> None:
    r = invoke("--arch", "sm121", "--compile-only", "--db", str(tmp_path / "t.db"), "--gpus", "0")
    assert r.exit_code == 2 and "--db, --gpus cannot be used with --compile-only" in r.output
    assert not (tmp_path / "t.db").exists()
    r = invoke("--arch", "sm121", "--sample", "2")
    assert r.exit_code == 2 and "--sample applies to --compile-only only" in r.output


def test_compile_only_reads_a_triton_moe_shard_set(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    prep = ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--ep", "2", "--layout", "triton-moe", "--out", str(out)]
    assert CliRunner().invoke(cli, [*prep, "-q"], catch_exceptions=False).exit_code == 0
    r = invoke("--arch", "sm121", "--shards", str(out), "--tp", "4", *FAST)
    assert r.exit_code == 3 and "prepared for tp=2" in r.stderr
    r = run_tune("--arch", "sm121", "--shards", str(out), "--activations", "mxfp8", *FAST)
    assert r.returncode == 0, r.stderr
    assert f"{out} TP2 EP2 rank 0: defaults 2/2 compiled" in r.stdout


def test_compile_in_an_interpreted_process_is_one_clear_error() -> None:
    code = (
        "import os; os.environ['TRITON_INTERPRET'] = '1'\n"
        "import triton.language\n"
        "from prepkit.errors import DeviceError\n"
        "from prepkit.kernels import compile_check as cc\n"
        "from prepkit.layer import rank_layer\n"
        "from prepkit.layouts.base import ModelDims\n"
        "shape = rank_layer(ModelDims(1, 8, 256, 512, 2))\n"
        "try:\n"
        "    cc.compile_variants('sm121', shape, 'bf16', cc.default_candidates('sm121', shape, 'bf16', (1,)))\n"
        "except DeviceError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "REFUSED triton was imported with TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


def test_compile_only_help_teaches_and_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from prepkit.cli import main\n"
        "sys.argv = ['prepkit', 'tune', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('HEAVY', sorted({'torch', 'triton'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    text = " ".join(out.split())
    for needle in ("--compile-only needs no GPU and writes no DB", "Exit codes of --compile-only", "sm121: GB10",
                   "native block-scaled MMA", "--json"):  # fmt: skip
        assert needle in text, needle


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm120", "sm121"])
@pytest.mark.parametrize("activations", ["bf16", "mxfp8", "mxfp4"])
def test_every_sm12x_default_compiles_for_its_target(arch: str, activations: str) -> None:
    """gpt-oss-120b TP1, every default over the tactic table's token points, compiled as a launch
    on the reference device would compile it: no spills, shared memory within the block limit,
    and for mxfp8 / mxfp4 the native block-scaled MMA in every GEMM's PTX."""
    from prepkit.kernels import compile_check as cc
    from prepkit.kernels.device import ARCH_DEVICES

    r = run_tune("--arch", arch, "--model", "gpt-oss-120b", "--tp", "1", "--activations", activations,
                 "--compile-only", "--sample", "0", "--json", "-q")  # fmt: skip
    assert r.returncode == 0, r.stderr
    reports = json.loads(r.stdout)
    want = cc.default_candidates(arch, rank_layer(_dims()), activations)  # type: ignore[arg-type]
    gemms = [x for x in reports if x["stage"] != "route"]
    assert sorted((x["stage"], x["tactic"]) for x in gemms) == sorted((c.gemm, c.tactic.to_json()) for c in want)
    assert any(x["stage"] == "route" for x in reports)
    limit = ARCH_DEVICES[arch].max_shared_mem
    for x in reports:
        label = f"{x['stage']} {x['kernel']} {x['tactic']}"
        assert x["status"] == "compiled", label
        assert x["ptx_target"] == arch.replace("sm", "sm_") + "a", label
        assert x["spill_bytes"] == 0, label
        assert 0 < x["registers"] <= 255, label
        assert x["shared_bytes"] is not None and x["shared_bytes"] <= limit, label
    for x in gemms:
        label = f"{x['stage']} {x['tactic']}"
        assert x["k_step_instructions"] and x["k_step_mma"], label
        if activations == "bf16":
            assert x["mma"] == "mma.sync bf16", label
        else:
            ptx = {"mxfp8": "kind::mxf8f6f4.block_scale", "mxfp4": "kind::mxf4nvf4.block_scale"}[activations]
            assert x["mma"] == cc.NATIVE_MMA[activations] and ptx in x["mma_instruction"], label


def test_compile_only_adds_the_dense_section_of_the_formats_asked() -> None:
    # mxfp4 activations pair with mxfp4 weights only: "all" compiles that one format
    r = run_tune(
        "--arch", "sm121", "--activations", "mxfp4", "--no-moe", "--dense-formats", "all", "--json", "-q", *FAST
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    reports = json.loads(r.stdout)
    assert {x["stage"] for x in reports} == {"dense"}
    assert all(x["status"] == "compiled" and x["ptx_target"] == "sm_121a" for x in reports)
    gemms = [x for x in reports if x["kernel"] == "_dense_kernel"]
    assert gemms and {x["mma"] for x in gemms} == {"block_scale mxf4nvf4"}
    # the origins name the model's dense shapes, derived from its config
    assert {x["origin"].split()[1] for x in gemms} <= {"qkv", "o", "lm_head"}


def test_compile_only_refuses_a_dense_format_the_policy_cannot_pair() -> None:
    r = invoke("--arch", "sm121", "--activations", "mxfp4", "--dense-formats", "mxfp8", *FAST)
    assert r.exit_code == 3  # refused before anything compiles
    assert "they need mxfp4 weights, not mxfp8" in r.output  # the one pairing rule's words
