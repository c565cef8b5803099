"""The tuner on a real GPU: worker processes, numerics checks, CUDA-graph timing, DB, lookup.

Small problems keep this to about a minute; the full gpt-oss-120b sweep is `prepkit tune`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _problems():
    from prepkit.kernels.mx import KERNEL_VERSION
    from prepkit.tactics.keys import gpt_oss_problems

    return gpt_oss_problems(
        kernel="moe_mxfp4",
        kernel_version=str(KERNEL_VERSION),
        weight_layout="triton_moe_v3",
        num_experts=16,
        hidden=512,
        intermediate=512,
        top_k=4,
    )


@pytest.fixture(scope="module")
def worker():
    from prepkit.tune import SubprocessBackend

    b = SubprocessBackend(0)
    yield b
    b.close()


def test_worker_describes_the_gpu(worker) -> None:
    facts = worker.describe()
    major, minor = torch.cuda.get_device_capability(0)
    assert facts["environment"]["cc_major"] == major and facts["environment"]["cc_minor"] == minor
    assert facts["environment"]["triton_version"]
    assert worker.bandwidth_gbps() > 100


def test_defaults_pass_the_numerics_check_and_time_sanely(worker) -> None:
    from prepkit.kernels.device import DeviceInfo
    from prepkit.tune import kernel_defaults

    info = DeviceInfo.from_torch()
    for p in _problems().values():
        for m in (1, 64, 1024):
            t = kernel_defaults(p, info)(m)
            res = worker.check(p, t)
            assert res.passed, res
            assert res.rel_err < 1e-2 and res.nan_inf_count == 0
            timing = worker.time(p, t, m)
            assert 0.5 < timing.median_us < 50_000 and timing.p10_us <= timing.median_us <= timing.p90_us


def test_a_wrong_variant_fails_its_check(worker) -> None:
    """A tile that cannot compile is reported as a failure, never as a timing."""
    from prepkit.tactics.keys import canon
    from prepkit.tune import CandidateError

    p = _problems()["gemm1"]
    bad = canon(
        {
            "block_m": 16,
            "block_n": 64,
            "block_k": 40,
            "num_warps": 4,
            "num_stages": 2,
            "split_k": 1,
            "upcast": "bits",
        }
    )
    with pytest.raises(CandidateError):
        worker.check(p, bad)
    with pytest.raises(CandidateError):
        worker.time(p, bad, 8)
    assert worker.check(p, _default(p, 8)).passed  # the worker carries on


def _default(p, m):
    from prepkit.kernels.device import DeviceInfo
    from prepkit.tune import kernel_defaults

    return kernel_defaults(p, DeviceInfo.from_torch())(m)


def test_small_sweep_end_to_end(worker, tmp_path: Path) -> None:
    from prepkit.kernels.device import DeviceInfo
    from prepkit.tactics.keys import Environment
    from prepkit.tactics.lookup import TacticTable
    from prepkit.tactics.store import RunRecorder, env_record, open_db
    from prepkit.tune import SweepConfig, kernel_candidates, kernel_defaults, tune_layer

    info = DeviceInfo.from_torch()
    env = Environment(**worker.describe()["environment"])
    probs = list(_problems().values())
    db = tmp_path / "t.db"
    with open_db(db) as tdb:
        env_hash = tdb.put_env(env_record(env, package_version="test"))
        run = tdb.start_run(env_hash, timing_method={}, search_space={}, token_points=[1, 8, 64, 512])
        rec = RunRecorder(tdb, run, env_hash, env)
        report = tune_layer(
            probs,
            [worker],
            candidates_for=lambda p: kernel_candidates(p, info, max_count=6),
            default_for=lambda p: kernel_defaults(p, info),
            config=SweepConfig(points=(1, 8, 64, 512), anchors=(8, 512), keep_per_anchor=2, budget_s=240),
            previous=rec.previous,
            on_batch=rec.batch,
            on_result=rec.result,
        )
        tdb.finish_run(run, "complete")
        counts = tdb.counts()
    assert all(r.complete for r in report.results)
    assert counts["correctness"] >= 6 and counts["measurement"] > 0 and counts["winner"] >= 2
    assert all(lp.default_us and lp.tuned_us for lp in report.layer_points)
    for p in probs:
        table = TacticTable.load(p, env, user_db=db, bundled_db=False)
        assert table.tier == "exact"
        for m in (1, 5, 300):
            assert json.loads(table.tactic_for(m))


def test_thorough_sweep_checks_once_at_one_shape_and_times_every_variant(worker, tmp_path: Path) -> None:
    """A thorough sweep of a slice of the space: check workers check at 33 tokens only, every
    variant that passes is timed at every anchor, and the winners record the search."""
    from prepkit.kernels.device import DeviceInfo
    from prepkit.tactics.keys import Environment
    from prepkit.tactics.store import RunRecorder, env_record, open_db
    from prepkit.tune import SubprocessBackend, SweepConfig, kernel_defaults, tune_layer
    from prepkit.tune.candidates import kernel_space
    from prepkit.tune.gpu_bench import SINGLE_CHECK_M

    info = DeviceInfo.from_torch()
    env = Environment(**worker.describe()["environment"])
    probs = list(_problems().values())
    points = (1, 8, 64)

    def candidates(p):
        return list(dict.fromkeys([*kernel_space(p, info)[::997], *(kernel_defaults(p, info)(m) for m in points)]))

    checkers = [SubprocessBackend(0, check_m=SINGLE_CHECK_M) for _ in range(2)]
    db = tmp_path / "t.db"
    try:
        with open_db(db) as tdb:
            env_hash = tdb.put_env(env_record(env, package_version="test"))
            run = tdb.start_run(env_hash, timing_method={}, search_space={"search": "thorough"}, token_points=points)
            rec = RunRecorder(tdb, run, env_hash, env, search="thorough")
            report = tune_layer(
                probs, [worker], candidates_for=candidates, default_for=lambda p: kernel_defaults(p, info),
                config=SweepConfig(points=points, anchors=points, keep_per_anchor=2, budget_s=480, search="thorough"),
                previous=rec.previous, on_batch=rec.batch, on_result=rec.result, check_backends=checkers,
            )  # fmt: skip
            tdb.finish_run(run, "complete")
            shapes = {r[0] for r in tdb.conn.execute("SELECT m_values FROM correctness")}
            searches = {r[0] for r in tdb.conn.execute("SELECT search FROM winner")}
    finally:
        for b in checkers:
            b.close()
    assert all(r.complete for r in report.results)
    assert shapes == {json.dumps(list(SINGLE_CHECK_M))} and searches == {"thorough"}
    for r, p in zip(report.results, probs, strict=True):
        cov = r.coverage
        assert cov is not None and cov.candidates == len(candidates(p)) and cov.checked == cov.candidates
        assert cov.candidates - cov.failed <= cov.measured <= cov.candidates
        ok = {(x.m, x.tactic) for x in r.measurements if x.status == "ok"}
        timing_failed = {x.tactic for x in r.measurements if x.status != "ok"}
        for t in {c.tactic for c in r.correctness if c.result.passed} - timing_failed:
            assert all((m, t) in ok for m in points)  # every variant that passed, at every anchor
