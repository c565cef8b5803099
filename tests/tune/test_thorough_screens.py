"""The thorough search's screens on the CPU: when a screen is cut short, that screens wait for the
checks, that no screen ever chooses a winner, how the budget follows the work left, how a DB keeps
both kinds of timing, and the side-by-side retiming of the comparison."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from benchmarks.search_compare import SIDE_BY_SIDE, markdown, retime
from prepkit.errors import TacticsError
from prepkit.kernels.device import H100 as H100_INFO
from prepkit.tactics import store
from prepkit.tactics.keys import Environment, ProblemKey, canon, gpt_oss_problems
from prepkit.tune import CheckResult, SweepConfig, Timing, kernel_defaults, sweep
from prepkit.tune.layer_sweep import work_left
from prepkit.tune.records import OK, Measurement, Screen
from prepkit.tune.winners import choose

POINTS = (1, 8, 64)


def problem() -> ProblemKey:
    from prepkit.kernels.mx import KERNEL_VERSION

    return gpt_oss_problems(kernel="moe_mxfp4", kernel_version=str(KERNEL_VERSION), weight_layout="triton_moe_v3")[
        "gemm1"
    ]


def variants(n: int) -> list[str]:
    p = problem()
    default = kernel_defaults(p, H100_INFO)
    others = [canon({"block_m": 16, "block_n": bn, "block_k": bk, "num_stages": s}) for bn in (64, 128, 256)
              for bk in (64, 128, 256) for s in (2, 3, 4)]  # fmt: skip
    return list(dict.fromkeys([default(m) for m in POINTS] + others))[:n]


def us(t: str, m: int) -> float:
    d = json.loads(t)
    return (10.0 + m) * (1 + 0.01 * d.get("num_stages", 3) + 0.001 * d.get("block_n", 64))


class Logged:
    """A stand-in GPU that appends each request to a log shared with the other stand-ins."""

    def __init__(self, log: list[tuple[str, str, int | None]], lock: threading.Lock) -> None:
        self.log, self.lock = log, lock

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult:
        with self.lock:
            self.log.append(("check", tactic, None))
        return CheckResult(passed=True, reference="stand-in")

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
        with self.lock:
            self.log.append(("screen" if screen else "time", tactic, m))
        return Timing.from_samples([us(tactic, m) * (1 + 0.001 * i) for i in range(5)])

    def close(self) -> None:
        pass


def test_a_screen_cuts_only_long_launches_far_slower_than_the_best() -> None:
    assert not Screen(cutoff_us=20.0).cuts(300.0)  # a short launch: the host's share could be it
    assert Screen(cutoff_us=1000.0).cuts(1600.0)
    assert not Screen(cutoff_us=1000.0).cuts(1400.0)  # within 1.5x: screened in full
    assert not Screen(cutoff_us=None).cuts(1e6)  # nothing to compare with yet


def test_screens_wait_for_the_last_check_and_never_choose_a_winner() -> None:
    log: list[tuple[str, str, int | None]] = []
    lock = threading.Lock()
    checkers = [Logged(log, lock) for _ in range(3)]
    cands = variants(20)
    cfg = SweepConfig(points=POINTS, anchors=POINTS, search="thorough", keep_per_anchor=2, anchor_group=4)
    res = sweep(problem(), cands, kernel_defaults(problem(), H100_INFO), [Logged(log, lock)], config=cfg,
                check_backends=checkers)  # fmt: skip
    ops = [op for op, _, _ in log]
    last_check = max(i for i, op in enumerate(ops) if op == "check")
    assert ops.count("check") == len(cands) and ops.index("screen") > last_check
    assert {(t, m) for op, t, m in log if op == "screen"} == {(t, m) for t in cands for m in POINTS}
    assert any(x.screen for x in res.measurements)
    for c in res.choices:  # every winner was timed in full at its point: a screen alone never wins
        assert c.winner is not None
        assert any(x.m == c.m and x.tactic == c.winner and not x.screen for x in res.measurements)


def test_choose_ignores_screens_and_waits_for_an_untimed_default() -> None:
    fast, default = canon({"block_n": 128}), canon({"block_n": 64})
    screen = Measurement(8, fast, OK, Timing.from_samples([1.0, 1.0, 1.0]), screen=True)
    full = Measurement(8, default, OK, Timing.from_samples([10.0] * 5), is_default=True)
    passed = {fast, default}
    assert choose(8, default, {fast: screen, default: full}, passed=passed, failed=set()).winner == default
    got = choose(8, default, {fast: Measurement(8, fast, OK, Timing.from_samples([1.0] * 5))}, passed=passed,
                 failed=set())  # fmt: skip
    assert got.winner is None and got.why == "default not timed yet"
    failed_default = choose(8, default, {fast: Measurement(8, fast, OK, Timing.from_samples([1.0] * 5))},
                            passed=passed, failed={default})  # fmt: skip
    assert failed_default.winner == fast


def test_the_thorough_budget_follows_the_work_left_to_screen() -> None:
    p = problem()
    cands = variants(10)
    cfg = SweepConfig(points=POINTS, anchors=POINTS, search="thorough")
    half = {(m, t): {"status": OK, "median_us": 1.0} for t in cands[:5] for m in POINTS}
    partly = {**half, (1, cands[5]): {"status": OK, "median_us": 1.0}}  # one anchor of six: not done
    size = p.n * p.k  # a screen's time grows with the GEMM's size
    assert work_left(p, lambda q: cands, lambda q: (partly, {}, set()), cfg) == 5 * size
    assert work_left(p, lambda q: cands, lambda q: (half, {}, set(cands[5:])), cfg) == size  # the rest blocked
    wide = dataclasses.replace(p, n=2 * p.n)
    assert work_left(wide, lambda q: cands, lambda q: (partly, {}, set()), cfg) == 10 * size


def test_the_db_prefers_a_full_timing_over_a_later_screen(tmp_path: Path) -> None:
    p = problem()
    t = variants(1)[0]
    with store.open_db(tmp_path / "t.db") as tdb:
        env = tdb.put_env(store.env_record(Environment.of(H100_INFO), package_version="x"))
        ph = tdb.put_problem(p)
        run = tdb.start_run(env, timing_method={}, search_space={}, token_points=POINTS)
        full = {"m": 8, "params_json": t, "status": OK, "median_us": 5.0, "kind": None}
        tdb.add_measurements(run, env, ph, [full])
        later = tdb.start_run(env, timing_method={}, search_space={}, token_points=POINTS)
        tdb.add_measurements(later, env, ph, [{**full, "median_us": 50.0, "kind": "screen"}])
        row = tdb.measured(env, ph)[(8, canon(json.loads(t)))]
        assert (row["median_us"], row["kind"]) == (5.0, None)
        assert tdb.problem_key(ph) == p  # the key a comparison retimes with comes back whole
        assert tdb.env_row(env)["gpu_name"] == H100_INFO.name  # what a replay builds its device from
        with pytest.raises(TacticsError, match="no environment"):
            tdb.env_row("0" * 32)


def test_retime_takes_the_picks_side_by_side() -> None:
    p = problem()
    default, pruned, thorough = variants(3)
    doc: dict[str, Any] = {
        "gemms": [
            {
                "problem_hash": p.problem_hash(),
                "points": [
                    {
                        "m": 8,
                        "default": default,
                        "default_us": 99.0,
                        "pruned": pruned,
                        "pruned_us": 1.0,
                        "thorough": thorough,
                        "thorough_us": 2.0,
                        "miss_pct": -50.0,
                        "miss_basis": "vs default",
                    },
                ],  # fmt: skip
            }
        ]
    }
    log: list[tuple[str, str, int | None]] = []
    assert retime(doc, {p.problem_hash(): p}, Logged(log, threading.Lock())) == 1
    row = doc["gemms"][0]["points"][0]
    assert (row["default_us"], row["pruned_us"], row["thorough_us"]) == pytest.approx(
        tuple(Timing.from_samples([us(t, 8) * (1 + 0.001 * i) for i in range(5)]).median_us
              for t in (default, pruned, thorough))
    )  # fmt: skip
    assert row["miss_basis"] == SIDE_BY_SIDE
    assert row["miss_pct"] == pytest.approx(100 * (row["pruned_us"] / row["thorough_us"] - 1), abs=0.01)
    assert sorted(t for _, t, _ in log) == sorted({default, pruned, thorough}) and all(op == "time" for op, _, _ in log)


class Drifting:
    """A stand-in GPU whose clock slows by 5 % a call: what a long run of large GEMMs can do."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
        self.calls.append(tactic)
        return Timing.from_samples([us(tactic, m) * 1.05 ** len(self.calls)] * 3)


