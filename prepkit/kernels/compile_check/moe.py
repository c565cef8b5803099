"""Compiling the MoE layer's kernels: each candidate's GEMM (and the routing kernels once per token
count) launched on CPU tensors of the rank's real shapes inside the stand-in target."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

from prepkit.kernels.activations import ActivationPolicy, check_policy
from prepkit.kernels.compile_check._compiler import TargetCompiler
from prepkit.kernels.compile_check.candidates import Candidate, arch_device, check_candidates
from prepkit.kernels.compile_check.report import CompileReport
from prepkit.kernels.variants import invalid_reason
from prepkit.layer import RankLayer

# Called after each candidate: (candidates done, candidates in all, the candidate, its reports,
# routing kernels compiled just before it included).
ProgressFn = Callable[[int, int, "Candidate", "list[CompileReport]"], None]


def compile_variants(
    arch: str,
    shape: RankLayer,
    activations: ActivationPolicy,
    candidates: Iterable[Candidate],
    *,
    routing: bool = True,
    small_scales: bool = True,
    on_progress: ProgressFn | None = None,
) -> list[CompileReport]:
    """Compile every candidate (and, with ``routing``, the routing kernels once per token count)
    for ``arch``'s reference device. Pruned candidates are reported with their reason, compiler
    errors as messages; nothing raises for a variant. ``small_scales``: the runtime's fold of
    scales <= 2 into the inline-PTX upcast (``mx.upcast_id``), true of real checkpoints'
    scales when every E8M0 byte is at most 128. ``on_progress`` hears of each candidate as it is
    done (a compile takes seconds)."""
    check_policy(activations)
    device = arch_device(arch)
    todo = list(candidates)
    out: list[CompileReport] = []
    with TargetCompiler(device) as tc:
        kernels = tc.kernels
        route_done: set[int] = set()
        for i, cand in enumerate(todo):
            mine: list[CompileReport] = []
            # One token with bf16 activations has no routing launch: GEMM1 routes it.
            launched = not kernels.routes_in_gemms(cand.num_tokens, activations)
            if routing and launched and cand.num_tokens not in route_done:
                route_done.add(cand.num_tokens)
                mine.extend(tc.run(arch, activations, "route", None, f"T={cand.num_tokens}", _route_launch(
                    kernels, shape, activations, cand.num_tokens)))  # fmt: skip
            reason = invalid_reason(cand.tactic, cand.gemm, device, activations)
            if reason is not None:
                mine.append(
                    CompileReport(arch, activations, cand.gemm, cand.tactic.to_json(), cand.origin, "pruned", reason)
                )
            else:
                launch = _gemm_launch(kernels, shape, activations, cand, small_scales)
                mine.extend(tc.run(arch, activations, cand.gemm, cand.tactic, cand.origin, launch))
            out.extend(mine)
            if on_progress is not None:
                on_progress(i + 1, len(todo), cand, mine)
    return out


def check_arch(
    arch: str,
    shape: RankLayer,
    activations: ActivationPolicy,
    *,
    per_family: int = 2,
    token_points: Iterable[int] | None = None,
    sample_tokens: Sequence[int] = (1,),
    on_progress: ProgressFn | None = None,
) -> list[CompileReport]:
    """The compile-only check of one arch and policy: the defaults over ``token_points``, then
    ``per_family`` sampled variants of each family (:func:`sample_candidates`) of the variant
    spaces of ``sample_tokens``-token problems (one token admits only 16-row tiles; a large count
    admits every tile), each variant once."""
    return compile_variants(
        arch, shape, activations, check_candidates(arch, shape, activations, per_family, token_points, sample_tokens),
        on_progress=on_progress,
    )  # fmt: skip


def _route_launch(k: ModuleType, shape: RankLayer, activations: str, num_tokens: int) -> Any:
    import torch

    def launch() -> None:
        x = torch.empty((num_tokens, shape.hidden), dtype=torch.bfloat16)
        logits = torch.empty((num_tokens, shape.num_experts), dtype=torch.bfloat16)
        k.route(
            logits, top_k=shape.top_k, expert_lo=shape.expert_lo, num_local_experts=shape.num_local_experts,
            hidden=shape.hidden, hidden_states=x, activations=activations,
        )  # fmt: skip

    return launch


def _gemm_launch(k: ModuleType, shape: RankLayer, activations: str, cand: Candidate, small_scales: bool) -> Any:
    """A launch of ``cand``'s GEMM on CPU tensors of the rank's real shapes (lazy allocations)."""
    import torch

    from prepkit.layouts.triton_moe import tensor_specs

    def launch() -> None:
        T, H, E = cand.num_tokens, shape.hidden, shape.num_local_experts
        specs = tensor_specs(E, H, shape.padded_intermediate)
        w = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in specs.items()}
        counts = torch.empty(E, dtype=torch.int32)
        picks = torch.empty(max(T * shape.top_k, 1), dtype=torch.int32)
        ids = torch.empty((T, shape.top_k), dtype=torch.int32)
        weights = torch.empty((T, shape.top_k), dtype=torch.float32)
        out = torch.empty((T, H), dtype=torch.float32)
        mx = activations != "bf16"
        x = torch.empty((T, H), dtype=torch.bfloat16)
        x_mx = k.MxRows.empty(T, H, activations, x.device) if mx else None
        # One token: the GEMMs route it themselves, from the router's bf16 logits.
        one_token = k.routes_in_gemms(T, activations)
        logits = torch.empty((T, shape.num_experts), dtype=torch.bfloat16) if one_token else None
        routing = k.Routing(T, shape.top_k, E, counts, picks, ids, weights, out, activations, x_mx, logits,
                            shape.expert_lo)  # fmt: skip
        if cand.gemm == "gemm1":
            k.gemm1_swiglu(
                routing, x, w["w13_blocks"], w["w13_scales"], w["w13_bias"],
                valid_intermediate=shape.valid_intermediate, tactic=cand.tactic, small_scales=small_scales,
                activations=activations,
            )  # fmt: skip
        else:
            rows, cols = T * shape.top_k, shape.valid_intermediate
            h1 = (
                k.MxRows.empty(rows, cols, activations, x.device)
                if mx
                else torch.empty((rows, cols), dtype=torch.bfloat16)
            )
            k.gemm2_combine(
                routing, h1, w["w2_blocks"], w["w2_scales"], w["w2_bias"], tactic=cand.tactic,
                small_scales=small_scales, activations=activations,
            )  # fmt: skip

    return launch
