"""A launch that does not fit its prepared set ends on every rank, within a minute, with exit
code 3 and the problem named; the rules behind the checks, one by one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from prepkit.distributed.preflight import RankReport, find_problems
from tests.distributed.conftest import START_FAILS_WITHIN_S, prepkit, run_launch
from tests.distributed.test_rank_forward import SPAWN, worker


def assert_every_rank_fails(stderr: str, ranks: int, *needles: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == ranks, stderr[-3000:]
    for line in errors:
        for needle in needles:
            assert needle in line, line


def test_a_world_of_another_size_fails_every_rank(tp1: Path) -> None:
    launch = run_launch(prepkit("generate", str(tp1), "--device", "cpu", "--nproc", "2", "-p", "hi", "-n", "2"))
    assert launch.returncode == 3, launch.stderr[-3000:]
    assert launch.wall_s < START_FAILS_WITHIN_S
    assert_every_rank_fails(launch.stderr, 2, "tp=1 x ep=1 = 1 ranks, the launch has 2")
    assert launch.stdout == ""


def test_a_rank_without_its_shards_fails_every_rank(tp2: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(tp2, tmp_path / "tp2"))
    (broken / "rank1" / "experts-00001.safetensors").unlink()
    launch = run_launch(prepkit("bench", str(broken), "--device", "cpu", "--nproc", "2", "--pp", "", "--tg", "2"))
    assert launch.returncode == 3, launch.stderr[-3000:]
    assert launch.wall_s < START_FAILS_WITHIN_S
    assert_every_rank_fails(launch.stderr, 2, f"rank 1: {broken / 'rank1' / 'experts-00001.safetensors'} is missing")


def test_ranks_on_different_prepared_sets_fail_every_rank(tp2: Path, tmp_path: Path) -> None:
    other = Path(shutil.copytree(tp2, tmp_path / "other"))
    manifest = other / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")  # the same set in all but its manifest's bytes
    out = tmp_path / "out"
    out.mkdir()
    launch = run_launch([sys.executable, "-c", SPAWN, *worker(f"{tp2},{other}", out)])
    assert launch.returncode == 3, launch.stderr[-3000:]
    assert launch.wall_s < START_FAILS_WITHIN_S
    assert_every_rank_fails(launch.stderr, 2, "the ranks opened different prepared sets")
    assert not list(out.iterdir())  # nothing loaded, nothing saved


def report(rank: int, *, host: str = "h", device_id: str | None = None, fingerprint: str = "f") -> RankReport:
    return RankReport(rank, host, f"cuda:{rank}", device_id, fingerprint, None)


def test_two_ranks_on_one_gpu_are_named() -> None:
    shared = [report(0, device_id="GPU-a"), report(1, device_id="GPU-a"), report(2, device_id="GPU-b")]
    assert find_problems(shared, 3) == ["one GPU on h is used by rank 0 (cuda:0), rank 1 (cuda:1)"]
    # the same uuid on two hosts is two GPUs; on the CPU ranks share the device freely
    assert find_problems([report(0, host="a", device_id="GPU-a"), report(1, host="b", device_id="GPU-a")], 2) == []
    assert find_problems([report(0), report(1)], 2) == []


def test_problems_name_their_ranks_once() -> None:
    bad = RankReport(1, "h", "cpu", None, "f", "x is missing")
    assert find_problems([report(0), bad], 2) == ["rank 1: x is missing"]
    both = [RankReport(r, "h", "cpu", None, "f", "too few ranks") for r in (0, 1)]
    assert find_problems(both, 2) == ["every rank: too few ranks"]
    differ = find_problems([report(0, fingerprint="a" * 64), report(1, fingerprint="b" * 64)], 2)
    assert differ == [
        f"the ranks opened different prepared sets (manifest sha256: rank 0 {'a' * 12}, rank 1 {'b' * 12})"
    ]
