"""``prepkit tune --decode`` on the CPU: a stand-in decode kernel registered here is swept, its
winner stored, and the run-time lookup serves it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prepkit.kernels.decode.problems import step_attention_problem
from prepkit.kernels.decode.variants import KERNELS, DecodeProblem, DecodeVariant
from prepkit.tactics.decode_lookup import decode_kernel_version, decode_variant
from prepkit.tactics.keys import Environment
from prepkit.tactics.store import env_record, open_db
from prepkit.tune import CandidateError, CheckResult, SubprocessBackend, Timing
from prepkit.tune.decode_bench import LocalDecodeBackend, load_kernels
from prepkit.tune.decode_problems import SITE_KERNELS, decode_formats, decode_problems
from prepkit.tune.decode_sweep import decode_winner_row, sweep_decode
from prepkit.tune.sweep_config import RETIME, RetimeConfig
from tests.tactics.test_db import H100

# The variant whose result is wrong: it skips the last block of the reduction. It is also the
# fastest, so only its check keeps it from winning.
WRONG = DecodeVariant(block_n=16, block_k=8, num_warps=1)
FASTEST = DecodeVariant(block_n=64, block_k=32, num_warps=4)
# What a variant's launch costs on the stand-in device: fewer rows per program, more time.
COST_US = {16: 60.0, 32: 120.0, 64: 10.0}


class FakeGemv:
    """A decode kernel with the protocol of prepkit.kernels.decode: out = x @ w.T, in K blocks."""

    def __init__(self, name: str = "fake_gemv") -> None:
        self.name = name
        self.launched: list[str] = []

    def default(self, problem: DecodeProblem) -> DecodeVariant:
        return DecodeVariant(block_n=32, block_k=32, num_warps=4)

    def candidates(self, problem: DecodeProblem) -> list[DecodeVariant]:
        good = [DecodeVariant(n, k, 4) for n in (16, 32, 64) for k in (16, 32)]
        return [*good, WRONG]

    def inputs(self, problem: DecodeProblem, device: Any, seed: int = 0) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(problem.batch, problem.cols, generator=g) + 0.1
        w = torch.randn(problem.rows, problem.cols, generator=g) + 0.1
        return {"x": x.to(device), "w": w.to(device)}

    def launch(self, inputs: dict[str, Any], variant: DecodeVariant) -> Any:
        self.launched.append(variant.name())
        x, w = inputs["x"], inputs["w"]
        k = x.shape[1]
        stop = k - variant.block_k if variant == WRONG else k
        out = torch.zeros(x.shape[0], w.shape[0])
        for lo in range(0, stop, variant.block_k):
            out += x[:, lo : lo + variant.block_k] @ w[:, lo : lo + variant.block_k].T
        return out

    def reference(self, inputs: dict[str, Any]) -> Any:
        return inputs["x"].double() @ inputs["w"].double().T

    def tolerance(self, problem: DecodeProblem) -> float:
        return 1e-4


PROBLEM = DecodeProblem("fake_gemv", rows=48, cols=64, batch=2, fmt="bf16")


@pytest.fixture
def fake() -> Any:
    load_kernels()  # the real kernels register first, so the stand-in never meets them mid-run
    kernel = FakeGemv()
    mp = pytest.MonkeyPatch()
    mp.setitem(KERNELS, kernel.name, kernel)
    yield kernel
    mp.undo()


class LocalWithCosts(LocalDecodeBackend):
    """Checks and times in this process (the real path), but reports each variant's cost instead of
    the host's clock, which other processes on a shared CPU make too noisy to rank variants by."""

    def time_decode(self, problem: DecodeProblem, variant: str) -> Timing:
        host = super().time_decode(problem, variant)
        assert host.n_samples >= 3 and host.median_us > 0
        v = DecodeVariant.parse(variant)
        us = COST_US[v.block_n] - v.block_k / 16  # wider K steps a little faster
        return Timing.from_samples([us, us * 1.001, us * 0.999])


