"""The decode step's ops as prepkit's Triton decode kernels (:mod:`prepkit.kernels.decode`): one
launch each for the norm and q/k/v, rotary with the cache write and attention, the output
projection with its residual, and the norm and router.

Each call's variant is chosen once per problem (shape, weight format, batch) and kept, so a graph
capture records the same launches the warm-up ran. ``choose`` picks it: by default the tactics
DBs' decode winner for this device, else the kernel's built-in default. An mxfp4 lm_head runs on
the dense MX kernel's tensor cores after a norm-only launch
(:func:`~prepkit.kernels.decode.problems.on_tensor_cores`), its variant the dense problem's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prepkit.integrations.decode_ops import MxWeight, Ops, Weight
from prepkit.kernels.decode.problems import on_tensor_cores, projection_problem, step_attention_problem
from prepkit.kernels.decode.variants import DecodeKernel, DecodeProblem, DecodeVariant

Chooser = Callable[[DecodeKernel, DecodeProblem], DecodeVariant]


def default_chooser(kernel: DecodeKernel, problem: DecodeProblem) -> DecodeVariant:
    """The kernel's built-in variant for ``problem`` (nothing tuned)."""
    return kernel.default(problem)


def tuned_chooser(device: torch.device) -> Chooser:
    """The tactics DBs' decode winner for ``device`` (the user DB, then the bundled one), else the
    kernel's default; off CUDA, the default."""
    if device.type != "cuda":
        return default_chooser
    from prepkit.tactics.decode_lookup import decode_variant

    def choose(kernel: DecodeKernel, problem: DecodeProblem) -> DecodeVariant:
        with torch.cuda.device(device):
            return decode_variant(kernel, problem)

    return choose


class KernelOps:
    """The step's ops over the decode kernels, with one variant per problem chosen by ``choose``."""

    def __init__(self, choose: Chooser = default_chooser) -> None:
        from prepkit.kernels.decode import attention, attention_variants, gemv, gemv_registry

        self._gemv, self._attention = gemv, attention
        self._registry, self._attention_variants = gemv_registry, attention_variants
        self._choose = choose
        self.chosen: dict[str, DecodeVariant] = {}

    def _variant(self, kernel: DecodeKernel, problem: DecodeProblem) -> DecodeVariant:
        key = problem.key()
        found = self.chosen.get(key)
        if found is None:
            found = self.chosen[key] = self._choose(kernel, problem)
        return found

    def _projection(self, kernel: str, weight: Weight, x: torch.Tensor) -> DecodeProblem:
        rows, cols = self._gemv.weight_shape(weight)
        return projection_problem(kernel, rows, cols, x.shape[0], self._gemv.weight_format(weight))

    def norm_linear(
        self,
        hidden: torch.Tensor,
        add: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: Weight,
        bias: torch.Tensor | None,
        want_normed: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        problem = self._projection("norm_linear", weight, hidden)
        if on_tensor_cores(problem.rows, problem.fmt):
            # The norm alone, then the dense MX kernel (its variant the dense tactics DBs') with
            # bf16 activations, as the GEMV multiplies them.
            from prepkit.runtime.dense import mx_linear

            assert isinstance(weight, MxWeight)  # on_tensor_cores holds for MX weights only
            summed, normed = self._gemv.add_norm(hidden, add, norm_weight, eps)
            out = mx_linear(normed, weight.blocks, weight.scales, bias, weight.fmt, "bf16")
            return summed, out, normed if want_normed else None
        variant = self._variant(self._registry.NORM_LINEAR, problem)
        return self._gemv.norm_linear(hidden, add, norm_weight, eps, weight, bias, want_normed, variant=variant)

    def rope_cache_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
        pad: torch.Tensor,
        window: int | None,
        sinks: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        batch, kv_heads, length, head_dim = keys.shape
        # One variant per cache length: the slots in use change every step inside one graph.
        problem = step_attention_problem(batch, sinks.shape[0], kv_heads, head_dim, length, window)
        variant = self._variant(self._attention_variants.ROPE_CACHE_ATTEND, problem)
        return self._attention.rope_cache_attend(
            qkv, cos, sin, keys, values, position, pad, window, sinks, scaling, variant=variant
        )

    def linear_residual(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        variant = self._variant(self._registry.LINEAR_RESIDUAL, self._projection("linear_residual", weight, x))
        return self._gemv.linear_residual(x, weight, bias, residual, variant=variant)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        # The weight streams as the output projection's does: its variant, tuned or default.
        variant = self._variant(self._registry.LINEAR_RESIDUAL, self._projection("linear_residual", weight, x))
        return self._gemv.linear(x, weight, bias, variant=variant)

    def ops(self) -> Ops:
        return Ops(self.norm_linear, self.rope_cache_attend, self.linear_residual, self.linear)


def kernel_ops(choose: Chooser = default_chooser) -> Ops:
    """The decode kernels as the step's ops (see the module)."""
    return KernelOps(choose).ops()
