"""What ``prepkit tune --thorough`` changes in a run, and the sizes both searches start from.

A thorough search measures every valid variant (:func:`prepkit.tune.candidates.kernel_space`: no
pruning rules, no ``--max-candidates``) at the anchor token counts with quick screens, then times
the best of each anchor in full at every token point, as the pruned search does. To keep the numerics checks from
dominating, it checks each variant at one shape (:data:`prepkit.tune.worker.SINGLE_CHECK_M`) with
as many check workers as the CPU and the GPU memory allow: a check compiles the variant, so the
workers fill Triton's on-disk cache and the timing worker later loads binaries instead of
compiling. docs/tuning.md ("Thorough mode") gives the cost model.

Standard library only: nothing here touches a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prepkit.tactics.keys import DENSE_ROLE, ProblemKey

# Minutes a run measures before it stops and records what it has (a rerun resumes): the pruned
# search's default fits a coffee break, the thorough one's a night.
DEFAULT_BUDGET_MINUTES = 15.0
THOROUGH_BUDGET_MINUTES = 720.0
# Check workers of the pruned search (a few dozen candidates).
DEFAULT_CHECK_WORKERS = 4
# Niceness of the check workers (compiling): the timing worker keeps its core.
CHECK_WORKER_NICENESS = 10
# The most check workers a thorough search starts by itself (and --check-workers accepts).
MAX_CHECK_WORKERS = 32
# GPU memory of a worker. Building its layer takes the weights in both forms (checkpoint and
# kernel layout) and the conversion's temporaries: 4.4 layer-bytes measured (7.28 GiB for
# gpt-oss-120b's 1.65 GB layer on an H100). Workers build one at a time under a shared lock, then
# give back all but the kernel-layout copy, the references and the CUDA context. Rounded up: an
# estimate short of the truth runs the GPU out of memory.
BUILD_BYTES_PER_LAYER_BYTE = 4.5
WORKER_BYTES_PER_LAYER_BYTE = 1.5
WORKER_OVERHEAD_BYTES = 1 << 30
# Share of the GPU memory the workers may fill together, the timing worker included.
GPU_MEMORY_SHARE = 0.8


def budget_minutes(given: float | None, *, thorough: bool) -> float:
    """``--budget-minutes`` as given, else the search's default."""
    if given is not None:
        return given
    return THOROUGH_BUDGET_MINUTES if thorough else DEFAULT_BUDGET_MINUTES


def thorough_anchors(points: Sequence[int], anchors: Sequence[int]) -> tuple[int, ...]:
    """The token counts a thorough search measures every variant at: every point when there are no
    more points than anchors, else for each anchor the point nearest it on a log scale (the anchors
    themselves on the full series). The pruned search uses the anchors that are points."""
    pts = sorted(set(points))
    if len(pts) <= len(anchors):
        return tuple(pts)
    return tuple(sorted({min(pts, key=lambda p: (abs(math.log2(p / a)), p)) for a in anchors}))


def layer_weight_bytes(problem: ProblemKey) -> int:
    """Bytes of the MXFP4 weights, scales and biases of the layer ``problem`` belongs to; of a dense
    problem, its MX weight (mxfp8 at most) and the bf16 copy its check compares with."""
    if problem.role == DENSE_ROLE:
        return int(problem.n * problem.k * (1 + 1 / 32 + 2))
    hidden, inter = problem.layer_dims
    values = problem.num_experts * 3 * hidden * inter  # gate and up (2 I x H), down (H x I)
    return int(values * (1 / 2 + 1 / 32)) + problem.num_experts * (2 * inter + hidden) * 2


def check_workers(cpu_count: int | None, gpu_mem_bytes: int, layer_bytes: int, gpus: int = 1) -> int:
    """Check workers of a thorough search on ``gpus`` GPUs of ``gpu_mem_bytes`` each: one per CPU
    core but one per timing worker (compiling is CPU work; each timing worker keeps a core), at most
    :data:`MAX_CHECK_WORKERS`, and no more than each GPU holds beside one build's peak and its
    timing worker (``gpu_mem_bytes`` 0: unknown, no memory bound)."""
    by_cpu = max(1, min((cpu_count or 2) - gpus, MAX_CHECK_WORKERS))
    if gpu_mem_bytes <= 0:
        return by_cpu
    build = BUILD_BYTES_PER_LAYER_BYTE * layer_bytes
    per_worker = WORKER_BYTES_PER_LAYER_BYTE * layer_bytes + WORKER_OVERHEAD_BYTES
    free = gpu_mem_bytes * GPU_MEMORY_SHARE - build - max(build, per_worker)  # the timing worker: its own inputs
    return max(1, min(by_cpu, gpus * int(free // per_worker)))