def test_retime_in_rounds_rotates_the_order_and_takes_medians() -> None:
    p = problem()
    default, pruned, thorough = variants(3)
    row = {"m": 2048, "default": default, "default_us": 1.0, "pruned": pruned, "pruned_us": 1.0,
           "thorough": thorough, "thorough_us": 1.0, "miss_pct": 0.0, "miss_basis": "vs default"}  # fmt: skip
    doc: dict[str, Any] = {"gemms": [{"problem_hash": p.problem_hash(), "points": [row]}]}
    gpu = Drifting()
    assert retime(doc, {p.problem_hash(): p}, gpu, rounds=3) == 1
    # each round starts one pick later, so no pick is always timed first on a drifting clock
    assert gpu.calls == [default, pruned, thorough, pruned, thorough, default, thorough, default, pruned]
    taken = {t: [us(t, 2048) * 1.05 ** (i + 1) for i, c in enumerate(gpu.calls) if c == t] for t in (pruned, thorough)}
    misses = sorted(100 * (a / b - 1) for a, b in zip(taken[pruned], taken[thorough], strict=True))
    assert row["pruned_us"] == pytest.approx(sorted(taken[pruned])[1])
    assert row["miss_pct"] == pytest.approx(misses[1], abs=0.01)
    assert row["miss_range"] == pytest.approx([misses[0], misses[-1]], abs=0.01)
    assert misses[-1] - misses[0] > 5  # the drift shows as a spread over the rounds, not as one pick's bias
    assert doc["retime_rounds"] == 3
    doc.update(gpu="stand-in", searches={})
    doc["gemms"][0].update(problem="gemm1", pruned={"elapsed_s": 60.0, "coverage": None},
                           thorough={"elapsed_s": 600.0, "coverage": None})  # fmt: skip
    row.update(pruned_is_default=False, thorough_is_default=False)
    text = markdown(doc)
    assert f"({misses[0]:.1f} to {misses[-1]:.1f})" in text and "Over 3 rounds" in text
    with pytest.raises(ValueError, match="rounds"):
        retime(doc, {p.problem_hash(): p}, gpu, rounds=0)


