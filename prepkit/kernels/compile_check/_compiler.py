"""The stand-in target: Triton's active driver reports the chosen GPU while launches record their
specialization instead of running, and the recorded specializations compile through
``JITFunction.preload``."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType
from typing import Any

from prepkit.errors import DeviceError
from prepkit.kernels.compile_check import sass
from prepkit.kernels.compile_check.report import CompileReport, Stage
from prepkit.kernels.device import DeviceInfo
from prepkit.kernels.tactic import GemmTactic

_FRESH_PROCESS_HINT = (
    "compile in a process that imports triton without TRITON_INTERPRET (prepkit tune --compile-only does)"
)


class _StandInDriver:
    """Triton's active driver while compiling: reports ``target`` as the current GPU and a device
    key of its own (so the JIT's per-device caches never mix with a real GPU's)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.key = f"prepkit-compile-check:{target.backend}:{target.arch}"

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> str:
        return self.key

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the compile check never builds a launcher")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the compile check never times")


class TargetCompiler:
    """Context in which kernel launches compile for ``device`` and launch nothing."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.capability = device.capability[0] * 10 + device.capability[1]
        self._stack = contextlib.ExitStack()
        self._tools = sass.NvidiaTools()
        self._done: dict[tuple[str, str], tuple[Any, float] | BaseException] = {}

    def __enter__(self) -> TargetCompiler:
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver

        self.triton = triton
        if interpreter_imported():
            raise DeviceError(
                "triton was imported with TRITON_INTERPRET=1: its own @jit functions are interpreter "
                "functions, so nothing compiles ahead of time in this process",
                hint=_FRESH_PROCESS_HINT,
            )
        self._stack.enter_context(_env("TRITON_INTERPRET", None))
        if "TRITON_DEFAULT_FP_FUSION" not in os.environ:
            # Triton's default (fused), said explicitly: a launch compiles the same, minus the
            # warning triton 3.9 prints once per process when the variable is unset.
            self._stack.enter_context(_env("TRITON_DEFAULT_FP_FUSION", "1"))
        self.kernels = _compilable_kernels()
        # DriverConfig keeps the active driver in ``_active``; restore exactly that (its public
        # reset would build the default driver, which fails on a machine without a GPU).
        prev_driver = getattr(driver, "_active", None)
        self._driver = _StandInDriver(GPUTarget("cuda", self.capability, 32))
        driver.set_active(self._driver)
        self._stack.callback(setattr, driver, "_active", prev_driver)
        prev_hook = knobs.runtime.jit_cache_hook
        self._stack.callback(setattr, knobs.runtime, "jit_cache_hook", prev_hook)
        self._knobs = knobs
        from prepkit.kernels.mx._target import pinned_capability

        # The launchers then decide (PDL, TMA descriptors) as on the target, though tensors are on the CPU.
        self._stack.enter_context(pinned_capability(self.device.capability))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(
        self, arch: str, activations: str, stage: Stage, tactic: GemmTactic | None, origin: str, launch: Any
    ) -> list[CompileReport]:
        """Run ``launch`` with the JIT recording instead of compiling, then compile what it recorded."""
        recorded: list[tuple[Any, str, str]] = []

        def record(*, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
            recorded.append((fn.jit_function, compile["specialization_data"], str(key)))
            return True  # the JIT then compiles and launches nothing

        base = CompileReport(arch, activations, stage, "" if tactic is None else tactic.to_json(), origin, "failed")
        self._knobs.runtime.jit_cache_hook = record
        try:
            launch()
        except Exception as exc:  # a launcher's own check: the variant never reached the compiler
            return [replace(base, message=f"launcher refused: {_compiler_message(exc)}")]
        finally:
            self._knobs.runtime.jit_cache_hook = None
        if not recorded:
            return [replace(base, message="the launcher launched no kernel")]
        return [self._compile(base, fn, spec, key, tactic) for fn, spec, key in recorded]

    def _compile(self, base: CompileReport, fn: Any, spec: str, key: str, tactic: GemmTactic | None) -> CompileReport:
        name = getattr(fn, "__name__", str(fn))
        base = replace(base, kernel=name)
        done = self._done.get((name, key))
        if done is None:
            start = time.perf_counter()
            try:
                done = (fn.preload(spec), time.perf_counter() - start)
            except Exception as exc:
                done = exc
            finally:
                # preload caches the kernel for the stand-in device; a later launch of the same
                # specialization would find it there and try to run it.
                fn.device_caches.pop(self._driver.key, None)
            self._done[(name, key)] = done
        if isinstance(done, BaseException):
            return replace(base, message=_compiler_message(done))
        compiled, seconds = done
        return self._read(replace(base, compile_s=round(seconds, 2)), compiled, tactic)

    def _read(self, base: CompileReport, compiled: Any, tactic: GemmTactic | None) -> CompileReport:
        ptx = compiled.asm.get("ptx", "")
        target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
        mma, instruction = sass.mma_kind(ptx)
        shared = int(getattr(compiled.metadata, "shared", 0))
        report = replace(
            base, status="compiled", ptx_target=target.group(1) if target else "", shared_bytes=shared, mma=mma,
            mma_instruction=instruction,
        )  # fmt: skip
        cubin = compiled.asm.get("cubin")
        if cubin:
            usage, listing = self._tools.inspect(cubin)
            loop = sass.k_loop(listing)
            report = replace(report, registers=usage.get("REG"), spill_bytes=usage.get("LOCAL"))
            if loop is None and base.stage == "decode":  # no matrix unit: the weight-streaming loop
                steps = sass.stream_loop(listing)
                loop = None if steps is None else (steps, 0)
            if loop is not None:
                report = replace(report, k_step_instructions=loop[0], k_step_mma=loop[1])
                if tactic is not None:
                    per_thread = tactic.block_n * tactic.block_k / 2 / (32 * tactic.num_warps)
                    report = replace(report, instructions_per_4_weight_bytes=round(loop[0] / (per_thread / 4), 2))
        if shared > self.device.max_shared_mem:
            report = replace(
                report,
                status="failed",
                message=f"out of resources: needs {shared} B of shared memory, {self.device.name} allows "
                f"{self.device.max_shared_mem}",
            )
        return report


def interpreter_imported() -> bool:
    """Whether triton's own library was imported under ``TRITON_INTERPRET=1`` (its ``@jit``
    functions are then interpreter functions for the life of the process)."""
    std = sys.modules.get("triton.language.standard")
    return std is not None and type(getattr(std, "cdiv", None)).__name__ == "InterpretedFunction"


def leave_interpreter() -> None:
    """Turn ``TRITON_INTERPRET`` off for this process while triton is not imported yet, so a
    compile-only process compiles even where the variable is set (it runs no kernel)."""
    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)


def _compiler_message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:4000]


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _compilable_kernels() -> ModuleType:
    """``prepkit.kernels.mx``, whose kernels must be compiler functions: Triton makes each
    ``@triton.jit`` function an interpreter function for good when its module is imported under
    ``TRITON_INTERPRET=1``."""
    from triton.runtime.jit import JITFunction

    from prepkit.kernels import mx
    from prepkit.kernels.mx._gemm import _gemm1_swiglu_kernel

    if not isinstance(_gemm1_swiglu_kernel, JITFunction):
        raise DeviceError(
            "prepkit.kernels.mx was imported with TRITON_INTERPRET=1: its kernels are interpreter "
            "functions, so nothing compiles ahead of time in this process",
            hint=_FRESH_PROCESS_HINT,
        )
    return mx
