"""Which variants a sweep measures: token points, the bundled kernel's defaults and valid variants,
and the pruning of that space to a sweepable set. Nothing here imports triton or touches a GPU."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prepkit.errors import RecipeError
from prepkit.tactics.keys import DENSE_ROLE, ProblemKey, canon
from prepkit.tactics.lookup import MAX_TOKEN_POINT, TOKEN_POINTS
from prepkit.tactics.validate import MAX_TUNED_TOKENS
from prepkit.tune.dense import dense_format

if TYPE_CHECKING:
    from prepkit.kernels.device import DeviceInfo
    from prepkit.kernels.variants import Gemm
    from prepkit.layer import MoeProblem, RankLayer


def parse_tokens(spec: str | None, *, max_tokens: int | None = None) -> tuple[int, ...]:
    """``"1,2,4-8,64"`` -> sorted unique points; ``None``/``"all"`` -> :data:`TOKEN_POINTS`.

    Raises:
        ValueError: an entry is not a positive integer or range.
        RecipeError: a count above what a tactics DB holds (:data:`MAX_TUNED_TOKENS`).
    """
    if spec is None or spec.strip().lower() in ("", "all", "default"):
        pts = set(TOKEN_POINTS)
    else:
        pts = set()
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                a, b = (int(lo), int(hi)) if sep else (int(part), int(part))
                if a > b:
                    raise ValueError
            except ValueError:
                raise ValueError(f"bad token count {part!r} (expected N or A-B, comma separated)") from None
            if b > MAX_TUNED_TOKENS:  # checked before the range is expanded
                raise RecipeError(
                    f"--tokens {part}: a tactics DB holds token counts up to {MAX_TUNED_TOKENS}",
                    hint=f"pass counts of at most {MAX_TUNED_TOKENS}",
                )
            pts.update(range(a, b + 1))
        if not pts or min(pts) < 1:
            raise ValueError(f"token counts must be positive integers, got {spec!r}")
    if max_tokens is not None:
        pts = {p for p in pts if p <= max_tokens}
    return tuple(sorted(pts))


def prune_candidates(
    tactics: Sequence[str], role: str, *, max_count: int | None = None, seeds: Sequence[str] = ()
) -> list[str]:
    """Arch-independent pruning of the kernel's valid variants to a sweepable set.

    Rules (docs/tuning.md): at least 2 stages (1 never hides the weight loads); split-K only for
    GEMM2 with small row blocks (it pays only when the grid under-fills the GPU; a dense problem's
    splits are chosen with its candidates, so they all stay); no ``bits``
    upcast where the same tile exists with ``asm`` (the same arithmetic in fewer instructions;
    ``bits`` stays for devices and interpreters without the PTX path); then, if more than
    ``max_count`` remain: first the ``seeds`` (the default tactics and earlier winners) and their
    neighbours, the variants that differ from a seed in one knob (up to half the budget: the local search an
    engineer would run by hand, e.g. the default tile with TMA loads or one stage more), then an
    even spread within each (block_m, upcast, weight_load) group so every tile regime stays
    represented. Fields the kernel does not have are ignored.
    """
    kept: list[tuple[dict[str, Any], str]] = []
    for t in tactics:
        d = json.loads(t)
        if d.get("num_stages", 2) < 2:
            continue
        # A dense problem's candidates come with their K splits chosen by the SM fill
        # (prepkit.kernels.variants.dense_sweep_space).
        if d.get("split_k", 1) > 1 and role != DENSE_ROLE and (role != "gemm2" or d.get("block_m", 16) > 32):
            continue
        kept.append((d, canon(t)))
    asm_tiles = {_without_upcast(d) for d, _ in kept if d.get("upcast") == "asm"}
    kept = [(d, t) for d, t in kept if d.get("upcast") != "bits" or _without_upcast(d) not in asm_tiles]
    if max_count is None or len(kept) <= max_count:
        return [t for _, t in kept]
    seed_dicts = [json.loads(t) for t in seeds]
    near = [t for d, t in kept if any(_knobs_apart(d, sd) <= 1 for sd in seed_dicts)]
    near.sort(key=lambda t: min(_knobs_apart(json.loads(t), sd) for sd in seed_dicts))  # seeds first
    out = near[: max_count // 2]
    chosen = set(out)
    rest = [(d, t) for d, t in kept if t not in chosen]
    groups: dict[tuple[object, object, object], list[str]] = {}
    for d, t in rest:
        groups.setdefault((d.get("block_m"), d.get("upcast"), d.get("weight_load")), []).append(t)
    # Round robin over the groups, each walked in an evenly spreading order, until the budget is
    # spent: every group gets its turn before any group gets a second one.
    walks = [[g[i] for i in _spread_order(len(g))] for _, g in sorted(groups.items(), key=lambda kv: str(kv[0]))]
    budget = max_count - len(out)
    for turn in range(max((len(w) for w in walks), default=0)):
        for w in walks:
            if turn < len(w) and budget > 0:
                out.append(w[turn])
                budget -= 1
    return out


def _spread_order(n: int) -> list[int]:
    """Indices ``0..n-1`` so that every prefix is spread evenly: 0, n/2, n/4, 3n/4, ..."""
    order: list[int] = []
    seen: set[int] = set()
    parts = 1
    while len(order) < n:
        for j in range(parts):
            i = j * n // parts
            if i not in seen:
                seen.add(i)
                order.append(i)
        parts *= 2
        if parts > 2 * n:
            order.extend(i for i in range(n) if i not in seen)
            break
    return order


def neighbourhood(space: Sequence[str]) -> Callable[[str], list[str]]:
    """``tactic -> the variants of space one move away from it`` (in ``space`` order): the moves of
    the pruned search's local refinement (:class:`prepkit.tune.sweep.SweepConfig`). A move turns
    one knob, or reshapes the weight tile (``block_n`` and ``block_k`` at the same product: the
    same tile bytes, another aspect), which turning one of the two alone cannot reach."""
    parsed = [(json.loads(t), canon(t)) for t in space]

    def near(tactic: str) -> list[str]:
        d = json.loads(tactic)
        return [t for e, t in parsed if _one_move(d, e)]

    return near


def _one_move(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    changed = _changed_knobs(a, b)
    if changed == {"block_n", "block_k"} and all(k in a and k in b for k in changed):
        return a["block_n"] * a["block_k"] == b["block_n"] * b["block_k"]  # the tile reshaped
    return len(changed) == 1


def _changed_knobs(a: Mapping[str, Any], b: Mapping[str, Any]) -> set[str]:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _knobs_apart(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
    return len(_changed_knobs(a, b))


def _without_upcast(d: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in d.items() if k != "upcast"}, sort_keys=True)


def kernel_defaults(problem: ProblemKey, device: DeviceInfo) -> Callable[[int], str]:
    """``m -> default tactic JSON`` of the bundled kernel for ``problem``'s role and activation
    policy (a dense problem: :func:`prepkit.kernels.variants.dense_default` for its shape)."""
    from prepkit.kernels.variants import default_tactics, dense_default

    if problem.role == DENSE_ROLE:
        fmt = dense_format(problem)

        def dense_for(m: int) -> str:
            return canon(dense_default(m, problem.n, problem.k, fmt, device, problem.act_dtype))

        return dense_for
    idx = 0 if problem.role == "gemm1" else 1

    def default_for(m: int) -> str:
        return canon(default_tactics(moe_problem(problem, m), device, problem.act_dtype)[idx])

    return default_for


# Token counts up to which a tune times GEMM1's K splits (:func:`gemm1_split_siblings`): decode
# batches, whose few picks leave a rank's SMs idle.
SPLIT_SIBLING_MAX_TOKENS = 8


def gemm1_split_siblings(problem: ProblemKey, device: DeviceInfo) -> Callable[[int], list[str]] | None:
    """For a MoE GEMM1 with bf16 activations: ``m ->`` the default's valid siblings with another
    K split, at up to :data:`SPLIT_SIBLING_MAX_TOKENS` tokens; ``None`` for other problems.
    GEMM1's splits stay out of the swept space (:func:`kernel_space`); the default's own split
    comes from a rule measured on Hopper, so a tune times each split next to it, at its point
    only, on the GPU at hand (an SM12x GPU's TP rank included)."""
    from dataclasses import replace

    from prepkit.kernels.tactic import GemmTactic
    from prepkit.kernels.variants import SPLIT_K, invalid_reason

    if problem.role != "gemm1" or problem.act_dtype != "bf16":
        return None
    default_for = kernel_defaults(problem, device)

    def siblings(m: int) -> list[str]:
        if m > SPLIT_SIBLING_MAX_TOKENS:
            return []
        d = GemmTactic.from_json(default_for(m))
        others = (replace(d, split_k=s) for s in SPLIT_K if s != d.split_k)
        return [canon(t) for t in others if invalid_reason(t, "gemm1", device, "bf16") is None]

    return siblings


@functools.lru_cache(maxsize=16)
def kernel_space(problem: ProblemKey, device: DeviceInfo) -> tuple[str, ...]:
    """Every valid variant of the bundled kernel for ``problem`` on ``device`` under its activation
    policy (the validity rules of :func:`prepkit.kernels.variants.invalid_reason` only, at the most
    tokens swept, so every row block counts; a dense problem: those of
    :func:`~prepkit.kernels.variants.dense_invalid_reason`), as canonical JSON in a stable order:
    what a thorough search measures, and what the pruned search of a MoE GEMM prunes."""
    from prepkit.kernels.variants import enumerate_dense_tactics, enumerate_tactics

    if problem.role == DENSE_ROLE:
        return tuple(canon(t) for t in enumerate_dense_tactics(dense_format(problem), device, None, problem.act_dtype))
    gemm: Gemm = "gemm1" if problem.role == "gemm1" else "gemm2"
    # GEMM1's K splits are left out: their fp32 partial sums grow with the picks, and a sweep
    # times every variant at every token count (the one-token default splits where it pays).
    return tuple(
        canon(t)
        for t in enumerate_tactics(gemm, device, moe_problem(problem, MAX_TOKEN_POINT), activations=problem.act_dtype)
        if gemm == "gemm2" or t.split_k == 1
    )


@functools.lru_cache(maxsize=16)
def dense_sweep_union(problem: ProblemKey, device: DeviceInfo, points: tuple[int, ...]) -> tuple[str, ...]:
    """The variants :func:`prepkit.kernels.variants.dense_sweep_space` finds worth timing at any
    of ``points`` (each token count's row tile, stages, K splits), in a stable order: what the
    pruned search of a dense problem prunes."""
    from prepkit.kernels.variants import dense_sweep_space

    fmt = dense_format(problem)
    out: dict[str, None] = {}
    for m in points:
        for t in dense_sweep_space(fmt, device, m, problem.n, problem.k, problem.act_dtype):
            out.setdefault(canon(t), None)
    return tuple(out)


def kernel_candidates(
    problem: ProblemKey,
    device: DeviceInfo,
    *,
    max_count: int | None = None,
    past_winners: Sequence[str] = (),
    points: Sequence[int] = TOKEN_POINTS,
) -> list[str]:
    """The bundled kernel's valid variants for ``problem`` on ``device`` under its activation policy,
    pruned for sweeping (a dense problem: the :func:`dense_sweep_union` of the token ``points``).
    ``past_winners`` (earlier winners of the same GEMM on this GPU model) are taken up where the
    current space still holds them; stale ones are dropped. A dense problem's winners seed its
    pruning next to the defaults. A MoE GEMM's follow its pruned set instead: its refinement searches around
    whatever is best at the anchors, and a set that does not move with the winners keeps a rerun
    of a finished tune from measuring anything new."""
    default_for = kernel_defaults(problem, device)
    defaults = {default_for(m) for m in TOKEN_POINTS}
    if problem.role == DENSE_ROLE:
        space = dense_sweep_union(problem, device, tuple(sorted(set(points))))
        seeds = defaults | (set(space) & {canon(t) for t in past_winners})
        return prune_candidates(space, problem.role, max_count=max_count, seeds=sorted(seeds))
    space = kernel_space(problem, device)
    pruned = prune_candidates(space, problem.role, max_count=max_count, seeds=sorted(defaults))
    in_space, taken = set(space), set(pruned)
    return pruned + [t for t in dict.fromkeys(canon(x) for x in past_winners) if t in in_space and t not in taken]


@functools.lru_cache(maxsize=16)
def rule_space(problem: ProblemKey, device: DeviceInfo) -> tuple[str, ...]:
    """The MoE GEMM variants the pruning rules keep (:func:`prune_candidates` with no count
    limit): where the pruned search's refinement moves."""
    return tuple(prune_candidates(kernel_space(problem, device), problem.role))


def key_layer(problem: ProblemKey) -> RankLayer:
    """The layer ``problem`` belongs to, as one rank holding all of its (local) experts and valid
    intermediate rows: the layer a tuning worker builds and measures."""
    from prepkit.dims import ModelDims
    from prepkit.layer import rank_layer

    hidden, inter = problem.layer_dims
    return rank_layer(ModelDims(1, problem.num_experts, hidden, inter, problem.top_k))


def moe_problem(problem: ProblemKey, m: int) -> MoeProblem:
    """The call of ``problem``'s layer with ``m`` tokens."""
    return key_layer(problem).problem(m)
