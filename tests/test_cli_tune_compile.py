"""``prepkit tune --compile-only`` through click's CliRunner: no GPU, no DB, exit codes, output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepkit.cli import cli

pytest.importorskip("triton")

# One token and no sample: the two default GEMMs and the routing kernel, a few seconds.
FAST = ("--compile-only", "--tokens", "1", "--sample", "0")


def invoke(*args: str):
    return CliRunner().invoke(cli, ["tune", *args], catch_exceptions=False)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any question to the CUDA driver fails the test."""
    import torch

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the compile-only run asked torch.cuda")

    for name in ("is_available", "get_device_properties", "current_device", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_compile_only_prints_table_and_progress_and_exits_0(no_cuda: None, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PREPKIT_TACTICS_DB", str(tmp_path / "t.db"))
    r = invoke("--arch", "sm121", "--model", "gpt-oss-120b", "--tp", "1", "--activations", "mxfp4", *FAST)
    assert r.exit_code == 0, r.output
    table = r.stdout.splitlines()
    assert table[0].split()[:3] == ["arch", "act", "stage"]
    gemm_rows = [line for line in table if " gemm1 " in line or " gemm2 " in line]
    assert len(gemm_rows) == 2 and all("block_scale mxf4nvf4" in line for line in gemm_rows), r.stdout
    assert "sm121 (NVIDIA GB10) mxfp4, gpt-oss-120b TP1 rank 0: defaults 2/2 compiled" in r.stdout
    # progress: one line per kernel on stderr, never on stdout
    assert "[1/2] route route (T=1): compiled" in r.stderr
    assert "[2/2] gemm2" in r.stderr and "[2/2]" not in r.stdout
    assert not (tmp_path / "t.db").exists()


def test_compile_only_json_parses(no_cuda: None) -> None:
    r = invoke("--arch", "sm120", "--activations", "mxfp8", "--json", "-q", *FAST)
    assert r.exit_code == 0, r.output
    reports = json.loads(r.stdout)
    assert {x["stage"] for x in reports} == {"route", "gemm1", "gemm2"}
    assert all(x["status"] == "compiled" and x["arch"] == "sm120" for x in reports)
    assert {x["mma"] for x in reports if x["stage"] != "route"} == {"block_scale mxf8f6f4"}
    assert all(x["ptx_target"] == "sm_120a" for x in reports)
    assert r.stderr == ""  # --quiet: no progress


def test_a_failing_default_exits_6_naming_kernel_and_tactic(monkeypatch: pytest.MonkeyPatch) -> None:
    from prepkit.kernels import compile_check as cc
    from prepkit.kernels.variants import default_tactics
    from prepkit.kernels.variants import invalid_reason as real

    g2 = default_tactics(cc.LayerShape.of(_dims(), 1).problem(1), cc.arch_device("sm121"), "bf16")[1]

    def reject_gemm2(t, gemm, device, activations):
        return "rejected for the test" if gemm == "gemm2" else real(t, gemm, device, activations)

    monkeypatch.setattr(cc, "invalid_reason", reject_gemm2)
    r = invoke("--arch", "sm121", "--activations", "bf16", *FAST)
    assert r.exit_code == 6, r.output
    assert "1 default kernel(s) failed the sm121 compile check" in r.stderr
    assert f"sm121 bf16 gemm2 {g2.key()} (default T=1): pruned: rejected for the test" in r.stderr
    assert "gemm1" not in r.stderr.split("failed the sm121 compile check")[1]
    assert "pruned: rejected for the test" in r.stdout  # the table still shows every kernel


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
    r = invoke("--arch", "sm121", "--sample", "2")
    assert r.exit_code == 2 and "--sample applies to --compile-only only" in r.output


def test_compile_only_reads_a_triton_moe_shard_set(ep_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    prep = ["prepare", "--src", str(ep_ckpt), "--tp", "2", "--ep", "2", "--layout", "triton-moe", "--out", str(out)]
    assert CliRunner().invoke(cli, [*prep, "-q"], catch_exceptions=False).exit_code == 0
    r = invoke("--arch", "sm121", "--shards", str(out), "--activations", "mxfp8", "--json", "-q", *FAST)
    assert r.exit_code == 0, r.output
    assert {x["status"] for x in json.loads(r.stdout)} == {"compiled"}
    r = invoke("--arch", "sm121", "--shards", str(out), "--tp", "4", *FAST)
    assert r.exit_code == 3 and "prepared for tp=2" in r.stderr


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
