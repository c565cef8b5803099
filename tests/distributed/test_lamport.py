"""The one-kernel all-reduce (prepkit.distributed.lamport) between processes that share their
buffers: on the CPU, Triton's interpreter in each process and buffers in shared memory stand in
for GPUs that map each other's memory. Every call's sum is checked, all ranks must get the same
bits, and the ranks run out of step (one sleeps), so that a rank reads its rows before the others
have written them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from prepkit.distributed.collectives import ALL_REDUCE_ENV, ALL_REDUCE_KINDS, Collectives, all_reduce_kind
from prepkit.distributed.lamport import LamportAllReduce, empty_buffer
from prepkit.errors import LaunchError
from tests.distributed.conftest import REPO, two_gpus

MAX_NUMEL = 3000
# Row lengths of successive calls: more calls than slots, tails of the kernel's block, one
# decode row of gpt-oss (2,880 values).
LENGTHS = (2880, 7, 1024, 2880, 1500, 2880, 5)


def _inputs(rank: int, call: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * call + rank)
    x = torch.randn(n, generator=g) * (rank + 1)
    x[:: max(n // 3, 1)] = -0.0  # the empty mark's bits as a real input
    return x


def _rank(rank: int, buffers: list[torch.Tensor], counters: torch.Tensor, results: torch.Tensor, delays: tuple) -> None:
    ar = LamportAllReduce(rank, buffers, MAX_NUMEL, counters[rank, 0:1], counters[rank, 1:2])
    for call, n in enumerate(LENGTHS):
        time.sleep(delays[rank][call])
        results[rank, call, :n] = ar(_inputs(rank, call, n))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_the_same_sum_call_after_call(world: int) -> None:
    buffers = [empty_buffer(world, MAX_NUMEL).share_memory_() for _ in range(world)]
    counters = torch.zeros((world, 2), dtype=torch.int32).share_memory_()
    results = torch.full((world, len(LENGTHS), MAX_NUMEL), float("nan")).share_memory_()
    # Rank 0 falls behind on some calls, the last rank on others.
    delays = tuple(
        tuple(0.3 if (call + r) % 3 == 0 and r in (0, world - 1) else 0.0 for call in range(len(LENGTHS)))
        for r in range(world)
    )
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, buffers, counters, results, delays)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:  # a rank that waits for ever on a value: stop it, then fail
        p.kill()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for call, n in enumerate(LENGTHS):
        want = torch.zeros(n)
        for r in range(world):
            want += _inputs(r, call, n)
        for r in range(world):
            assert torch.equal(results[r, call, :n], results[0, call, :n]), (call, r)  # the same bits
        assert torch.allclose(results[0, call, :n], want, atol=1e-5, rtol=1e-5), call
    # Each call advanced the epoch once and left its arrival counter at zero.
    assert counters[:, 0].tolist() == [len(LENGTHS)] * world and counters[:, 1].tolist() == [0] * world
    # Every value a rank wrote was emptied by the rank that read it: the buffers are as they began.
    marks = empty_buffer(world, MAX_NUMEL).view(torch.int32)
    assert all(torch.equal(b.view(torch.int32), marks) for b in buffers)


def test_a_buffer_too_small_or_a_bad_rank_is_refused() -> None:
    good = [empty_buffer(2, 16), empty_buffer(2, 16)]
    with pytest.raises(ValueError, match="buffer of rank 1 holds 32"):
        LamportAllReduce(0, [good[0], empty_buffer(1, 16)], 16)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        LamportAllReduce(2, good, 16)
    ar = LamportAllReduce(0, good, 16)
    with pytest.raises(ValueError, match="17 values"):
        ar(torch.zeros(17))


def test_the_sum_kind_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALL_REDUCE_ENV, raising=False)
    assert all_reduce_kind() is None  # unset: the first the GPUs can run
    assert ALL_REDUCE_KINDS[0] == "lamport"
    for kind in ALL_REDUCE_KINDS:
        monkeypatch.setenv(ALL_REDUCE_ENV, kind)
        assert all_reduce_kind() == kind
    monkeypatch.setenv(ALL_REDUCE_ENV, "ring")
    with pytest.raises(LaunchError, match="PREPKIT_ALL_REDUCE='ring': expected one of lamport, symmetric, nccl"):
        all_reduce_kind()


class _FakeSum:
    """Stands in for a mapped sum: records what it was handed."""

    def __init__(self) -> None:
        self.calls: list[torch.dtype] = []

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.dtype)
        return x * 2


def _collectives(
    monkeypatch: pytest.MonkeyPatch, *, lamport: bool, symmetric: bool, kind: str | None = None
) -> tuple[Collectives, list[str]]:
    """Collectives of rank 0 of 2 on a CUDA device, with each sum's mapping granted or refused."""
    import torch.distributed as dist

    import prepkit.distributed.collectives as collectives
    import prepkit.distributed.lamport as lamport_module

    tried: list[str] = []

    def map_lamport(group: object, device: torch.device) -> _FakeSum:
        tried.append("lamport")
        if not lamport:
            raise RuntimeError("peer access is not supported between these devices")
        return _FakeSum()

    def map_symmetric(group: object, device: torch.device, dtype: torch.dtype) -> _FakeSum | None:
        tried.append("symmetric")
        return _FakeSum() if symmetric else None

    monkeypatch.delenv(ALL_REDUCE_ENV, raising=False)
    monkeypatch.setattr(lamport_module, "rendezvous_lamport", map_lamport)
    monkeypatch.setattr(collectives, "try_symmetric", map_symmetric)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    return collectives.Collectives(torch.device("cuda", 0), group=object(), kind=kind), tried


