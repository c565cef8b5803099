"""``prepkit generate --nproc 2`` on a split set: rank 0 alone prints, every rank decodes rank
0's prompt (read from stdin) with rank 0's seed; the memory check counts a rank's share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prepkit.generation.loading import cache_bytes, weight_bytes
from prepkit.manifest import Manifest
from tests.distributed.conftest import REPO, cpu_twin, two_gpus


@cpu_twin
def test_generate_over_two_ranks_prints_once(ep2: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = _generate_prints_once(ep2, "cpu", env)
    assert result["ranks"] == {"tp": 1, "ep": 2, "all_reduce": "gloo"}
    # Without --json the summary on stderr names the split and its sum.
    command = [sys.executable, "-m", "prepkit", "generate", str(ep2), "--device", "cpu", "--nproc", "2", "-n", "2"]
    done = subprocess.run(
        command, input="a prompt", env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tp1 ep2 (gloo)" in done.stderr


@two_gpus
@pytest.mark.parametrize("split", ["tp2", "ep2"])
def test_generate_over_two_gpus_prints_once(split: str, request: pytest.FixtureRequest) -> None:
    """The GPU twin: NCCL between two GPUs, the kernels compiled, the default step."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _generate_prints_once(request.getfixturevalue(split), "cuda", env)
    assert result["ranks"]["all_reduce"] in ("lamport", "symmetric", "nccl")


def _generate_prints_once(folder: Path, device: str, env: dict[str, str]) -> dict:
    env = {**env, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "prepkit", "generate", str(folder), "--device", device, "--nproc", "2"]
    done = subprocess.run(
        [*command, "-n", "3", "--temperature", "0.8", "--json"],
        input="a prompt from stdin",
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # one document: rank 1 printed nothing
    assert result["new_tokens"] == 3 and result["prompt_tokens"] > 1
    assert "Error" not in done.stderr
    return result


@cpu_twin
def test_bench_over_two_ranks_writes_one_whole_report(ep2: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "prepkit", "bench", str(ep2), "--device", "cpu", "--nproc", "2"]
    done = subprocess.run(
        [*command, "--pp", "", "--tg", "2", "-r", "1", "--no-sampled", "--json", "--out", str(out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_text() == done.stdout  # rank 0's report, whole: rank 1 wrote nothing
    assert json.loads(done.stdout)["ranks"]["ep"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temp file left


def test_a_rank_needs_its_experts_and_its_share_of_the_rest(tp1: Path, tp2: Path) -> None:
    one, two = Manifest.read(tp1), Manifest.read(tp2)
    shared = sum(two.files[rel].bytes for rel in two.shared_files)
    experts = [sum(r.bytes for rel, r in two.files.items() if rel.startswith(f"rank{k}/experts-")) for k in (0, 1)]
    assert weight_bytes(two, 1) == experts[1] + shared // 2
    assert max(weight_bytes(two, 0), weight_bytes(two, 1)) < weight_bytes(one)
    config = one.model.config
    assert cache_bytes(config, 2, 64, ranks=2) * 2 == cache_bytes(config, 2, 64)


def test_the_bench_table_names_the_split() -> None:
    from prepkit.generation.bench import markdown

    report = {
        "model": {"recipe": "gpt-oss-120b", "layers": 36, "dense": "bf16"},
        "device": "GPU", "activations": "bf16", "step": "modules", "copy_bandwidth_gb_s": None,
        "tests": [{"test": "tg32", "batch": 1, "tok_s": {"median": 10.0, "stdev": 0.5}}],
    }  # fmt: skip
    assert "| gpt-oss-120b 36L dense bf16 | GPU |" in markdown(report)
    report["ranks"] = {"tp": 2, "ep": 1, "all_reduce": "symmetric"}
    assert "| gpt-oss-120b 36L dense bf16 tp2 ep1 (symmetric) | GPU |" in markdown(report)
