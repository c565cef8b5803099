"""The measuring half of a tuning worker: one full-size random layer on the GPU, its numerics
checks against the fp32 reference, and CUDA-graph timing (:class:`GpuBench`); the dense bench
(:mod:`prepkit.tune.dense_bench`) builds on the same pieces. The worker process
(:mod:`prepkit.tune.worker`) answers requests with them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prepkit.tactics.keys import ProblemKey, canon
from prepkit.tune.candidates import key_layer
from prepkit.tune.records import Screen

if TYPE_CHECKING:
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.layouts.base import ExpertWeights

# Token counts a numerics check runs the layer at: one token, a few, row blocks left partly
# filled (33) and several rows per expert (256).
CHECK_M: tuple[int, ...] = (1, 7, 33, 256)
# The one shape of a thorough search's check: 33 tokens leave row blocks partly filled and route
# to most experts, the cases where a variant's masking or indexing goes wrong.
SINGLE_CHECK_M: tuple[int, ...] = (33,)


# A lock file the workers of one ``prepkit tune`` share (the parent names it): building a layer,
# or its references, takes several times the layer's bytes for a moment, so one worker at a time.
BUILD_LOCK_ENV = "PREPKIT_TUNE_BUILD_LOCK"


# Niceness a worker takes (the parent sets it for check workers): a thorough search's timing
# worker, its slowest stage, then gets the CPU it needs while the check workers compile.
NICE_ENV = "PREPKIT_TUNE_NICE"


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """Hold the run's build lock (:data:`BUILD_LOCK_ENV`); no lock where none is named."""
    path = os.environ.get(BUILD_LOCK_ENV)
    if not path:
        yield
        return
    # One lock per GPU: a build's peak is that GPU's memory, and other GPUs' workers need not wait.
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu:
        path = f"{path}.gpu{gpu.replace(',', '-')}"
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def release_cached_memory() -> None:
    """Give the GPU memory torch's allocator keeps for reuse back to the device, for the other
    workers (a build's peak would otherwise stay reserved for the life of the worker)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def compact(obj: Any) -> None:
    """Move ``obj``'s GPU tensors to the host and back once the allocator has given back what it
    cached: built among the build's temporaries, they would keep the temporaries' memory segments
    reserved (5.7 GiB a worker was measured for a 1.8 GB layer)."""
    import torch

    moved = {k: v.cpu() for k, v in vars(obj).items() if isinstance(v, torch.Tensor) and v.is_cuda}
    for k in moved:
        setattr(obj, k, None)
    release_cached_memory()
    for k, v in moved.items():
        setattr(obj, k, v.cuda())


def kernel_timing_scope() -> str:
    """``'gemm'`` when the kernel exposes its stages (each GEMM is timed alone), else ``'layer'``."""
    from prepkit.kernels import mx as k

    return "gemm" if all(hasattr(k, f) for f in ("route", "gemm1_swiglu", "gemm2_combine")) else "layer"


class GpuBench:
    """Worker side: one full-size random layer of the problem, its reference, and timers.

    Weights are random MXFP4 codes with E8M0 scales drawn from a narrow valid range (never 0xFF),
    built in checkpoint form and converted by the real layout, so the numerics check compares
    layout + kernel against the fp32 oracle of :mod:`prepkit.kernels.reference`.
    """

    TOLERANCE = 2e-2  # relative L2 error; bf16 activations and intermediate stay well below it

    def __init__(self, pk: Mapping[str, Any], seed: int) -> None:
        import torch

        from prepkit.kernels.device import DeviceInfo
        from prepkit.runtime.moe import MoeLayer

        self.torch = torch
        self.problem = ProblemKey(**pk)
        # The problem's activation policy: candidates run it and are checked against its reference.
        self.activations = self.problem.act_dtype
        # Without CUDA (TRITON_INTERPRET=1) the same code runs tiny problems on the CPU, so the
        # whole worker path can be exercised before any GPU time is spent.
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.info = DeviceInfo.for_device(self.dev)
        shape = key_layer(self.problem)
        E, H, I, top_k = shape.num_local_experts, shape.hidden, shape.valid_intermediate, shape.top_k
        self.H, self.I, self.E, self.top_k = H, I, E, top_k
        self.seed = seed
        # The checkpoint-form copy is dropped once the layer is built and drawn again, from the same
        # seed, only while references are computed: a worker then holds one copy of the layer, so
        # a thorough search fits one check worker per core on the GPU.
        with build_lock():
            self.layer, _ = MoeLayer.from_experts(self.source(), top_k=top_k, activations=self.activations)
            compact(self.layer)
        self.layer.device_info = self.info
        self.gen = torch.Generator(device=self.dev).manual_seed(seed + 1)
        self._refs: dict[int, tuple[Any, Any, Any]] = {}
        self._inputs: dict[str, Any] = {}

    def source(self) -> ExpertWeights:
        """The layer's weights in checkpoint form, drawn from the bench's seed (the same every call)."""
        import torch

        from prepkit.layouts.base import ExpertWeights

        E, H, I = self.E, self.H, self.I
        g = torch.Generator(device=self.dev).manual_seed(self.seed)

        def codes(*shape: int) -> torch.Tensor:
            return torch.randint(0, 256, shape, generator=g, device=self.dev, dtype=torch.uint8)

        def scales(*shape: int) -> torch.Tensor:
            # 2**-8 .. 2**-5: products of fp4 values (<= 6) stay in the range real weights have.
            return torch.randint(119, 123, shape, generator=g, device=self.dev, dtype=torch.uint8)

        return ExpertWeights(
            gate_up_proj_blocks=codes(E, 2 * I, H // 32, 16),
            gate_up_proj_scales=scales(E, 2 * I, H // 32),
            gate_up_proj_bias=(torch.randn(E, 2 * I, generator=g, device=self.dev) * 0.1).to(torch.bfloat16),
            down_proj_blocks=codes(E, H, I // 32, 16),
            down_proj_scales=scales(E, H, I // 32),
            down_proj_bias=(torch.randn(E, H, generator=g, device=self.dev) * 0.1).to(torch.bfloat16),
        )

    def _references(self, ms: Sequence[int]) -> None:
        """Inputs and fp32 references of the token counts in ``ms`` not computed yet."""
        from prepkit.kernels.reference import moe_reference

        torch = self.torch
        missing = [m for m in ms if m not in self._refs]
        if not missing:
            return
        with build_lock():
            experts = self.source().as_dict()
            for m in missing:
                x = torch.randn(m, self.H, device=self.dev, generator=self.gen).to(torch.bfloat16)
                logits = torch.randn(m, self.E, device=self.dev, generator=self.gen)
                ref = moe_reference(x, logits, experts, top_k=self.top_k, activations=self.activations)
                self._refs[m] = (x, logits, ref)
            del experts
            release_cached_memory()

    def pair(self, tactic: str | None, m: int, pair: Sequence[str] | None = None) -> tuple[GemmTactic, GemmTactic]:
        from prepkit.kernels.tactic import GemmTactic

        if pair is not None:
            return GemmTactic.from_json(pair[0]), GemmTactic.from_json(pair[1])
        g1, g2 = self._defaults(m)
        assert tactic is not None
        t = GemmTactic.from_json(tactic)
        return (t, g2) if self.problem.role == "gemm1" else (g1, t)

    def check(self, tactic: str, m_values: Sequence[int] | None = None) -> dict[str, Any]:
        """Run the layer with ``tactic`` at each of ``m_values`` tokens (default :data:`CHECK_M`)
        and compare it with the fp32 reference."""
        from prepkit.kernels.reference import relative_error
        from prepkit.runtime.moe import moe

        torch = self.torch
        ms = tuple(int(m) for m in m_values) if m_values else CHECK_M
        if any(m < 1 for m in ms):
            raise ValueError(f"check token counts must be positive, got {list(ms)}")
        self._references(ms)
        worst, max_abs, bad = 0.0, 0.0, 0
        for m in ms:
            x, logits, ref = self._refs[m]
            out = moe(self.layer, x, logits, tactics=self.pair(tactic, m), out_dtype=torch.float32)
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
            bad += int((~torch.isfinite(out)).sum())
            worst = max(worst, relative_error(out, ref))
            max_abs = max(max_abs, float((out.double() - ref.double()).abs().max()) if out.numel() else 0.0)
        return {
            "passed": bad == 0 and worst <= self.TOLERANCE, "m_values": list(ms),
            "reference": f"fp32_source_dequant/{self.activations}", "max_abs_err": max_abs, "rel_err": worst,
            "nan_inf_count": bad, "tolerance": self.TOLERANCE,
        }  # fmt: skip

    ROTATE = 8  # input sets a graph cycles through: different experts each launch, cold weights

    def _launcher(self, tactic: str | None, m: int, pair: Sequence[str] | None) -> tuple[Callable[[int], Any], str]:
        """``launch(i)`` for input set ``i`` and what it covers: the swept GEMM alone when the
        kernel exposes its stages (routing and the other GEMM run once, outside the timing),
        else the whole layer."""
        from prepkit.kernels import mx as k
        from prepkit.runtime.moe import moe

        torch = self.torch
        layer = self.layer
        if self._inputs.get("m") != m:
            self._inputs = {"m": m}  # one token count's buffers at a time
        if "xs" not in self._inputs:
            self._inputs["xs"] = [
                torch.randn(m, self.H, device=self.dev, generator=self.gen).to(torch.bfloat16)
                for _ in range(self.ROTATE)
            ]
            self._inputs["ls"] = [
                torch.randn(m, self.E, device=self.dev, generator=self.gen) for _ in range(self.ROTATE)
            ]
        xs, ls = self._inputs["xs"], self._inputs["ls"]
        staged = all(hasattr(k, f) for f in ("route", "gemm1_swiglu", "gemm2_combine"))
        if pair is not None or not staged:
            tactics = self.pair(tactic, m, pair)
            return (lambda i: moe(layer, xs[i], ls[i], tactics=tactics)), "layer"
        g1, _ = self.pair(None, m, [self._default(m, 0), self._default(m, 1)])
        small = layer.small_scales
        acts = self.activations
        w13 = (layer.w13_blocks, layer.w13_scales, layer.w13_bias)
        if "routings" not in self._inputs:
            rs = [
                k.route(
                    ls[i],
                    top_k=self.top_k,
                    expert_lo=0,
                    num_local_experts=self.E,
                    hidden=self.H,
                    hidden_states=xs[i],
                    activations=self.activations,
                )  # fmt: skip
                for i in range(self.ROTATE)
            ]
            h1s = [
                k.gemm1_swiglu(
                    rs[i], xs[i], *w13, valid_intermediate=self.I, tactic=g1, small_scales=small[0], activations=acts
                )
                for i in range(self.ROTATE)
            ]
            self._inputs["routings"], self._inputs["h1s"] = rs, h1s
        rs, h1s = self._inputs["routings"], self._inputs["h1s"]
        t = self.pair(tactic, m)[0 if self.problem.role == "gemm1" else 1]
        if self.problem.role == "gemm1":

            def run_gemm1(i: int) -> Any:
                return k.gemm1_swiglu(
                    rs[i], xs[i], *w13, valid_intermediate=self.I, tactic=t, small_scales=small[0], activations=acts
                )

            return run_gemm1, "gemm1"
        w2 = (layer.w2_blocks, layer.w2_scales, layer.w2_bias if layer.apply_down_bias else None)

        def run_gemm2(i: int) -> Any:
            return k.gemm2_combine(rs[i], h1s[i], *w2, tactic=t, small_scales=small[1], activations=acts)

        return run_gemm2, "gemm2"

    def _default(self, m: int, idx: int) -> str:
        return canon(self._defaults(m)[idx])

    def _defaults(self, m: int) -> tuple[GemmTactic, GemmTactic]:
        """The pair the runtime's chooser gives a layer without tuned rows, as it runs here."""
        from prepkit.tactics.choose import MoeCall, choose

        choice = choose(
            MoeCall(self.layer.problem(m)), self.info, self.activations, on_cuda=self.dev.type == "cuda", warn=False
        )
        g1, g2 = choice.tactics
        return g1, g2

    def time(
        self, tactic: str | None, m: int, pair: Sequence[str] | None = None, screen: Screen | None = None
    ) -> dict[str, Any]:
        """Samples of one launch (:func:`graph_samples`) cycling through fresh inputs."""
        launch, scope = self._launcher(tactic, m, pair)
        return {**graph_samples(launch, self.ROTATE, self.dev, screen), "scope": scope}