@pytest.mark.parametrize(
    ("lamport", "symmetric", "transport", "tried"),
    [
        (True, True, "lamport", ["lamport"]),
        (False, True, "symmetric", ["lamport", "symmetric"]),
        (False, False, "nccl", ["lamport", "symmetric"]),
    ],
)
def test_unset_the_first_sum_the_gpus_can_map_is_taken_without_error(
    monkeypatch: pytest.MonkeyPatch, lamport: bool, symmetric: bool, transport: str, tried: list[str]
) -> None:
    comm, attempts = _collectives(monkeypatch, lamport=lamport, symmetric=symmetric)
    assert comm.transport == transport and attempts == tried
    # Only the one-kernel sum takes the MoE's fp32 output as it is.
    assert comm.sums_fp32 is (transport == "lamport")


@pytest.mark.parametrize("kind", ["lamport", "symmetric"])
def test_a_named_sum_the_gpus_cannot_map_ends_in_one_clear_error(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    with pytest.raises(LaunchError, match=f"PREPKIT_ALL_REDUCE={kind}: the GPUs cannot map each other's memory") as err:
        _collectives(monkeypatch, lamport=False, symmetric=False, kind=kind)
    assert err.value.hint is not None and "unset PREPKIT_ALL_REDUCE" in err.value.hint


def test_the_one_kernel_sum_serves_captured_calls_and_nccl_the_eager_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    comm, _ = _collectives(monkeypatch, lamport=True, symmetric=True)
    lamport = comm._lamport
    assert isinstance(lamport, _FakeSum)
    eager: list[torch.dtype] = []

    def nccl(t: torch.Tensor, group: object = None) -> None:
        eager.append(t.dtype)
        t.mul_(3)

    monkeypatch.setattr(dist, "all_reduce", nccl)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert comm.all_reduce(torch.ones(4)).tolist() == [3.0] * 4
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert comm.all_reduce(torch.ones(4)).tolist() == [2.0] * 4
    assert eager == [torch.float32] and lamport.calls == [torch.float32]


@two_gpus
def test_two_gpus_sum_through_it_and_generate_with_it(tp2: Path) -> None:
    """The GPU twin: the benchmark checks each transport's sum (the one-kernel sum among them)
    before it times it, and a TP 2 run generates with it, the default, inside the captured step."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    bench = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "benchmarks/bench_allreduce.py"]
    done = subprocess.run(
        [*bench, "--replays", "3", "--repeats", "2", "--iters", "20"], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lamport    graph" in done.stdout, done.stdout
    # The default sum (the one-kernel sum, the MoE's fp32 output handed over as it is) and NCCL
    # (the bf16 cast): the same greedy text.
    command = [sys.executable, "-m", "prepkit", "generate", str(tp2), "--device", "cuda", "--nproc", "2"]
    texts = {}
    for kind in ("", "nccl"):
        done = subprocess.run(
            [*command, "-n", "4", "--greedy", "--json"], input="a prompt", env={**env, ALL_REDUCE_ENV: kind},
            cwd=REPO, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["new_tokens"] == 4
        texts[kind] = result["texts"]
    assert texts[""] == texts["nccl"]
