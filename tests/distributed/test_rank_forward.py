"""A split set run as two processes (gloo, the Triton interpreter) computes what one process
computes from the unsplit set: every rank's logits of a padded batch, transformers' own greedy
loop's tokens and prepkit's decode step's; TP 2 x EP 2 over four processes too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from prepkit.kernels.reference import relative_error
from prepkit.synth import write_synthetic_checkpoint
from tests.distributed.conftest import cpu_twin, run_launch
from tests.integrations.test_transformers import TINY, _prepare

pytestmark = cpu_twin

# fp32 between modules (the worker's dtype): the ranks' partial sums then round almost as one
# process's sums do; measured 3e-7 relative at these dims.
LOGITS_TOL = 1e-5
SPAWN = "from prepkit.distributed.spawn import spawn; import sys; sys.exit(spawn(2, sys.argv[1:]))"


def worker(folders: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "tests.distributed.rank_worker", folders, str(out)]


def run_ranks(folders: str, out: Path) -> None:
    out.mkdir()
    launch = run_launch([sys.executable, "-c", SPAWN, *worker(folders, out)])
    assert launch.returncode == 0, launch.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tp1: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("one")
    launch = run_launch(worker(str(tp1), out))
    assert launch.returncode == 0, launch.stderr[-3000:]
    result: dict[str, torch.Tensor] = torch.load(out / "rank0.pt")
    return result


@pytest.mark.parametrize("split", ["tp2", "ep2"])
def test_two_ranks_give_one_process_logits_and_tokens(
    split: str, one_process: dict[str, torch.Tensor], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    run_ranks(str(request.getfixturevalue(split)), tmp_path / "out")
    for rank in (0, 1):
        got = torch.load(tmp_path / "out" / f"rank{rank}.pt")
        assert got["logits"].shape == one_process["logits"].shape  # the whole vocabulary on every rank
        assert relative_error(got["logits"], one_process["logits"]) < LOGITS_TOL
        assert torch.equal(got["tokens"], one_process["tokens"])
        assert torch.equal(got["step_tokens"], one_process["step_tokens"])  # the decode step's reduce/gather


@pytest.mark.slow
def test_tp2_by_ep2_over_four_ranks_gives_one_process_logits(tmp_path: Path) -> None:
    # four kv heads, so that attention divides among the 4 ranks
    src = write_synthetic_checkpoint(tmp_path / "model", seed=5, num_key_value_heads=4, **TINY)
    one = _prepare(src, tmp_path / "tp1", "--layout", "triton-moe")
    grid = _prepare(src, tmp_path / "tp2ep2", "--layout", "triton-moe", "--tp", "2", "--ep", "2")
    (tmp_path / "one").mkdir()
    assert run_launch(worker(str(one), tmp_path / "one")).returncode == 0
    (tmp_path / "out").mkdir()
    launch = run_launch(
        [sys.executable, "-c", SPAWN.replace("spawn(2", "spawn(4"), *worker(str(grid), tmp_path / "out")]
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    want = torch.load(tmp_path / "one" / "rank0.pt")
    for rank in range(4):
        got = torch.load(tmp_path / "out" / f"rank{rank}.pt")
        assert relative_error(got["logits"], want["logits"]) < LOGITS_TOL
        assert torch.equal(got["tokens"], want["tokens"])
