"""``prepkit tune --thorough`` on the CPU: its plan, its checks, resume, budget, coverage, the
search each winner records, and the comparison with the pruned search. Stand-in backends time
candidates (and once the real worker runs under the interpreter)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from prepkit import console
from prepkit.cli import cli
from prepkit.kernels.device import H100 as H100_INFO
from prepkit.kernels.variants import enumerate_tactics
from prepkit.tactics.keys import Environment, ProblemKey, canon, gpt_oss_problems
from prepkit.tactics.lookup import TOKEN_POINTS
from prepkit.tune import (
    CandidateError,
    CheckResult,
    FunctionBackend,
    SubprocessBackend,
    SweepConfig,
    Timing,
    TuneOptions,
    Worker,
    kernel_defaults,
    prune_candidates,
    sweep,
    thorough,
)
from prepkit.tune import candidates as tune_candidates
from prepkit.tune import run as tune_run
from prepkit.tune.candidates import gemm1_split_siblings, kernel_space, moe_problem
from prepkit.tune.gpu_bench import CHECK_M, SINGLE_CHECK_M
from prepkit.tune.records import Screen
from prepkit.tune.worker import trim_kernel_caches

ROOT = Path(__file__).resolve().parents[2]
H100_ENV = Environment.of(H100_INFO)
TOKENS = "1-4,64,8192"
POINTS = (1, 2, 3, 4, 64, 8192)
TINY = gpt_oss_problems(
    kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3", num_experts=4, hidden=128,
    intermediate=128, top_k=2,
)  # fmt: skip


def problems(activations: str = "bf16") -> dict[str, ProblemKey]:
    from prepkit.kernels.mx import KERNEL_VERSION

    return gpt_oss_problems(
        kernel="moe_mxfp4", kernel_version=str(KERNEL_VERSION), weight_layout="triton_moe_v3", act_dtype=activations
    )


def synthetic_us(t: str, m: int) -> float:
    """The stand-in GPU's latency model: row blocks that fit M win, wide tiles a little, and one
    stage wins at large M (a variant the pruning rules never measure)."""
    d = json.loads(t)
    fit = abs(d["block_m"].bit_length() - (5 if m <= 64 else 8))
    stages = -0.2 if d["num_stages"] == 1 and m > 64 else 0.01 * d["num_stages"]
    return (5.0 + m * 0.01) * (1.3 + 0.15 * fit + (0.05 if d["block_n"] < 128 else 0) + stages)


def synthetic_timer(t: str, m: int) -> list[float]:
    us = synthetic_us(t, m)
    return [us * (1 + 0.001 * i) for i in range(9)]


def passes(t: str) -> bool:
    return json.loads(t)["block_n"] != 32


def small_space(problem: ProblemKey, device: Any) -> tuple[str, ...]:
    """Every 97th valid variant and the defaults: a space that keeps a sweep to seconds."""
    full = kernel_space.__wrapped__(problem, device)
    defaults = kernel_defaults(problem, device)
    return tuple(dict.fromkeys([*full[::97], *(defaults(m) for m in TOKEN_POINTS)]))


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both searches draw from :func:`small_space`; no bundled DB seeds them."""
    monkeypatch.setattr(tune_run, "kernel_space", small_space)
    monkeypatch.setattr(tune_candidates, "kernel_space", small_space)
    monkeypatch.setattr(tune_run, "bundled_db_path", lambda: None)


class Recorder:
    """A stand-in GPU that records each request with its problem's role."""

    def __init__(self, fail_after: int | None = None, timing_fails: Callable[[str, int], bool] | None = None):
        self.calls: list[tuple[str, str, str, int | None]] = []
        self.fail_after = fail_after
        self.timing_fails = timing_fails or (lambda t, m: False)

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult:
        self.calls.append(("check", problem.role, tactic, None))
        return CheckResult(passed=passes(tactic), reference="stand-in", rel_err=0.004 if passes(tactic) else 0.5)

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
        if self.fail_after is not None and sum(c[0] != "check" for c in self.calls) >= self.fail_after:
            raise RuntimeError("the machine went away")  # what a kill looks like from inside the sweep
        self.calls.append(("screen" if screen else "time", problem.role, tactic, m))
        if self.timing_fails(tactic, m):
            raise CandidateError("launch_error", "stand-in failure")
        return Timing.from_samples(synthetic_timer(tactic, m))

    def close(self) -> None:
        pass

    def timed(self, op: str = "time") -> set[tuple[str, str, int | None]]:
        """What was timed in full (``op`` ``"time"``) or screened (``"screen"``)."""
        return {(role, t, m) for o, role, t, m in self.calls if o == op}


