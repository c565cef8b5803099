"""The tuning worker's side of a dense problem: one random MX weight of the problem's shape, its
reference, and timers (:mod:`prepkit.tune.worker` answers a dense problem's requests with it).

The weight is random bf16 values quantized by the real layout
(:func:`prepkit.layouts.dense_mx.to_kernel_layout`), so a check compares layout + kernel against
the fp32 product with the dequantized weight (:func:`prepkit.kernels.reference.dense_reference`).
Timing cycles through copies of the weight that together exceed any L2, so each call reads its
weight from memory as a model's layers do, not from the cache the previous call filled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prepkit.tactics.keys import ProblemKey
from prepkit.tune.dense import dense_format
from prepkit.tune.gpu_bench import CHECK_M, GpuBench, build_lock, graph_samples, release_cached_memory
from prepkit.tune.records import Screen

if TYPE_CHECKING:
    from prepkit.kernels.mx import DenseMxWeights
    from prepkit.kernels.tactic import GemmTactic

# Weight bytes one pass of the timing graph's copies touches: several times any GPU's L2.
ROTATE_BYTES = 256 << 20
# Weight rows quantized at a time: an lm_head's rows in fp32 at once would cost gigabytes.
_ROWS_PER_CHUNK = 1 << 14


def weight_copies(stored_bytes: int) -> int:
    """Copies of a weight of ``stored_bytes`` a timing cycles through so its calls read memory."""
    return max(1, -(-ROTATE_BYTES // max(stored_bytes, 1)))


class DenseBench:
    """One dense problem's weight, bias and inputs on the worker's device."""

    TOLERANCE = GpuBench.TOLERANCE  # relative L2 error, as the MoE checks

    def __init__(self, pk: Mapping[str, Any], seed: int) -> None:
        import torch

        from prepkit.kernels.device import DeviceInfo
        from prepkit.kernels.mx import DenseMxWeights
        from prepkit.layouts import dense_mx

        self.torch = torch
        self.problem = ProblemKey(**pk)
        self.fmt = dense_format(self.problem)
        self.activations = self.problem.act_dtype
        # Without CUDA (TRITON_INTERPRET=1) the same code runs tiny problems on the CPU.
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.info = DeviceInfo.for_device(self.dev)
        n, k = self.problem.n, self.problem.k
        self.gen = torch.Generator(device=self.dev).manual_seed(seed)
        fmt = dense_mx.mx_format(self.fmt)
        parts, exact = [], []
        with build_lock():  # as the MoE benches: one build at a time, its temporaries given back
            for lo in range(0, n, _ROWS_PER_CHUNK):
                rows = min(_ROWS_PER_CHUNK, n - lo)
                w = torch.randn((rows, k), generator=self.gen, device=self.dev) * 0.02  # gpt-oss-like magnitudes
                st = dense_mx.to_kernel_layout(w.to(torch.bfloat16).float(), fmt)
                parts.append(DenseMxWeights(st["blocks"], st["scales"], self.fmt))
                # Every mxfp4 and mxfp8 value times its power-of-two scale is exact in bf16.
                exact.append(dense_mx.dequantize_kernel_layout(st["blocks"], st["scales"], fmt).to(torch.bfloat16))
            self.weights = DenseMxWeights.fuse(*parts)
            self.reference_weight = torch.cat(exact)
            del parts, exact, w, st
            release_cached_memory()
        self.bias = (torch.randn(n, generator=self.gen, device=self.dev) * 0.1).to(torch.bfloat16)
        self._copies: list[DenseMxWeights] = []
        self._inputs: dict[str, Any] = {}

    def tactic(self, tactic: str, m: int) -> GemmTactic:
        """``tactic`` (JSON) as the runtime's chooser runs it for ``m`` tokens on this device (on the
        CPU the interpreter's fix-up applies)."""
        from prepkit.kernels.tactic import GemmTactic
        from prepkit.tactics.choose import DenseCall, choose

        pinned = GemmTactic.from_json(tactic)
        call = DenseCall(m, self.problem.n, self.problem.k, self.fmt, lambda *_: pinned)
        return choose(call, self.info, self.activations, on_cuda=self.dev.type == "cuda", warn=False).tactics[0]

    def check(self, tactic: str, m_values: Sequence[int] | None = None) -> dict[str, Any]:
        """Run ``tactic`` at each of ``m_values`` tokens (default :data:`~prepkit.tune.gpu_bench.CHECK_M`)
        on random bf16 activations and compare it with the fp32 reference."""
        from prepkit.kernels.mx import mx_linear
        from prepkit.kernels.reference import dense_reference, relative_error

        torch = self.torch
        ms = tuple(int(m) for m in m_values) if m_values else CHECK_M
        if any(m < 1 for m in ms):
            raise ValueError(f"check token counts must be positive, got {list(ms)}")
        worst, max_abs, bad = 0.0, 0.0, 0
        for m in ms:
            t = self.tactic(tactic, m)
            x = torch.randn((m, self.problem.k), generator=self.gen, device=self.dev).to(torch.bfloat16)
            ref = dense_reference(x, self.reference_weight, self.bias, self.activations)
            out = mx_linear(x, self.weights, self.bias, activations=self.activations, tactic=t)
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
            bad += int((~torch.isfinite(out)).sum())
            worst = max(worst, relative_error(out, ref))
            max_abs = max(max_abs, float((out.double() - ref.double()).abs().max()))
        return {
            "passed": bad == 0 and worst <= self.TOLERANCE, "m_values": list(ms),
            "reference": f"fp32_dequant/{self.activations}", "max_abs_err": max_abs, "rel_err": worst,
            "nan_inf_count": bad, "tolerance": self.TOLERANCE,
        }  # fmt: skip

    def copies(self) -> list[DenseMxWeights]:
        """The weight and as many clones as :func:`weight_copies` asks, made on first use."""
        if not self._copies:
            from prepkit.kernels.mx import DenseMxWeights

            w = self.weights
            count = weight_copies(w.blocks.numel() + w.scales.numel()) if self.dev.type == "cuda" else 2
            self._copies = [w] + [DenseMxWeights(w.blocks.clone(), w.scales.clone(), w.fmt) for _ in range(count - 1)]
        return self._copies

    def launcher(self, tactic: str, m: int) -> Callable[[int], Any]:
        """``launch(i)``: one call of ``tactic`` at ``m`` tokens on weight copy ``i``, into one
        output buffer per token count (an lm_head's output at 8192 tokens is gigabytes)."""
        from prepkit.kernels.mx import mx_linear

        torch = self.torch
        if self._inputs.get("m") != m:
            x = torch.randn((m, self.problem.k), generator=self.gen, device=self.dev).to(torch.bfloat16)
            out = torch.empty((m, self.problem.n), dtype=torch.bfloat16, device=self.dev)
            self._inputs = {"m": m, "x": x, "out": out}  # one token count's buffers at a time
        x, out = self._inputs["x"], self._inputs["out"]
        copies, bias, acts, t = self.copies(), self.bias, self.activations, self.tactic(tactic, m)

        def launch(i: int) -> Any:
            return mx_linear(x, copies[i], bias, activations=acts, tactic=t, out=out)

        return launch

    def time(
        self, tactic: str | None, m: int, pair: Sequence[str] | None = None, screen: Screen | None = None
    ) -> dict[str, Any]:
        """Samples of one call (:func:`~prepkit.tune.gpu_bench.graph_samples`) over the weight copies.

        Raises:
            ValueError: no tactic, or a pair (a dense problem has one GEMM).
        """
        if pair is not None or tactic is None:
            raise ValueError("a dense problem times one tactic; it has no GEMM pair")
        return {**graph_samples(self.launcher(tactic, m), len(self.copies()), self.dev, screen), "scope": "dense"}