def _store(path: Path, result: Any, kernel: Any, env: Environment = H100) -> None:
    row = decode_winner_row(result, kernel)
    with open_db(path) as tdb:
        env_hash = tdb.put_env(env_record(env, package_version="0.1.0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=())
        if row is not None:
            tdb.put_decode_winner(env_hash, run, row)


def test_sweep_stores_the_fastest_passing_variant_and_the_lookup_serves_it(fake: Any, tmp_path: Path) -> None:
    backend = LocalWithCosts("cpu", kernels=dict(KERNELS))
    result = sweep_decode(PROBLEM, fake, backend)
    assert result.complete and result.winner == FASTEST.name()
    assert WRONG.name() in result.failed and "numerics_fail" in result.failed[WRONG.name()]
    assert WRONG.name() not in result.timings  # checked, never timed
    assert fake.launched.count(WRONG.name()) == 1 and fake.launched.count(FASTEST.name()) > 1
    assert result.default_us is not None and result.speedup is not None and result.speedup > 1.0

    db = tmp_path / "t.db"
    _store(db, result, fake)
    assert decode_variant(fake, PROBLEM, db, device=H100) == FASTEST
    with open_db(db) as tdb:
        (row,) = tdb.decode_winners()
    assert (row["kernel"], row["problem_key"], row["variant"]) == ("fake_gemv", PROBLEM.key(), FASTEST.name())
    assert row["kernel_version"] == decode_kernel_version(fake) and row["gpu_name"] == H100.name

    default = fake.default(PROBLEM)
    other_batch = DecodeProblem("fake_gemv", rows=48, cols=64, batch=4, fmt="bf16")
    assert decode_variant(fake, other_batch, db, device=H100) == default  # another problem: no row
    sm121 = Environment(cc_major=12, cc_minor=1, name="NVIDIA GB10", triton_version="3.6.0")
    assert decode_variant(fake, PROBLEM, db, device=sm121) == default  # another GPU family
    newer_triton = Environment(**{**H100.__dict__, "triton_version": "3.7.0"})
    assert decode_variant(fake, PROBLEM, db, device=newer_triton) == default
    assert decode_variant(fake, PROBLEM, tmp_path / "none.db", device=H100) == default  # no DB


def test_a_pinned_variant_is_served_before_any_row(fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # How one variant is timed inside the step: pinned by problem key for the process.
    from prepkit.errors import TacticsError
    from prepkit.tactics.decode_lookup import PINNED_ENV, pinned_variants

    db = tmp_path / "t.db"
    _store(db, sweep_decode(PROBLEM, fake, LocalWithCosts("cpu", kernels=dict(KERNELS))), fake)
    pin = DecodeVariant(16, 16, 4)
    other = DecodeProblem("fake_gemv", rows=48, cols=64, batch=4, fmt="bf16")
    monkeypatch.setenv(PINNED_ENV, f" {PROBLEM.key()} = {pin.name()} , {other.key()}={WRONG.name()}")
    assert pinned_variants() == {PROBLEM.key(): pin, other.key(): WRONG}
    assert decode_variant(fake, PROBLEM, db, device=H100) == pin  # over the stored winner
    assert decode_variant(fake, other, tmp_path / "none.db", device=H100) == WRONG  # over the default
    monkeypatch.delenv(PINNED_ENV)
    assert decode_variant(fake, PROBLEM, db, device=H100) == FASTEST
    for text, named in (("just-a-key", "just-a-key"), (f"{PROBLEM.key()}=n8", "n8"), ("=n8-k8-w1-s1-p1", "=n8")):
        with pytest.raises(TacticsError, match=f"{PINNED_ENV}: .*{named}"):
            pinned_variants(text)


def test_a_kernel_of_another_version_is_not_served_its_old_rows(fake: Any, tmp_path: Path) -> None:
    result = sweep_decode(PROBLEM, fake, LocalWithCosts("cpu", kernels=dict(KERNELS)))
    db = tmp_path / "t.db"
    _store(db, result, fake)
    fake.version = "2"  # the kernel changed since it was tuned
    assert decode_variant(fake, PROBLEM, db, device=H100) == fake.default(PROBLEM)


class DriftingDecode:
    """A stand-in decode backend: every check passes, and each timing is 3 % slower than the one
    before (a clock throttling as it heats), so what is timed later looks slower than it is."""

    TRUE_US = {"n32-k32-w4-s1-p1": 30.0, "n16-k16-w4-s1-p1": 20.0, "n64-k16-w4-s1-p1": 19.6}

    def __init__(self) -> None:
        self.calls = 0
        self.timed: list[str] = []

    def check_decode(self, problem: DecodeProblem, variant: str) -> CheckResult:
        return CheckResult(passed=True, reference="stand-in")

    def time_decode(self, problem: DecodeProblem, variant: str) -> Timing:
        if variant not in self.TRUE_US:
            raise CandidateError("launch_error", "not built in this stand-in")
        us = self.TRUE_US[variant] * 1.03**self.calls
        self.calls += 1
        self.timed.append(variant)
        return Timing.from_samples([us, us * 1.001, us * 0.999])


def test_close_calls_are_retimed_in_rounds_and_the_row_says_so(fake: Any, tmp_path: Path) -> None:
    """Timed once, n64-k16 (truly 2 % faster) comes after n16-k16 and looks slower; timed again in
    rotated rounds it wins, and its stored row records the rounds."""
    one_shot = sweep_decode(PROBLEM, fake, DriftingDecode(), retime_config=RetimeConfig(rounds=1))
    assert one_shot.winner == "n16-k16-w4-s1-p1" and one_shot.retimed == 0

    backend = DriftingDecode()
    result = sweep_decode(PROBLEM, fake, backend)
    assert result.winner == "n64-k16-w4-s1-p1" and result.retimed == RETIME.rounds
    a, b = "n16-k16-w4-s1-p1", "n64-k16-w4-s1-p1"
    assert backend.timed[3:] == [a, b, b, a, a, b]  # the default, 50 % slower, is no close call
    names = {fake.default(PROBLEM).name(), *(v.name() for v in fake.candidates(PROBLEM))}
    assert len(result.failed) == len(names) - 3  # the rest do not run on this stand-in
    db = tmp_path / "t.db"
    _store(db, result, fake)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT variant, retimed FROM decode_winner").fetchall() == [
            ("n64-k16-w4-s1-p1", RETIME.rounds)
        ]


def test_a_sweep_cut_short_is_not_stored(fake: Any) -> None:
    ticks = iter(range(100))
    result = sweep_decode(PROBLEM, fake, DriftingDecode(), deadline=1.5, clock=lambda: float(next(ticks)))
    assert not result.complete and decode_winner_row(result, fake) is None


def test_problems_follow_the_model_dims() -> None:
    config = {
        "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 201088, "num_local_experts": 128,
    }  # fmt: skip
    targets = decode_problems(config, ["bf16", "mxfp4"], batches=(1, 4), contexts=(128, 4096))
    shapes = {(t.site, t.problem.rows, t.problem.cols, t.problem.fmt) for t in targets}
    assert ("qkv", 5120, 2880, "mxfp4") in shapes and ("o", 2880, 4096, "bf16") in shapes
    assert ("lm_head", 201088, 2880, "bf16") in shapes and ("attention", 64, 4096, "bf16") in shapes
    assert {t.problem.fmt for t in targets if t.site == "router"} == {"bf16"}
    assert {t.problem.kernel for t in targets} == set(SITE_KERNELS.values())
    # The mxfp4 lm_head is the dense kernel's problem, not the decode GEMV's.
    assert ("lm_head", 201088, 2880, "mxfp4") not in shapes
    assert len(targets) == (3 * 2 + 1 - 1) * 2 + 2 * 2
    attn = next(t.problem for t in targets if t.site == "attention")
    assert dict(attn.extra) == {"head_dim": 64, "kv_heads": 8, "window": 0, "cache_len": 128}
    # The step looks up exactly what the tuner records.
    assert step_attention_problem(1, 64, 8, 64, cache_len=3000, window=None) == next(
        t.problem for t in targets if t.site == "attention" and t.problem.cols == 4096 and t.problem.batch == 1
    )
    assert step_attention_problem(4, 64, 8, 64, cache_len=3000, window=128) == next(
        t.problem for t in targets if t.site == "attention" and t.problem.cols == 128 and t.problem.batch == 4
    )
    assert decode_formats(["mxfp4"], from_shards=True) == ["mxfp4"]
    assert decode_formats([], from_shards=True) == ["bf16"]
    assert decode_formats(["mxfp8", "mxfp4"], from_shards=False) == ["bf16", "mxfp8", "mxfp4"]


class StandInGpu(SubprocessBackend):
    """The GPU worker as a decode run sees it, with no process behind it: every variant but
    ``WRONG`` passes, and a variant takes longer the fewer output rows a program covers (no drift,
    so nothing is retimed)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.checked: list[tuple[str, str]] = []

    def request(self, req: Any, timeout: float) -> dict[str, Any]:
        raise AssertionError(f"no worker process in this test: {req}")

    def bandwidth_gbps(self) -> float:
        return 3000.0

    def check_decode(self, problem: DecodeProblem, variant: str) -> CheckResult:
        self.checked.append((problem.key(), variant))
        return CheckResult(passed=variant != WRONG.name(), reference="stand-in", rel_err=0.0, tolerance=1e-4)

    def time_decode(self, problem: DecodeProblem, variant: str) -> Timing:
        v = DecodeVariant.parse(variant)
        us = problem.batch + 100.0 / v.block_n + 1.0 / v.block_k
        return Timing.from_samples([us, us * 1.001])

    def check(self, *args: Any) -> Any:
        raise AssertionError("no MoE or dense problem is tuned here")

    time = check


def test_tune_decode_stores_a_winner_per_problem_the_lookup_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``prepkit tune --decode --no-moe --dense-formats none``: the registered kernel's problems
    (here the o projection's: three formats, four batches) are swept on the worker, each winner
    stored, and the kernels not registered named."""
    import json

    from click.testing import CliRunner

    from prepkit.cli import cli
    from prepkit.kernels.device import H100 as H100_INFO
    from prepkit.tune import Worker, decode_bench
    from prepkit.tune import run as tune_run

    gpu = StandInGpu()
    kernel = FakeGemv(SITE_KERNELS["o"])
    env = Environment.of(H100_INFO)
    monkeypatch.setattr(tune_run, "open_gpu_workers", lambda gpus, env_vars=None: [Worker(gpu, env, H100_INFO)])
    monkeypatch.setattr(decode_bench, "load_kernels", lambda: {kernel.name: kernel})
    db = tmp_path / "t.db"
    args = ["tune", "--arch", "sm90", "--model", "gpt-oss-120b", "--no-moe", "--dense-formats", "none", "--decode"]
    out = CliRunner().invoke(cli, [*args, "--db", str(db), "--json", "--quiet"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert summary["status"] == "complete" and len(summary["decode"]) == 12
    assert {d["winner"] for d in summary["decode"]} == {"n64-k32-w4-s1-p1"}
    missing = {SITE_KERNELS[s] for s in ("qkv", "attention")}
    assert all(any(k in n for n in summary["decode_notes"]) for k in missing)
    assert any(v == WRONG.name() for _, v in gpu.checked)  # checked, and never a winner
    with open_db(db) as tdb:
        rows = tdb.decode_winners()
    assert len(rows) == 12 and {r["variant"] for r in rows} == {FASTEST.name()}
    problem = DecodeProblem(kernel.name, rows=2880, cols=4096, batch=4, fmt="mxfp4")
    assert decode_variant(kernel, problem, db, device=H100_INFO) == FASTEST


def test_a_decode_problem_crosses_the_worker_protocol_unchanged() -> None:
    import json

    from prepkit.tune.backend import decode_problem_from_json, decode_problem_json

    p = DecodeProblem("rope_cache_attend", 64, 4096, 2, "bf16", (("head_dim", 64), ("kv_heads", 8)))
    assert decode_problem_from_json(json.loads(json.dumps(decode_problem_json(p)))) == p


def test_each_timed_call_is_followed_by_the_separator_whose_time_is_taken_off(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The step runs each decode kernel between others, so a launch's last wave runs in the open:
    # the tuner follows every call with a one-value kernel and takes that kernel's own time off.
    from prepkit.tune import decode_bench, gpu_bench

    order: list[str] = []
    bench = decode_bench.DecodeBench(fake, PROBLEM, torch.device("cpu"))
    value = torch.zeros(1)
    bench._separator = lambda: order.append("separator") or value.add_(1.0)
    launch = fake.launch
    monkeypatch.setattr(fake, "launch", lambda inputs, v: order.append(v.name()) or launch(inputs, v))

    def samples(call: Any, rotate: int, device: Any) -> dict[str, Any]:
        call(0)
        return {"samples_us": [3.0, 3.0, 3.0] if rotate == 1 else [10.0, 12.0, 14.0], "reps": 1}

    monkeypatch.setattr(gpu_bench, "graph_samples", samples)
    timing = bench.time(FASTEST.name())
    assert order[:2] == [FASTEST.name(), "separator"] and order.count("separator") == 2
    assert timing.median_us == pytest.approx(9.0)  # 12 with the separator, less its 3
    assert bench.separator_us() == 3.0 and order.count("separator") == 2  # measured once


def test_the_worker_process_checks_and_times_decode_variants() -> None:
    """The GPU worker's decode ops, run on the CPU with the stand-in kernel registered in it."""
    import os
    import sys

    script = (
        "import sys; from prepkit.kernels.decode.variants import register; "
        "from tests.tune.test_decode_tune import FakeGemv; register(FakeGemv()); "
        "from prepkit.tune.worker import worker_main; sys.exit(worker_main(0))"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    backend = SubprocessBackend(None, argv=[sys.executable, "-c", script], env=env, check_timeout_s=120)
    try:
        good = backend.check_decode(PROBLEM, FASTEST.name())
        assert good.passed and good.rel_err is not None and good.rel_err < 1e-6
        bad = backend.check_decode(PROBLEM, WRONG.name())
        assert not bad.passed and bad.rel_err is not None and bad.rel_err > bad.tolerance
        timing = backend.time_decode(PROBLEM, FASTEST.name())
        assert timing.n_samples >= 3 and timing.median_us > 0
        other = DecodeProblem("not_registered", 8, 8, 1)
        with pytest.raises(CandidateError, match="not_registered"):
            backend.check_decode(other, FASTEST.name())
    finally:
        backend.close()


@pytest.mark.slow
def test_compile_only_decode_compiles_every_decode_kernel_for_sm121() -> None:
    # A fresh process: in this one triton may already run as the interpreter, which compiles nothing.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["tune", "--arch", "sm121", "--compile-only", "--decode", "--no-moe", "--dense-formats", "none", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "prepkit", *argv], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert {r["stage"] for r in rows} == {"decode", "attention"}
    assert all(r["status"] == "compiled" for r in rows)
    # the attention's two products run on the tensor cores there too
    assert all("mma" in (r["mma"] or "") for r in rows if r["stage"] == "attention")