def fake_gpu(monkeypatch: pytest.MonkeyPatch, backend: Any) -> None:
    monkeypatch.setattr(tune_run, "open_gpu_workers", lambda gpus, env=None: [Worker(backend, H100_ENV, H100_INFO)])


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def stored(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as c:
        return c.execute(sql).fetchall()


# ------------------------------------------------------------------------------ the plan


@pytest.mark.parametrize("activations", ["bf16", "mxfp8"])
def test_a_thorough_search_takes_up_every_valid_variant_and_prunes_none(activations: str) -> None:
    for role, p in problems(activations).items():
        # every valid variant but GEMM1's K splits, whose partial sums grow with the tokens
        valid = [
            canon(t)
            for t in enumerate_tactics(role, H100_INFO, moe_problem(p, 8192), activations=activations)
            if role == "gemm2" or t.split_k == 1
        ]
        plan = tune_run.search_candidates(TuneOptions(thorough=True), p, H100_INFO, [])
        assert plan == valid and len(set(plan)) == len(plan)
        pruned = tune_run.search_candidates(TuneOptions(), p, H100_INFO, [])
        assert len(pruned) == 64 and set(pruned) < set(plan)
        # what the pruning rules drop (one stage, bits beside asm, wide split-K) stays in
        dropped = set(valid) - set(prune_candidates(valid, role))
        assert dropped and dropped <= set(plan)
        assert any(json.loads(t)["num_stages"] == 1 for t in plan)


def test_a_thorough_search_checks_at_one_shape_the_pruned_one_at_four() -> None:
    assert TuneOptions(thorough=True).check_m == SINGLE_CHECK_M == (33,)
    assert TuneOptions().check_m == CHECK_M and len(CHECK_M) == 4 and 33 in CHECK_M
    assert TuneOptions(thorough=True).search == "thorough" and TuneOptions().search == "pruned"


def test_thorough_anchors_are_the_points_nearest_the_anchors() -> None:
    anchors = SweepConfig().anchors
    assert thorough.thorough_anchors(TOKEN_POINTS, anchors) == anchors  # the full series holds them
    assert thorough.thorough_anchors((1, 8, 64, 256, 2048, 8192), anchors) == (1, 8, 64, 256, 2048, 8192)
    near = thorough.thorough_anchors(tuple(range(1, 9)) + (12, 16, 8192), anchors)
    assert near == (1, 4, 16, 8192)  # 128 and 1024 lie nearer 16 and 8192 on a log scale than the rest
    assert set(near) <= set(range(1, 9)) | {12, 16, 8192}


def test_check_workers_follow_the_cpus_and_fit_the_gpu_memory() -> None:
    layer = thorough.layer_weight_bytes(problems()["gemm1"])
    assert layer == thorough.layer_weight_bytes(problems()["gemm2"])  # one layer, seen from each GEMM
    assert 1.5e9 < layer < 1.8e9  # gpt-oss-120b: 128 experts of 2880 x 2880 x 3 MXFP4 values
    steady = thorough.WORKER_BYTES_PER_LAYER_BYTE * layer + thorough.WORKER_OVERHEAD_BYTES
    build = thorough.BUILD_BYTES_PER_LAYER_BYTE * layer
    assert steady < build  # a built worker holds one copy of the layer, not the build's peak
    for cpus in (1, 2, 16, 128, None):
        for mem in (24e9, 80e9, 141e9, 0):
            n = thorough.check_workers(cpus, int(mem), layer)
            assert 1 <= n <= max(1, min((cpus or 2) - 1, thorough.MAX_CHECK_WORKERS))  # a core for timing
            if mem and n > 1:  # built workers, one build's peak and the timing worker fit the share
                assert n * steady + 2 * build <= mem * thorough.GPU_MEMORY_SHARE
    assert thorough.check_workers(16, 0, layer) == 15  # memory unknown: the CPUs decide
    assert thorough.check_workers(16, 79 << 30, layer) >= 14  # an H100 (79 GiB) holds about one per core
    assert thorough.check_workers(64, int(80e9), layer) < thorough.check_workers(64, int(141e9), layer)
    assert thorough.budget_minutes(None, thorough=True) > thorough.budget_minutes(None, thorough=False)
    assert thorough.budget_minutes(3.0, thorough=True) == 3.0


def test_the_tune_help_states_the_defaults_the_run_uses() -> None:
    shown = " ".join(invoke("tune", "--help").output.split())
    assert "--thorough" in shown
    assert (
        f"[default: {thorough.DEFAULT_BUDGET_MINUTES:g}; {thorough.THOROUGH_BUDGET_MINUTES:g} with --thorough]" in shown
    )
    assert f"[default: {thorough.DEFAULT_CHECK_WORKERS}; with --thorough one per CPU core, at most " in shown
    assert f"at most {thorough.MAX_CHECK_WORKERS} and" in shown


def test_thorough_refuses_max_candidates_and_compile_only(tmp_path: Path) -> None:
    r = invoke("tune", "--thorough", "--max-candidates", "10", "--db", str(tmp_path / "t.db"))
    assert r.exit_code == 2 and "--max-candidates cannot be used with --thorough" in r.output
    r = invoke("tune", "--arch", "sm90", "--compile-only", "--thorough")
    assert r.exit_code == 2 and "--thorough cannot be used with --compile-only" in r.output
    assert not (tmp_path / "t.db").exists()


# ------------------------------------------------------------------- checks in worker processes


FAKE_WORKER = textwrap.dedent(
    """
    import json, os, sys
    log = open(sys.argv[1], "a")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        log.write(json.dumps({"pid": os.getpid(), "op": req["op"], "m_values": req.get("m_values"),
                              "tactic": req.get("tactic"), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
        log.flush()
        if req["op"] == "bandwidth":
            out = {"gbps": 3000.0}
        elif req["op"] == "check":
            ms = req.get("m_values") or [1, 7, 33, 256]
            out = {"passed": True, "m_values": ms, "reference": "fake", "rel_err": 0.004, "tolerance": 0.02}
        else:
            t = json.loads(req.get("tactic") or "{}")
            out = {"samples_us": [10.0 + t.get("block_m", 16) / 16 + 0.01 * i for i in range(9)]}
        print(json.dumps({"ok": True, "result": out}), flush=True)
    """
)


def test_thorough_checks_run_in_worker_processes_at_one_shape(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The check workers run the timing worker's command, check at 33 tokens only, and every
    variant once; timing stays with the timing worker. A pruned run afterwards checks its own
    candidates again at all four counts: a one-shape pass is not its check."""
    script, log = tmp_path / "worker.py", tmp_path / "requests.jsonl"
    script.write_text(FAKE_WORKER)

    def open_workers(gpus: Sequence[int], env: object = None) -> list[Worker]:
        return [Worker(SubprocessBackend(argv=[sys.executable, str(script), str(log)]), H100_ENV, H100_INFO)]

    monkeypatch.setattr(tune_run, "open_gpu_workers", open_workers)
    db = tmp_path / "t.db"
    opts = TuneOptions(arch="sm90", points=POINTS, db_path=db, check_workers=2, dense_formats="none", cmdline=["test"])
    tune_run.run_tune(TuneOptions(**{**opts.__dict__, "thorough": True}))
    reqs = [json.loads(line) for line in log.read_text().splitlines()]
    checks = [r for r in reqs if r["op"] == "check"]
    timer_pids = {r["pid"] for r in reqs if r["op"] == "time"}
    assert len(timer_pids) == 1 and not timer_pids & {r["pid"] for r in checks}
    assert len({r["pid"] for r in checks}) >= 2  # the two check workers (restarted per GEMM)
    assert all(r["m_values"] == [33] for r in checks)
    space = {p.role: small_space(p, H100_INFO) for p in problems().values()}
    siblings = gemm1_split_siblings(problems()["gemm1"], H100_INFO)
    assert siblings is not None
    extras = {t for m in POINTS for t in siblings(m)} - set(space["gemm1"])  # GEMM1's splits, at up to 8 tokens
    assert extras and len(checks) == sum(len(s) for s in space.values()) + len(extras)
    assert stored(db, "SELECT DISTINCT m_values FROM correctness") == [("[33]",)]
    space_of_run = json.loads(stored(db, "SELECT search_space FROM tuning_run")[0][0])
    assert (space_of_run["check_workers"], space_of_run["check_m"], space_of_run["search"]) == (2, [33], "thorough")

    log.write_text("")
    tune_run.run_tune(TuneOptions(**{**opts.__dict__, "max_candidates": 8}))
    rechecked = [json.loads(line) for line in log.read_text().splitlines() if '"check"' in line]
    assert len(rechecked) >= 16 and all(r["m_values"] is None for r in rechecked)  # the worker's four
    full = stored(db, "SELECT COUNT(*) FROM correctness WHERE m_values = '[1, 7, 33, 256]'")[0][0]
    assert full == len(rechecked)


def test_check_workers_spread_over_the_gpus_of_the_run(small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With --gpus 0,1 the check workers take turns between the two GPUs (each GPU holds its share
    of their layers), and the memory bound counts both GPUs."""
    script, log = tmp_path / "worker.py", tmp_path / "requests.jsonl"
    script.write_text(FAKE_WORKER)

    def open_workers(gpus: Sequence[int], env: object = None) -> list[Worker]:
        argv = [sys.executable, str(script), str(log)]
        return [Worker(SubprocessBackend(g, argv=argv), H100_ENV, H100_INFO) for g in gpus]

    monkeypatch.setattr(tune_run, "open_gpu_workers", open_workers)
    opts = TuneOptions(
        arch="sm90", points=POINTS, db_path=tmp_path / "t.db", check_workers=4, dense_formats="none", gpus=(0, 1),
        thorough=True, cmdline=["test"],
    )  # fmt: skip
    tune_run.run_tune(opts)
    reqs = [json.loads(line) for line in log.read_text().splitlines()]
    timers = {r["pid"] for r in reqs if r["op"] == "time"}
    checks = [r for r in reqs if r["op"] == "check" and r["pid"] not in timers]
    per_gpu = {g: {r["pid"] for r in checks if r["gpu"] == g} for g in ("0", "1")}
    assert all(len(pids) >= 2 for pids in per_gpu.values())  # two of the four workers on each GPU
    assert {r["gpu"] for r in checks} == {"0", "1"}

    layer = thorough.layer_weight_bytes(problems()["gemm1"])
    one = thorough.check_workers(128, 80 << 30, layer)
    assert one < 31 and thorough.check_workers(128, 80 << 30, layer, gpus=2) == min(2 * one, thorough.MAX_CHECK_WORKERS)
    assert thorough.check_workers(16, 0, layer, gpus=2) == 14  # a core for each timing worker


def test_reusable_checks_keep_failures_and_passes_at_the_shapes_asked() -> None:
    rows = {
        "one-shape pass": {"passed": 1, "m_values": "[33]"},
        "full pass": {"passed": 1, "m_values": "[1, 7, 33, 256]"},
        "one-shape failure": {"passed": 0, "m_values": "[33]"},
        "stand-in pass": {"passed": 1, "m_values": "[]"},
    }
    assert set(tune_run.reusable_checks(rows, CHECK_M)) == {"full pass", "one-shape failure", "stand-in pass"}
    assert set(tune_run.reusable_checks(rows, SINGLE_CHECK_M)) == set(rows)


def test_the_real_worker_checks_at_the_token_counts_its_backend_asks_for() -> None:
    """The worker under the interpreter: the thorough check runs one shape, the default four."""
    p = TINY["gemm1"]
    runnable = canon({**json.loads(kernel_defaults(p, H100_INFO)(1)), "upcast": "bits", "weight_load": "ptr"})
    b = SubprocessBackend(env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}, check_m=SINGLE_CHECK_M)
    try:
        single = b.check(p, runnable)
        b.check_m = None
        full = b.check(p, runnable)
    finally:
        b.close()
    assert single.passed and single.m_values == SINGLE_CHECK_M
    assert full.passed and full.m_values == CHECK_M
    assert single.rel_err is not None and full.rel_err is not None
    assert 0 < single.rel_err < 2e-2 and 0 < full.rel_err < 2e-2


def test_workers_drop_compiled_variants_past_the_limit() -> None:
    class Kernel:
        def __init__(self, n: int) -> None:
            self.device_caches = {0: ({f"key{i}": object() for i in range(n)}, {}, "target", "backend", "binder")}

    a, b, interpreted = Kernel(3), Kernel(2), object()
    assert trim_kernel_caches([a, b, interpreted], limit=5) == 0 and len(a.device_caches[0][0]) == 3
    b.device_caches[0][0]["key9"] = object()
    assert trim_kernel_caches([a, b, interpreted], limit=5) == 6
    assert a.device_caches == {} and b.device_caches == {}


# ----------------------------------------------------------------------- a run, its resume


def test_a_stopped_thorough_run_resumes_without_measuring_anything_twice(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    opts = TuneOptions(arch="sm90", points=POINTS, db_path=db, thorough=True, dense_formats="none", cmdline=["test"])
    first = Recorder(fail_after=100)
    fake_gpu(monkeypatch, first)
    with pytest.raises(RuntimeError, match="went away"):
        tune_run.run_tune(opts)
    kept = {
        (role, t, m)
        for role, t, m in stored(
            db,
            "SELECT k.role, t.params_json, x.m FROM measurement x JOIN tactic t USING (tactic_hash) "
            "JOIN problem p USING (problem_hash) JOIN kernel k USING (kernel_hash)",
        )
    }
    checked = stored(db, "SELECT COUNT(*) FROM correctness")[0][0]
    assert 0 < len(kept) < 100 and len(kept) % len(POINTS) == 0  # whole groups of variants, every anchor
    assert kept <= first.timed("screen")
    assert checked == sum(1 for c in first.calls if c[0] == "check" and c[1] == "gemm1")  # gemm2 never began
    screened = {t for role, t, _ in kept if role == "gemm1"}
    unscreened = {t for op, role, t, _ in first.calls if op == "check" and role == "gemm1" and passes(t)} - screened

    second = Recorder()
    fake_gpu(monkeypatch, second)
    report = tune_run.run_tune(opts)
    assert report.status == "complete" and report.search == "thorough"
    assert not second.timed("screen") & kept  # nothing stored was screened again
    # Checked again: exactly the passes not screened yet (the check compiles them for the timing
    # worker); no failure and no screened variant. New: GEMM1's K splits, checked after the screens.
    siblings = gemm1_split_siblings(problems()["gemm1"], H100_INFO)
    assert siblings is not None
    first_checked = {t for op, role, t, _ in first.calls if op == "check" and role == "gemm1"}
    new = {t for m in POINTS for t in siblings(m)} - first_checked
    assert new and {t for op, role, t, _ in second.calls if op == "check" and role == "gemm1"} == unscreened | new
    assert stored(db, "SELECT status FROM tuning_run ORDER BY started_at") == [("aborted",), ("complete",)]
    # a pair once screened and once timed in full (a survivor), never twice the same way
    dup = (
        "SELECT COUNT(*) FROM (SELECT 1 FROM measurement GROUP BY problem_hash, m, tactic_hash, kind "
        "HAVING COUNT(*) > 1)"
    )
    assert stored(db, dup) == [(0,)]
    assert stored(db, "SELECT COUNT(*) FROM measurement WHERE kind = 'screen'")[0][0] > 0

    # the same winners as a run that was never stopped
    fake_gpu(monkeypatch, Recorder())
    whole = tune_run.run_tune(TuneOptions(**{**opts.__dict__, "db_path": tmp_path / "whole.db"}))
    for a, b in zip(report.layer.results, whole.layer.results, strict=True):
        assert [(w.m_lo, w.m_hi, w.tactic) for w in a.winners] == [(w.m_lo, w.m_hi, w.tactic) for w in b.winners]


def test_a_thorough_sweep_out_of_budget_keeps_its_groups_and_the_rest_follows() -> None:
    p = problems()["gemm1"]
    space = small_space(p, H100_INFO)
    ticks = iter(range(100_000))
    batches: list[Any] = []
    cfg = SweepConfig(points=POINTS, anchors=POINTS, search="thorough", budget_s=len(space) + 60)
    backend = FunctionBackend(synthetic_timer, passes)
    res = sweep(p, space, kernel_defaults(p, H100_INFO), [backend], config=cfg, on_batch=batches.append,
                clock=lambda: next(ticks))  # fmt: skip
    assert not res.complete and res.coverage is not None
    defaults = {kernel_defaults(p, H100_INFO)(m) for m in POINTS}
    first_group = batches[len(space)].measurements  # the checks come first, one batch each
    assert {x.tactic for x in first_group} >= defaults  # the defaults are measured first
    done = {(x.m, x.tactic): x.row() for x in res.measurements}
    rest = FunctionBackend(synthetic_timer, passes)
    unbounded = SweepConfig(**{**cfg.__dict__, "budget_s": None})
    res2 = sweep(p, space, kernel_defaults(p, H100_INFO), [rest], config=unbounded, previous_measurements=done,
                 previous_checks={c.tactic: c.row() for c in res.correctness})  # fmt: skip
    settled = {t for t in space if all((m, t) in done for m in POINTS)}  # screened at every anchor
    assert res2.complete and {t for op, t, _ in rest.calls if op == "check"} == set(filter(passes, space)) - settled
    assert not {(m, t) for op, t, m in rest.calls if op == "screen"} & set(done)
    assert res2.coverage is not None and res2.coverage.measured == sum(map(passes, space))


# -------------------------------------------------------------- what a run reports and stores


def test_the_summary_states_coverage_and_the_db_the_search(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def slow_to_fail(t: str, m: int) -> bool:
        return m == 8192 and json.loads(t)["num_warps"] == 8

    fake_gpu(monkeypatch, Recorder(timing_fails=slow_to_fail))
    db = tmp_path / "t.db"
    r = invoke(
        "tune",
        "--arch",
        "sm90",
        "--db",
        str(db),
        "--tokens",
        TOKENS,
        "--thorough",
        "--dense-formats",
        "none",
        "--json",
        "-q",
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["search"] == "thorough" and out["status"] == "complete"
    for p in out["problems"]:
        space = small_space(next(q for q in problems().values() if p["problem"].startswith(q.role)), H100_INFO)
        failed_check = [t for t in space if not passes(t)]
        failed_timing = [t for t in space if passes(t) and slow_to_fail(t, 8192)]
        assert failed_check and failed_timing
        assert p["coverage"] == {
            "search": "thorough", "activations": "bf16", "valid": len(space), "candidates": len(space),
            "checked": len(space), "failed": len(failed_check) + len(failed_timing),
            "measured": len(space) - len(failed_check), "anchors": list(POINTS),
        }  # fmt: skip
    assert {s for (s,) in stored(db, "SELECT search FROM winner")} == {"thorough"}
    assert json.loads(stored(db, "SELECT search_space FROM tuning_run")[0][0])["search"] == "thorough"

    # The text summary says the same; tactics show names the search.
    text = invoke(
        "tune", "--arch", "sm90", "--db", str(db), "--tokens", TOKENS, "--thorough", "--dense-formats", "none"
    ).output
    lines = [line for line in text.splitlines() if line.startswith("  thorough search, bf16:")]
    cov = out["problems"][0]["coverage"]
    assert len(lines) == 2 and lines[0] == (
        f"  thorough search, bf16: {cov['valid']} valid variants, {cov['checked']} checked, {cov['failed']} failed, "
        f"{cov['measured']} measured at 1, 2, 3, 4, 64, 8192 tokens"
    )
    shown = invoke("tactics", "show", "--db", str(db))
    assert shown.output.count("thorough search") == 2 and "pruned search" not in shown.output
    rows = json.loads(invoke("tactics", "show", "--db", str(db), "--json").output)["winners"]
    assert rows and {w["search"] for w in rows} == {"thorough"}

    # A pruned run replaces the ranges, and says so; its summary is as before, with the search.
    r = invoke("tune", "--arch", "sm90", "--db", str(db), "--tokens", TOKENS, "--dense-formats", "none", "--json", "-q")
    pruned = json.loads(r.output)
    assert pruned["search"] == "pruned" and all("coverage" not in p for p in pruned["problems"])
    assert {s for (s,) in stored(db, "SELECT search FROM winner")} == {"pruned"}
    text = invoke("tune", "--arch", "sm90", "--db", str(db), "--tokens", TOKENS, "--dense-formats", "none").output
    assert "search," not in text and "valid variants" not in text
    assert invoke("tactics", "show", "--db", str(db)).output.count("pruned search") == 2


def test_a_thorough_run_out_of_budget_says_so_and_the_next_one_finishes(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import time

    class Slow(Recorder):
        def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
            time.sleep(0.02)
            return super().time(problem, tactic, m, screen)

    fake_gpu(monkeypatch, Slow())
    db = tmp_path / "t.db"
    args = ("tune", "--arch", "sm90", "--db", str(db), "--tokens", TOKENS, "--thorough", "--dense-formats", "none")
    r = invoke(*args, "--budget-minutes", "0.1")
    assert r.exit_code == 0, r.output
    assert "(partial: budget reached; rerun to resume)" in r.output
    assert stored(db, "SELECT status FROM tuning_run") == [("partial",)]
    kept = stored(db, "SELECT COUNT(*) FROM measurement")[0][0]
    assert kept > 0
    fake_gpu(monkeypatch, Recorder())
    done = json.loads(invoke(*args, "--json", "-q").output)
    assert done["status"] == "complete" and sum(p["reused"] for p in done["problems"]) == kept


def test_progress_lines_count_variants_and_estimate_the_time_left(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv(console.PROGRESS_INTERVAL_ENV, "10")
    with console.progress(unit="count", eta=True) as on_progress:
        for second in range(0, 31):  # 500 variants reused, then 10 measured a second
            clock[0] = 100.0 + second
            on_progress("gemm1 N=5760 K=2880: variants measured", 500 + 10 * second, 1500)
    # 10 a second: 900 left after 10 s is 90 s, 800 after 20 s is 80 s
    assert capsys.readouterr().err.splitlines() == [
        "gemm1 N=5760 K=2880: variants measured: 600/1500 (40%), 10 s elapsed, about 2 min left",
        "gemm1 N=5760 K=2880: variants measured: 700/1500 (46%), 20 s elapsed, about 80 s left",
        "gemm1 N=5760 K=2880: variants measured: 800/1500 (53%), 30 s elapsed, about 70 s left",
    ]
    clock[0] = 200.0
    with console.progress(unit="count") as on_progress:  # without eta: the lines as before
        on_progress("x", 1, 2)
        clock[0] = 215.0
        on_progress("x", 2, 3)
    assert capsys.readouterr().err.splitlines() == ["x: 2/3 (66%), 15 s elapsed"]


# ------------------------------------------------------------------------------ the comparison


def tune_both(monkeypatch: pytest.MonkeyPatch, pruned_db: Path, thorough_db: Path) -> None:
    fake_gpu(monkeypatch, Recorder())
    base = ("tune", "--arch", "sm90", "--tokens", TOKENS, "--dense-formats", "none", "-q")
    assert invoke(*base, "--db", str(pruned_db), "--max-candidates", "8").exit_code == 0
    assert invoke(*base, "--db", str(thorough_db), "--thorough").exit_code == 0


def median_us(t: str, m: int) -> float:
    return Timing.from_samples(synthetic_timer(t, m)).median_us


@pytest.mark.parametrize("one_db", [False, True], ids=["two DBs", "one DB"])
def test_the_comparison_reads_both_searches_from_the_db(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, one_db: bool
) -> None:
    from benchmarks import tune_compare

    pruned_db = tmp_path / "pruned.db"
    thorough_db = pruned_db if one_db else tmp_path / "thorough.db"
    tune_both(monkeypatch, pruned_db, thorough_db)
    dbs = [str(pruned_db)] if one_db else [str(pruned_db), str(thorough_db)]
    from benchmarks import search_compare as compare

    doc = compare.compare(**compare.read_searches(dbs))
    assert doc["gpu"] == H100_ENV.name and len(doc["gemms"]) == 2
    assert all(len(s["runs"]) == 1 and s["complete"] and s["wall_s"] > 0 for s in doc["searches"].values())
    misses = []
    for g in doc["gemms"]:
        default = kernel_defaults(problems()[g["problem"].split()[0]], H100_INFO)
        assert [r["m"] for r in g["points"]] == list(POINTS)
        assert g["thorough"]["coverage"]["search"] == "thorough" and g["pruned"]["coverage"]["search"] == "pruned"
        assert g["pruned"]["coverage"]["measured"] < g["thorough"]["coverage"]["measured"]
        assert g["pruned"]["elapsed_s"] >= 0 and g["thorough"]["elapsed_s"] > 0
        for r in g["points"]:
            m = r["m"]
            assert r["default_us"] == pytest.approx(median_us(default(m), m))
            assert r["pruned_us"] == pytest.approx(median_us(r["pruned"], m))
            assert r["thorough_us"] == pytest.approx(median_us(r["thorough"], m))
            assert r["thorough_us"] <= r["pruned_us"]  # it searched a superset of the same timings
            if r["pruned"] == r["thorough"]:
                assert (r["miss_pct"], r["miss_basis"]) == (0.0, "same variant")
            else:
                expected = 100 * (median_us(r["pruned"], m) / r["thorough_us"] - 1)
                assert r["miss_pct"] == pytest.approx(expected, abs=0.01)
                assert r["miss_basis"] in ("thorough timings", "vs default")
                misses.append(r["miss_pct"])
    assert misses and max(misses) > 2  # the pruned search misses the one-stage tiles at 8192 tokens

    # The script prints the same as markdown and as JSON.
    md = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tune_compare.py"), *dbs],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    ).stdout  # fmt: skip
    assert md.startswith(f"## Pruned vs thorough search on {H100_ENV.name}")
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == 2 * len(POINTS)
    row = doc["gemms"][0]["points"][-1]
    assert table[len(POINTS) - 1].startswith(f"| 8192 | {row['default_us']:.1f} | {row['pruned_us']:.1f} | ")
    assert tune_compare.main([*dbs, "--json"]) == 0
    few = compare.compare(**compare.read_searches(dbs), tokens=[1, 64])
    assert [[r["m"] for r in g["points"]] for g in few["gemms"]] == [[1, 64], [1, 64]]
    assert few["gemms"][0]["points"][1] == doc["gemms"][0]["points"][4]


def test_the_replay_reads_a_thorough_search_from_the_db(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/tune_replay.py replays the pruned search on the thorough run's timings: a row per
    GEMM and point, the refined pick never slower than the plain one."""
    from benchmarks import tune_replay

    pruned_db, thorough_db = tmp_path / "pruned.db", tmp_path / "thorough.db"
    assert tune_replay.main([str(pruned_db)]) == 3  # no such DB
    tune_both(monkeypatch, pruned_db, thorough_db)
    capsys.readouterr()
    assert tune_replay.main([str(pruned_db)]) == 3  # a pruned run alone
    assert "thorough" in capsys.readouterr().err
    assert tune_replay.main([str(thorough_db)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"## Pruned search replayed on the thorough timings of {H100_ENV.name}")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[0]) for r in rows] == list(POINTS) * 2
    for r in rows:
        m, best_us, plain_us, refined_us = int(r[0]), float(r[1]), float(r[3]), float(r[5])
        assert best_us <= refined_us <= plain_us
        assert best_us >= min(median_us(t, m) for t in thorough_variants(thorough_db, m)) * (1 - 1e-9)
    assert out.count("checked / timed: pruned") == 2
    assert tune_replay.main([str(thorough_db), "--refine-rounds", "0"]) == 0  # no refinement: as plain
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert all(r[3] == r[5] for r in rows if r[0].strip().isdigit())


def thorough_variants(db: Path, m: int) -> list[str]:
    return [
        r[0]
        for r in stored(db, f"SELECT t.params_json FROM measurement JOIN tactic t USING (tactic_hash) WHERE m = {m}")
    ]


def test_the_comparison_counts_every_leg_of_a_resumed_search(
    small, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import tune_compare

    db = tmp_path / "t.db"
    assert tune_compare.main([str(db)]) == 3  # no such DB: a clear error
    assert "no such tactics DB" in capsys.readouterr().err
    fake_gpu(monkeypatch, Recorder())
    r = invoke("tune", "--arch", "sm90", "--tokens", TOKENS, "--dense-formats", "none", "-q", "--db", str(db))
    assert r.exit_code == 0
    assert tune_compare.main([str(db)]) == 3  # a pruned run alone
    assert "no finished thorough run" in capsys.readouterr().err

    opts = TuneOptions(
        arch="sm90", points=POINTS, db_path=db, thorough=True, dense_formats="none", cmdline=["prepkit", "--thorough"]
    )
    fake_gpu(monkeypatch, Recorder(fail_after=60))
    with pytest.raises(RuntimeError):
        tune_run.run_tune(opts)  # a first leg, stopped
    fake_gpu(monkeypatch, Recorder())
    tune_run.run_tune(opts)
    assert tune_compare.main([str(db), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    legs = doc["searches"]["thorough"]
    runs = stored(db, "SELECT run_id, status, started_at, finished_at FROM tuning_run ORDER BY started_at")
    assert [r[1] for r in runs] == ["complete", "aborted", "complete"]
    assert legs["runs"] == [runs[1][0], runs[2][0]] and legs["complete"]  # the pruned run is no leg
    last = datetime.fromisoformat(runs[2][3]) - datetime.fromisoformat(runs[2][2])
    assert legs["wall_s"] >= round(last.total_seconds(), 1)  # the stopped leg adds its own time
    assert doc["searches"]["pruned"]["runs"] == [runs[0][0]]
