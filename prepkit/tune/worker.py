"""The GPU side of ``prepkit tune``: a process that builds one full-size random layer (or dense
weight: :class:`~prepkit.tune.dense_bench.DenseBench`), checks candidates against the fp32
reference and times them with CUDA graphs, answering JSON lines.

Started by :class:`prepkit.tune.backend.SubprocessBackend` as ``python -m prepkit.tune.worker``.
Without CUDA (``TRITON_INTERPRET=1``) the same code runs tiny problems on the CPU, so the whole
worker path can be tested before any GPU time is spent.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prepkit.tactics.keys import DENSE_ROLE, ProblemKey, canon, canonical_json
from prepkit.tune.candidates import key_layer
from prepkit.tune.records import OUT_OF_MEMORY, Screen

if TYPE_CHECKING:
    from prepkit.kernels.tactic import GemmTactic
    from prepkit.layouts.base import ExpertWeights
    from prepkit.tune.dense_bench import DenseBench

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
        if self.dev.type == "cuda":
            self.info = DeviceInfo.from_torch(self.dev)
        else:
            from prepkit.kernels.device import H100

            self.info = H100
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


def _describe() -> dict[str, Any]:
    from dataclasses import asdict

    from prepkit.kernels.device import DeviceInfo
    from prepkit.tactics.keys import Environment

    env = Environment.current()
    kinfo = DeviceInfo.from_torch()
    return {
        "environment": asdict(env),
        "device_info": {**asdict(kinfo), "capability": list(kinfo.capability)},
    }


def _classify(err: BaseException) -> tuple[str, bool]:
    """Status of a failed request and whether the CUDA context is unusable (restart the worker)."""
    name = type(err).__name__
    text = str(err)
    oom = _out_of_memory(name, text)
    if oom:
        status = OUT_OF_MEMORY
    elif name == "OutOfResources" or "out of resource" in text.lower():
        status = "out_of_resources"
    elif "Compil" in name or "PassManager" in text or "ptxas" in text:
        status = "compile_error"
    else:
        status = "launch_error"
    try:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.zeros(1, device="cuda").add_(1).item()
    except Exception as again:
        # Out of memory stays out of memory (other workers hold it): no fault of the variant.
        return (OUT_OF_MEMORY if oom or _out_of_memory(type(again).__name__, str(again)) else "sticky_cuda_error"), True
    return status, False


def _out_of_memory(name: str, text: str) -> bool:
    return name == "OutOfMemoryError" or "out of memory" in text.lower() or "ALLOC_FAILED" in text


# Compiled GEMM variants a worker keeps loaded. Triton holds every kernel it launched in memory
# with all its IR (megabytes each), and a thorough search runs thousands through one worker: past
# this many, the caches are emptied and a later launch loads its binary from the on-disk cache.
MAX_LOADED_VARIANTS = 256


def trim_kernel_caches(kernels: Sequence[Any], limit: int = MAX_LOADED_VARIANTS) -> int:
    """Empty the in-memory caches of the Triton ``kernels`` that hold more than ``limit`` compiled
    variants between them; returns how many were dropped. A kernel without such a cache (an
    interpreted one) is left alone."""
    loaded = 0
    for fn in kernels:
        for entry in getattr(fn, "device_caches", {}).values():
            loaded += len(entry[0]) if isinstance(entry, tuple) and isinstance(entry[0], dict) else 0
    if loaded <= limit:
        return 0
    for fn in kernels:
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            caches.clear()
    return loaded


def _gemm_kernels() -> list[Any]:
    from prepkit.kernels.mx import _dense, _gemm

    return [_gemm._gemm1_swiglu_kernel, _gemm._gemm2_combine_kernel, _dense._dense_kernel]


def worker_main(seed: int) -> int:
    niceness = int(os.environ.get(NICE_ENV) or 0)
    if niceness:
        os.nice(niceness)
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    benches: dict[str, GpuBench | DenseBench] = {}

    def bench(pk: Mapping[str, Any]) -> GpuBench | DenseBench:
        key = canonical_json(dict(pk))
        if key not in benches:
            benches.clear()  # one problem's weights on the GPU at a time
            if pk.get("role") == DENSE_ROLE:
                from prepkit.tune.dense_bench import DenseBench

                benches[key] = DenseBench(pk, seed)
            else:
                benches[key] = GpuBench(pk, seed)
        return benches[key]

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        try:
            if op == "describe":
                result = _describe()
            elif op == "bandwidth":
                result = _bandwidth_only()
            elif op == "check":
                result = bench(req["problem"]).check(req["tactic"], req.get("m_values"))
            elif op == "time":
                screen = Screen(**req["screen"]) if req.get("screen") is not None else None
                result = bench(req["problem"]).time(req.get("tactic"), int(req["m"]), req.get("pair"), screen)
            else:
                raise ValueError(f"unknown op {op!r}")
            reply: dict[str, Any] = {"ok": True, "result": result}
        except Exception as err:  # every failure is data for the blocklist
            status, fatal = _classify(err)
            text = f"{type(err).__name__}: {err}"[:2000]
            reply = {"ok": False, "status": status, "fatal": fatal, "error": text}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
        if not reply["ok"] and reply.get("fatal"):
            return 3
        if op in ("check", "time"):
            trim_kernel_caches(_gemm_kernels())
    return 0


def _bandwidth_only() -> dict[str, Any]:
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        t0.record()
        b.copy_(a)
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1))
    return {"gbps": 2 * n / (best * 1e-3) / 1e9}  # bytes read plus bytes written