def graph_samples(
    launch: Callable[[int], Any], rotate: int, device: Any, screen: Screen | None = None
) -> dict[str, Any]:
    """Samples of one launch: a CUDA graph of ``reps`` launches, ``launch(i)`` for ``i`` cycling
    through ``rotate`` input sets, replayed ``samples`` times; reps and samples scale with the
    launch's length. Without CUDA, three plain calls timed on the host. A ``screen`` takes
    :attr:`Screen.samples` samples after one warm-up, and returns the first launch alone
    (``"cut": true``) when :meth:`Screen.cuts` it."""
    import torch

    if device.type != "cuda":
        samples = []
        for i in range(3):
            t = time.perf_counter()
            launch(i % rotate)
            samples.append((time.perf_counter() - t) * 1e6)
        return {"samples_us": samples, "reps": 1}
    for i in range(1 if screen else 2):  # compile and warm up outside the graph
        launch(i % rotate)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    launch(0)
    t1.record()
    torch.cuda.synchronize()
    est_us = max(t0.elapsed_time(t1) * 1e3, 1.0)
    if screen is not None and screen.cuts(est_us):
        return {"samples_us": [est_us], "reps": 1, "cut": True}
    reps = int(min(4 * GpuBench.ROTATE, max(1, 2000 // est_us)))
    n_samples = int(min(30, max(7, 60_000 // (est_us * reps))))
    if screen is not None:  # one pass over the input sets: capturing a graph is CPU time
        reps, n_samples = min(reps, rotate), screen.samples
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(reps, rotate)):  # let the allocator see the shapes first
            launch(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            launch(i % rotate)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(n_samples):
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        samples.append(t0.elapsed_time(t1) * 1e3 / reps)
    del graph
    return {"samples_us": samples, "reps": reps}
