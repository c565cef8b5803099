"""The sweep logic, driven by stand-in timers and checkers on the CPU."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from prepkit.errors import DeviceError
from prepkit.tactics.keys import canon, gpt_oss_problems
from prepkit.tactics.lookup import TOKEN_POINTS, TacticTable
from prepkit.tactics.store import RunRecorder, env_record, open_db
from prepkit.tune import (
    CandidateError,
    CheckResult,
    FunctionBackend,
    PointChoice,
    SubprocessBackend,
    SweepConfig,
    Timing,
    choose,
    parse_tokens,
    prune_candidates,
    ranges_from_choices,
    sweep,
)
from prepkit.tune.sweep_config import RetimeConfig
from tests.tactics.test_db import H100

PROB = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3")["gemm2"]
POINTS = (1, 2, 8, 64, 512, 8192)


def tac(bm: int, bn: int = 64, sk: int = 1) -> str:
    return canon({"block_m": bm, "block_n": bn, "num_stages": 3, "split_k": sk})


DEFAULT = tac(16)


def default_for(m: int) -> str:
    return DEFAULT


def samples(us: float, spread: float = 0.002) -> list[float]:
    return [us * (1 + spread * (i - 5) / 5) for i in range(11)]


def stand_in(table: dict[str, float], *, per_m: float = 0.0, spread: float = 0.002):
    """Timer: a fixed latency per tactic (plus a term growing with M)."""

    def timer(t: str, m: int) -> list[float]:
        return samples(table.get(t, 20.0) + per_m * m, spread)

    return timer


# ------------------------------------------------------------------------------ small pieces


def test_parse_tokens() -> None:
    assert parse_tokens(None) == TOKEN_POINTS
    assert parse_tokens("1-3, 16,8,8") == (1, 2, 3, 8, 16)
    assert parse_tokens("all", max_tokens=8) == tuple(range(1, 9))
    for bad in ("0", "x", "5-2", "-3"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_timing_quantiles() -> None:
    t = Timing.from_samples([5.0, 1.0, 2.0, 3.0, 4.0])
    assert (t.median_us, t.p10_us, t.p90_us, t.n_samples) == (3.0, 1.4, 4.6, 5)
    with pytest.raises(ValueError):
        Timing.from_samples([])


def test_choose_keeps_default_unless_beaten_beyond_noise() -> None:
    from prepkit.tune import Measurement

    def meas(t: str, us: float, spread: float) -> Measurement:
        return Measurement(8, t, "ok", Timing.from_samples(samples(us, spread)))

    def pick(challenger_us: float, spread: float = 0.002) -> str | None:
        timed = {DEFAULT: meas(DEFAULT, 10.0, spread), tac(32): meas(tac(32), challenger_us, spread)}
        return choose(8, DEFAULT, timed, passed={DEFAULT, tac(32)}, failed=set()).winner

    assert pick(9.8) == DEFAULT  # 2 % faster: within the 3 % margin
    assert pick(9.0) == tac(32)  # 10 % faster, tight distributions
    assert pick(9.0, spread=0.2) == DEFAULT  # 10 % faster but the distributions overlap
    assert pick(11.0) == DEFAULT


def test_ranges_leave_holes_to_the_default() -> None:
    a, b = tac(16), tac(32)
    ch = [
        PointChoice(1, a, a, 1.0, 1.0),
        PointChoice(2, a, a, 1.0, 1.0),
        PointChoice(8, None, a, None, None),
        PointChoice(64, b, a, 1.0, 2.0),
        PointChoice(512, b, a, 1.0, 2.0),
    ]
    r = ranges_from_choices((1, 2, 8, 64, 512), ch, extends_up=True)
    assert [(x.m_lo, x.m_hi, x.tactic) for x in r] == [(1, 2, a), (9, 512, b)]
    assert r[-1].extends_up and not r[0].extends_up
    assert r[1].speedup_vs_default == pytest.approx(2.0)
    r = ranges_from_choices((1, 2, 8, 64, 512), ch, extends_up=True, extends_up_ok=lambda t: t != b)
    assert not r[-1].extends_up


def test_prune_candidates() -> None:
    space = [
        canon({"block_m": bm, "num_stages": s, "split_k": sk, "upcast": u, "block_n": bn})
        for bm in (16, 32, 64, 128)
        for s in (1, 2, 3)
        for sk in (1, 2)
        for u in ("bits", "dot_scaled")
        for bn in (32, 64, 128, 256)
    ]
    g1 = prune_candidates(space, "gemm1")
    assert all(json.loads(t)["num_stages"] >= 2 and json.loads(t)["split_k"] == 1 for t in g1)
    g2 = prune_candidates(space, "gemm2")
    assert all(json.loads(t)["block_m"] <= 32 for t in g2 if json.loads(t)["split_k"] > 1)
    few = prune_candidates(space, "gemm2", max_count=16)
    assert len(few) == 16
    assert {(json.loads(t)["block_m"], json.loads(t)["upcast"]) for t in few} == {
        (bm, u) for bm in (16, 32, 64, 128) for u in ("bits", "dot_scaled")
    }


def test_prune_keeps_the_defaults_and_their_one_knob_neighbours() -> None:
    space = [
        canon({"block_m": bm, "block_n": bn, "num_stages": s, "split_k": 1, "upcast": "asm", "weight_load": wl})
        for bm in (16, 32, 64, 128)
        for bn in (32, 64, 128, 256)
        for s in (2, 3, 4)
        for wl in ("ptr", "tma")
    ]
    seed = canon({"block_m": 64, "block_n": 256, "num_stages": 3, "split_k": 1, "upcast": "asm", "weight_load": "ptr"})
    tma_twin = canon({**json.loads(seed), "weight_load": "tma"})
    plain = prune_candidates(space, "gemm1", max_count=24)
    assert tma_twin not in plain  # the even spread alone misses it
    kept = prune_candidates(space, "gemm1", max_count=24, seeds=[seed])
    assert len(kept) == 24 and kept[0] == seed and tma_twin in kept
    sd = json.loads(seed)
    neighbours = [t for t in space if sum(v != sd[k] for k, v in json.loads(t).items()) == 1]
    assert len(neighbours) == 3 + 3 + 2 + 1  # block_m, block_n, stages, weight_load
    assert set(neighbours) <= set(kept)
    # every (block_m, upcast, weight_load) group is still represented
    assert {(json.loads(t)["block_m"], json.loads(t)["weight_load"]) for t in kept} == {
        (bm, wl) for bm in (16, 32, 64, 128) for wl in ("ptr", "tma")
    }


def test_candidates_measure_past_winners_the_space_still_holds() -> None:
    from prepkit.kernels.device import H100 as H100_INFO
    from prepkit.tune import kernel_candidates

    g1 = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="9", weight_layout="triton_moe_v3")["gemm1"]
    plain = kernel_candidates(g1, H100_INFO, max_count=24)
    every = kernel_candidates(g1, H100_INFO)
    missed = [t for t in every if t not in plain]
    assert missed  # the budget leaves tiles out
    past, stale = missed[len(missed) // 2], canon({"block_m": 16, "block_n": 48, "num_stages": 3})
    seeded = kernel_candidates(g1, H100_INFO, max_count=24, past_winners=[stale, past, plain[3]])
    # A MoE GEMM's past winners follow the pruned set as they are (the refinement searches around
    # the best): the set itself does not move, so a rerun measures nothing new.
    assert seeded == [*plain, past] and stale not in seeded


def test_prune_drops_bits_where_asm_has_the_same_tile() -> None:
    def t(bn: int, upcast: str) -> str:
        return canon({"block_m": 16, "block_n": bn, "num_stages": 3, "split_k": 1, "upcast": upcast})

    kept = prune_candidates([t(64, "bits"), t(64, "asm"), t(128, "bits"), t(128, "dot_scaled")], "gemm1")
    assert kept == [t(64, "asm"), t(128, "bits"), t(128, "dot_scaled")]


# ------------------------------------------------------------------------------- the sweep


def test_sweep_picks_faster_tactics_and_merges_ranges() -> None:
    fast_small, fast_big = tac(16, 128), tac(128, 128)

    def timer(t: str, m: int) -> list[float]:
        d = json.loads(t)
        us = 10.0 + (0 if (d["block_m"] <= 16) == (m <= 64) else 5) + (0 if d["block_n"] == 128 else 2)
        return samples(us)

    cands = [tac(bm, bn) for bm in (16, 32, 64, 128) for bn in (64, 128)]
    res = sweep(PROB, cands, default_for, [FunctionBackend(timer)], config=SweepConfig(points=POINTS))
    assert res.complete and not res.blocked
    assert [(w.m_lo, w.m_hi, w.tactic, w.extends_up) for w in res.winners] == [
        (1, 64, fast_small, False),
        (65, 8192, fast_big, True),
    ]
    assert res.geomean_speedup() > 1.1


def test_failures_go_to_the_blocklist_never_to_winners() -> None:
    wrong, crashy, good = tac(32), tac(64), tac(128)

    def checker(t: str) -> CheckResult:
        if t == wrong:
            return CheckResult(passed=False, rel_err=0.5, tolerance=0.02, reference="fp32")
        return CheckResult(passed=True)

    def timer(t: str, m: int) -> list[float]:
        if t == crashy and m >= 512:
            raise CandidateError("sticky_cuda_error", "illegal address")
        return samples({wrong: 1.0, crashy: 2.0, good: 8.0}.get(t, 10.0))

    batches = []
    res = sweep(
        PROB,
        [wrong, crashy, good],
        default_for,
        [FunctionBackend(timer, checker)],
        config=SweepConfig(points=POINTS),
        on_batch=batches.append,
    )
    blocked = dict(res.blocked)
    assert set(blocked) == {wrong, crashy}
    assert "numerics_fail" in blocked[wrong] and "rel_err=0.5" in blocked[wrong]
    assert "sticky_cuda_error at M=512" in blocked[crashy]
    assert {w.tactic for w in res.winners} == {good}  # even at M where crashy was timed fine
    timed = {(m, t) for b in batches for x in b.measurements for (m, t) in [(x.m, x.tactic)]}
    assert not any(t == wrong for _, t in timed)  # a numerics failure is never timed
    assert sum(len(b.blocked) for b in batches) == 2


def test_a_check_out_of_gpu_memory_blocks_nothing_and_leaves_the_run_partial() -> None:
    # Other check workers held the memory: the variant is fine, so it must be checked again later.
    starved, good = tac(32), tac(128)

    def checker(t: str) -> CheckResult:
        if t == starved:
            raise CandidateError("out_of_memory", "CUDA out of memory. Tried to allocate 1.98 GiB")
        return CheckResult(passed=True)

    batches, progress = [], []
    res = sweep(
        PROB,
        [starved, good],
        default_for,
        [FunctionBackend(lambda t, m: samples({good: 8.0}.get(t, 10.0)), checker)],
        config=SweepConfig(points=POINTS),
        on_batch=batches.append,
        on_progress=lambda label, done, total: progress.append((label, done)),
    )
    assert not res.blocked and not res.complete
    # Progress counts the checks that ran: the starved one is not among them.
    checks_run = {t for b in batches for t in (c.tactic for c in b.correctness)}
    timings = sum(len(b.measurements) for b in batches)
    assert progress[-1][1] == len(checks_run) + timings, progress
    assert not any(c.tactic == starved for b in batches for c in b.correctness)
    assert not any(x.tactic == starved for b in batches for x in b.measurements)


def test_default_failing_its_check_is_replaced() -> None:
    res = sweep(
        PROB,
        [tac(32)],
        default_for,
        [FunctionBackend(stand_in({}), lambda t: t != DEFAULT)],
        config=SweepConfig(points=(1, 2)),
    )
    assert [w.tactic for w in res.winners] == [tac(32)]
    assert res.choices[0].why == "default unavailable"


def test_anchors_prune_then_every_point_times_survivors_and_default() -> None:
    cands = [tac(bm, bn, sk) for bm in (16, 32, 64) for bn in (32, 64, 128) for sk in (1, 2)]
    speeds = {t: 10.0 + i for i, t in enumerate(cands)}
    backend = FunctionBackend(stand_in(speeds))
    cfg = SweepConfig(points=POINTS, anchors=(1, 512), keep_per_anchor=3)
    res = sweep(PROB, cands, default_for, [backend], config=cfg)
    times = [(m, t) for op, t, m in backend.calls if op == "time"]
    assert {t for m, t in times if m == 8} == set(cands[:3]) | {DEFAULT}
    assert len({t for m, t in times if m == 1}) == len(cands)
    assert len(times) == len(set(times))  # nothing timed twice
    assert res.complete


def test_resume_skips_what_was_measured(tmp_path: Path) -> None:
    cands = [tac(32), tac(64)]
    path = tmp_path / "r.db"

    def run(backend: FunctionBackend):
        with open_db(path) as tdb:
            env_hash = tdb.put_env(env_record(H100, package_version="0"))
            run_id = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=POINTS)
            rec = RunRecorder(tdb, run_id, env_hash, H100)
            prev_m, prev_c, blocked = rec.previous(PROB)
            res = sweep(
                PROB,
                cands,
                default_for,
                [backend],
                config=SweepConfig(points=POINTS),
                previous_measurements=prev_m,
                previous_checks=prev_c,
                blocked=blocked,
                on_batch=lambda b: rec.batch(PROB, b),
            )
            rec.result(res)
            tdb.finish_run(run_id, "complete")
        return res

    first = run(FunctionBackend(stand_in({tac(64): 5.0}), lambda t: t != tac(32)))
    second_backend = FunctionBackend(stand_in({tac(64): 5.0}), lambda t: t != tac(32))
    second = run(second_backend)
    assert second_backend.calls == []  # every check and timing came from the DB
    assert second.n_timed == 0 and second.n_reused == first.n_timed
    assert [(w.m_lo, w.m_hi, w.tactic) for w in second.winners] == [(w.m_lo, w.m_hi, w.tactic) for w in first.winners]
    table = TacticTable.load(PROB, H100, user_db=path, bundled_db=False)
    assert table.tactic_for(3) == tac(64)


def test_partial_resume_measures_only_the_rest(tmp_path: Path) -> None:
    ticks = iter(range(10_000))
    cfg = SweepConfig(points=POINTS, budget_s=8)
    backend = FunctionBackend(stand_in({tac(64): 5.0}))
    res = sweep(PROB, [tac(64)], default_for, [backend], config=cfg, clock=lambda: next(ticks))
    assert not res.complete
    assert not any(w.extends_up for w in res.winners)  # an unfinished sweep never extends upward
    done = {(x.m, x.tactic): x.row() for x in res.measurements}
    rest = FunctionBackend(stand_in({tac(64): 5.0}))
    res2 = sweep(
        PROB,
        [tac(64)],
        default_for,
        [rest],
        config=SweepConfig(points=POINTS),
        previous_measurements=done,
        previous_checks={c.tactic: c.row() for c in res.correctness},
    )
    assert res2.complete and res2.winners[-1].extends_up
    assert not {(m, t) for op, t, m in rest.calls if op == "time"} & set(done)
    assert len(res2.measurements) == 2 * len(POINTS)


def test_several_backends_time_whole_points_each() -> None:
    b1, b2 = FunctionBackend(stand_in({})), FunctionBackend(stand_in({}))
    cands = [tac(32), tac(64)]
    # Retime off: its close calls are one job on whichever backend is free, not a point's own.
    config = SweepConfig(points=TOKEN_POINTS, retime=RetimeConfig(rounds=1))
    res = sweep(PROB, cands, default_for, [b1, b2], config=config)
    assert res.complete and len(res.measurements) == 3 * len(TOKEN_POINTS)
    per_backend = [{m for op, _, m in b.calls if op == "time"} for b in (b1, b2)]
    assert per_backend[0] and per_backend[1] and not per_backend[0] & per_backend[1]


# ------------------------------------------------------------------------- worker process


FAKE_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        t = json.loads(req.get("tactic") or "{}")
        if t.get("block_m") == 64:
            os._exit(9)  # a hard crash mid-request
        if t.get("block_m") == 128:
            time.sleep(30)  # a hang
        if t.get("block_m") == 32:
            out = {"ok": False, "status": "sticky_cuda_error", "fatal": True, "error": "illegal address"}
        else:
            out = {"ok": True, "result": {"samples_us": [float(os.getpid() % 7 + 1)] * 5}}
        print(json.dumps(out), flush=True)
    """
)


def test_subprocess_backend_survives_crash_hang_and_sticky_error(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    b = SubprocessBackend(argv=[sys.executable, str(script)], time_timeout_s=2.0)
    try:
        assert b.time(PROB, tac(16), 1).n_samples == 5
        pid = b.proc.pid
        for bm, status in ((64, "crash"), (128, "timeout"), (32, "sticky_cuda_error")):
            with pytest.raises(CandidateError) as info:
                b.time(PROB, tac(bm), 1)
            assert info.value.status == status
            assert b.time(PROB, tac(16), 1).median_us > 0  # a fresh worker answers again
        assert b.proc.pid != pid and b.restarts == 3
    finally:
        b.close()
    assert b.proc is None


@pytest.mark.slow
def test_real_worker_without_gpu_is_a_device_error() -> None:
    b = SubprocessBackend(env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        with pytest.raises(DeviceError, match="could not start"):
            b.describe()
    finally:
        b.close()
