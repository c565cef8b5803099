"""Close calls timed again in rotated rounds: the pieces, and a sweep on a backend whose clock drifts."""

from __future__ import annotations

import pytest

from prepkit.tactics.keys import canon, gpt_oss_problems
from prepkit.tactics.store import RunRecorder, env_record, open_db
from prepkit.tune import FunctionBackend, SweepConfig, Timing, sweep
from prepkit.tune.retime import close_calls, over_rounds, retime, rotated
from prepkit.tune.sweep_config import RETIME, RetimeConfig
from tests.tactics.test_db import H100

PROB = gpt_oss_problems(kernel="moe_mxfp4", kernel_version="1", weight_layout="triton_moe_v3")["gemm2"]


def tac(bm: int) -> str:
    return canon({"block_m": bm, "block_n": 64, "num_stages": 3, "split_k": 1})


DEFAULT, A, B, C = tac(16), tac(32), tac(64), tac(128)
# B is truly the fastest, by 2 %; the default is far behind.
TRUE_US = {DEFAULT: 150.0, A: 100.0, B: 98.0}


class DriftingClock:
    """A stand-in GPU whose timings grow 3 % with every call (a clock throttling as it heats):
    what is timed later looks slower than it is."""

    def __init__(self, drift: float = 0.03) -> None:
        self.drift = drift
        self.calls = 0

    def __call__(self, tactic: str, m: int) -> list[float]:
        us = TRUE_US[tactic] * (1.0 + self.drift) ** self.calls
        self.calls += 1
        return [us * (1 + 0.001 * (i - 2)) for i in range(5)]


def test_close_calls_are_those_within_the_margin_best_first() -> None:
    medians = {"a": 100.0, "b": 103.9, "c": 104.0, "d": 99.0}  # the bound: 99 * 1.05 = 103.95
    assert close_calls(medians, 0.05) == ["d", "a", "b"]
    assert close_calls({}, 0.05) == []
    assert close_calls({"x": 5.0, "y": 5.0}, 0.0) == ["x", "y"]


def test_rotation_starts_each_round_one_later() -> None:
    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_over_rounds_takes_the_median_of_the_rounds_medians() -> None:
    rounds = [Timing.from_samples([10.0, 11.0, 12.0]), Timing.from_samples([30.0]), Timing.from_samples([20.0])]
    t = over_rounds(rounds)
    assert t.median_us == 20.0 and t.n_samples == 5
    with pytest.raises(ValueError):
        over_rounds([])


def test_retime_rotates_the_order_and_times_each_once_a_round() -> None:
    order: list[str] = []

    def one(t: str) -> Timing:
        order.append(t)
        return Timing.from_samples([{"a": 1.0, "b": 2.0}[t]])

    got = retime(["a", "b"], one, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert {t: x.median_us for t, x in got.items()} == {"a": 1.0, "b": 2.0}
    with pytest.raises(ValueError):
        retime(["a"], one, 0)


def test_config_is_validated_and_one_round_disables_it() -> None:
    assert RETIME.margin == 0.05 and RETIME.enabled
    assert not RetimeConfig(rounds=1).enabled
    for bad in ({"margin": -0.1}, {"rounds": 0}):
        with pytest.raises(ValueError):
            RetimeConfig(**bad)  # type: ignore[arg-type]


def _run(retime_cfg: RetimeConfig, clock: DriftingClock):
    backend = FunctionBackend(clock)
    cfg = SweepConfig(points=(1,), keep_per_anchor=6, retime=retime_cfg)
    return sweep(PROB, [A, B], lambda m: DEFAULT, [backend], config=cfg), backend


def test_one_shot_timing_picks_the_wrong_variant_and_rounds_fix_it() -> None:
    """Timed once in the order default, A, B, the drift makes B look 1 % slower than A although it
    is 2 % faster; timed again in rotated rounds, B wins, and the choice says it was retimed."""
    one_shot, _ = _run(RetimeConfig(rounds=1), DriftingClock())
    assert one_shot.choices[0].winner == A and one_shot.choices[0].retimed == 0

    result, backend = _run(RETIME, DriftingClock())
    choice = result.choices[0]
    assert choice.winner == B and choice.retimed == RETIME.rounds
    timed_again = [(t, m) for kind, t, m in backend.calls if kind == "time"][3:]
    assert timed_again == [(A, 1), (B, 1), (B, 1), (A, 1), (A, 1), (B, 1)]  # the default is out of reach
    assert result.record()["points"][0]["retimed"] == RETIME.rounds
    assert result.winners[0].tactic == B


def test_retimed_timings_are_stored_and_a_rerun_retimes_nothing(tmp_path) -> None:
    """The rounds' timings replace the one-shot rows in the DB; a rerun that reads them back times
    nothing again and keeps the choice, and one with a new close call times only that."""
    path = tmp_path / "t.db"
    with open_db(path) as tdb:
        env_hash = tdb.put_env(env_record(H100, package_version="0.1.0"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=(1,))
        rec = RunRecorder(tdb, run, env_hash, H100)
        backend = FunctionBackend(DriftingClock())
        cfg = SweepConfig(points=(1,), keep_per_anchor=6)
        first = sweep(PROB, [A, B], lambda m: DEFAULT, [backend], config=cfg, on_batch=lambda b: rec.batch(PROB, b))
        measured, checks, blocked = rec.previous(PROB)
        assert measured[(1, B)]["median_us"] == pytest.approx(first.choices[0].winner_us)
        again = FunctionBackend(DriftingClock())
        second = sweep(
            PROB, [A, B], lambda m: DEFAULT, [again], config=cfg, previous_measurements=measured,
            previous_checks=checks, blocked=blocked,
        )  # fmt: skip
    assert [c for c in again.calls if c[0] == "time"] == []
    assert second.choices[0].winner == B

    # A new variant close to the stored ones is timed once: the stored pairs are not timed again.
    TRUE_US[C] = 97.0
    try:
        third_backend = FunctionBackend(DriftingClock())
        third = sweep(
            PROB, [A, B, C], lambda m: DEFAULT, [third_backend], config=cfg, previous_measurements=measured,
            previous_checks=checks, blocked=blocked,
        )  # fmt: skip
    finally:
        del TRUE_US[C]
    assert [(t, m) for kind, t, m in third_backend.calls if kind == "time"] == [(C, 1)]
    assert third.choices[0].retimed == 0 and third.n_retimed == 0