def test_out_of_memory_while_timing_blocklists_nothing_and_leaves_the_run_partial() -> None:
    from prepkit.tune import CandidateError
    from prepkit.tune.records import OUT_OF_MEMORY

    class Crowded(Logged):
        def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
            if m == 64:
                raise CandidateError(OUT_OF_MEMORY, "CUDA out of memory (other workers hold it)")
            return super().time(problem, tactic, m, screen)

    log: list[tuple[str, str, int | None]] = []
    cfg = SweepConfig(points=POINTS, anchors=POINTS, search="thorough", keep_per_anchor=2)
    res = sweep(problem(), variants(6), kernel_defaults(problem(), H100_INFO), [Crowded(log, threading.Lock())],
                config=cfg)  # fmt: skip
    assert not res.complete and not res.blocked
    assert not [x for x in res.measurements if x.m == 64]  # nothing recorded for the variant


def test_workers_of_a_gpu_build_one_at_a_time_under_the_run_lock(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    import textwrap

    from prepkit.tune.gpu_bench import BUILD_LOCK_ENV

    script = tmp_path / "build.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from prepkit.tune.gpu_bench import build_lock
            with build_lock():
                start = time.monotonic()
                time.sleep(0.6)
                print(start, time.monotonic())
            """
        )
    )
    env = {**os.environ, BUILD_LOCK_ENV: str(tmp_path / "build.lock")}
    gpus = ["0", "0", "0", "1"]  # three workers on GPU 0, one on GPU 1
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env={**env, "CUDA_VISIBLE_DEVICES": g}
        )
        for g in gpus
    ]
    spans = [tuple(map(float, p.communicate()[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(spans) == 4
    on_0 = sorted(spans[:3])
    assert all(a[1] <= b[0] for a, b in zip(on_0, on_0[1:], strict=False))  # no two builds of a GPU overlap
    other = spans[3]
    assert any(a[0] < other[1] and other[0] < a[1] for a in on_0)  # another GPU's build does not wait


def test_a_bench_draws_the_same_checkpoint_weights_every_time() -> None:
    """The check worker drops the checkpoint form after building and draws it again from the seed
    for references: both draws must be the layer's weights."""
    import torch

    from prepkit.tune.gpu_bench import GpuBench

    tiny = gpt_oss_problems(
        kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3", num_experts=4, hidden=128,
        intermediate=128, top_k=2,
    )["gemm1"]  # fmt: skip
    bench = GpuBench(tiny.__dict__, seed=3)
    a, b = bench.source().as_dict(), bench.source().as_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = GpuBench(tiny.__dict__, seed=4).source().as_dict()
    assert not torch.equal(a["gate_up_proj_blocks"], other["gate_up_proj_blocks"])


def test_the_worker_command_starts_without_a_warning() -> None:
    """The command a backend starts loads the worker module once: running the module the package
    imports with ``-m`` made Python warn on every worker's stderr."""
    import os
    import subprocess

    from prepkit.tune.backend import SubprocessBackend

    argv = SubprocessBackend().argv
    cmd = [argv[0], "-W", "error::RuntimeWarning", *argv[1 : argv.index("--seed")], "--help"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr
