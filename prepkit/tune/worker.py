"""The GPU side of ``prepkit tune``: a process that builds one full-size random layer (or dense
weight: :class:`~prepkit.tune.dense_bench.DenseBench`), checks candidates against the fp32
reference and times them with CUDA graphs, answering JSON lines.

Started by :class:`prepkit.tune.backend.SubprocessBackend` as ``python -m prepkit.tune.worker``.
Without CUDA (``TRITON_INTERPRET=1``) the same code runs tiny problems on the CPU, so the whole
worker path can be tested before any GPU time is spent.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from prepkit.tactics.keys import DENSE_ROLE, canonical_json
from prepkit.tune.gpu_bench import NICE_ENV, GpuBench
from prepkit.tune.records import OUT_OF_MEMORY, Screen

if TYPE_CHECKING:
    from prepkit.tune.decode_bench import DecodeBench
    from prepkit.tune.dense_bench import DenseBench


def _describe() -> dict[str, Any]:
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
    decode: dict[str, DecodeBench] = {}

    def decode_bench(pk: Mapping[str, Any]) -> DecodeBench:
        from prepkit.tune.backend import decode_problem_from_json
        from prepkit.tune.decode_bench import DecodeBench, load_kernels

        key = canonical_json(dict(pk))
        if key not in decode:
            decode.clear()  # one problem's inputs on the GPU at a time
            benches.clear()
            problem = decode_problem_from_json(pk)
            kernel = load_kernels().get(problem.kernel)
            if kernel is None:
                raise ValueError(f"no decode kernel {problem.kernel!r} is registered")
            import torch

            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            decode[key] = DecodeBench(kernel, problem, dev, seed)
        return decode[key]

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
            elif op == "decode_check":
                check = decode_bench(req["problem"]).check(req["variant"])
                result = {**asdict(check), "m_values": list(check.m_values)}
            elif op == "decode_time":
                result = {"samples_us": list(decode_bench(req["problem"]).time(req["variant"]).samples_us)}
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
        if op in ("check", "time", "decode_check", "decode_time"):
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
