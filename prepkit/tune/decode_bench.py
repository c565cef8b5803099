"""Checking and timing one decode kernel's variants on one device: the worker side of
``prepkit tune --decode`` (:mod:`prepkit.tune.decode_sweep` is the other side).

The check runs a variant on the kernel's random inputs and compares every output with the
kernel's torch reference on a fresh copy of the same inputs (a kernel may write into its inputs,
as attention writes its cache). Timing cycles through input sets that add up to more than any L2
(:func:`prepkit.tune.dense_bench.weight_copies`), so each call reads its weight from memory as one
layer after another does, with the CUDA graphs of :func:`prepkit.tune.gpu_bench.graph_samples`.
Each call is followed by a one-value kernel outside the launch chain, as a decode step follows
each of its kernels with another: back to back, the next call's programs would start on the SMs a
launch's last wave leaves idle and flatter launches of more than one wave. That kernel's own time,
measured alone, is taken off each sample.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

from prepkit.kernels.decode.variants import KERNELS, DecodeKernel, DecodeProblem, DecodeVariant
from prepkit.tune.records import OK, CandidateError, CheckResult, Timing


def separator(device: Any) -> Callable[[], Any]:
    """A one-value kernel outside the decode kernels' launch chain, to follow each timed call as
    another kernel follows each of them in the decode step."""
    import torch

    value = torch.zeros(1, device=device)
    return lambda: value.add_(1.0)


def load_kernels() -> dict[str, DecodeKernel]:
    """The registered decode kernels: each module of :mod:`prepkit.kernels.decode` is imported, so
    each registers itself (a module that does not import is left out; its kernel is then missing)."""
    import prepkit.kernels.decode as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        try:
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
        except ImportError:
            continue
    return KERNELS


def tensors(obj: Any) -> Iterator[Any]:
    """The tensors of a kernel's outputs or inputs, in order: a tensor, or those inside
    sequences, mappings and objects' attributes (a stored MX weight); ``None`` is skipped."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from tensors(v)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from tensors(v)


class DecodeBench:
    """One decode problem's inputs on one device, and its variants checked and timed by name."""

    def __init__(self, kernel: DecodeKernel, problem: DecodeProblem, device: Any, seed: int = 0) -> None:
        self.kernel = kernel
        self.problem = problem
        self.device = device
        self.seed = seed
        self._sets: list[dict[str, Any]] = []
        self._separator: Callable[[], Any] | None = None
        self._separator_us: float | None = None

    def check(self, variant: str) -> CheckResult:
        """Run ``variant`` and compare each output with the reference (relative L2 error)."""
        import torch

        from prepkit.kernels.reference import relative_error

        v = DecodeVariant.parse(variant)
        out = list(tensors(self.kernel.launch(self.kernel.inputs(self.problem, self.device, self.seed), v)))
        ref = list(tensors(self.kernel.reference(self.kernel.inputs(self.problem, self.device, self.seed))))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        tol = float(self.kernel.tolerance(self.problem))
        if len(out) != len(ref):
            return CheckResult(
                passed=False, reference="torch", tolerance=tol,
                error=f"{len(out)} outputs, the reference has {len(ref)}",
            )  # fmt: skip
        worst, max_abs, bad = 0.0, 0.0, 0
        for o, r in zip(out, ref, strict=True):
            if o.shape != r.shape:
                return CheckResult(
                    passed=False, reference="torch", tolerance=tol,
                    error=f"output of shape {tuple(o.shape)}, the reference's is {tuple(r.shape)}",
                )  # fmt: skip
            bad += int((~torch.isfinite(o.float())).sum())
            worst = max(worst, relative_error(o, r))
            max_abs = max(max_abs, float((o.double() - r.double()).abs().max()) if o.numel() else 0.0)
        return CheckResult(
            passed=bad == 0 and worst <= tol, reference="torch", max_abs_err=max_abs, rel_err=worst,
            nan_inf_count=bad, tolerance=tol, status=OK,
        )  # fmt: skip

    def input_sets(self) -> list[dict[str, Any]]:
        """Input sets whose bytes add up past any L2 (two on the CPU), made on first use."""
        if not self._sets:
            from prepkit.tune.dense_bench import weight_copies

            first = self.kernel.inputs(self.problem, self.device, self.seed)
            size = sum(t.numel() * t.element_size() for t in tensors(first))
            count = weight_copies(size) if self.device.type == "cuda" else 2
            more = [self.kernel.inputs(self.problem, self.device, self.seed + i) for i in range(1, count)]
            self._sets = [first, *more]
        return self._sets

    def launcher(self, variant: str) -> Callable[[int], Any]:
        """Call ``i``: ``variant`` on input set ``i``, then the separator kernel."""
        v = DecodeVariant.parse(variant)
        sets, kernel, separate = self.input_sets(), self.kernel, self.separator()

        def launch(i: int) -> Any:
            out = kernel.launch(sets[i], v)
            separate()
            return out

        return launch

    def separator(self) -> Callable[[], Any]:
        """:func:`separator` on this bench's device, made on first use."""
        if self._separator is None:
            self._separator = separator(self.device)
        return self._separator

    def separator_us(self) -> float:
        """The separator's own median time a call, measured once."""
        if self._separator_us is None:
            import statistics

            from prepkit.tune.gpu_bench import graph_samples

            separate = self.separator()
            self._separator_us = statistics.median(graph_samples(lambda _: separate(), 1, self.device)["samples_us"])
        return self._separator_us

    def time(self, variant: str) -> Timing:
        """Samples of one call (:func:`~prepkit.tune.gpu_bench.graph_samples`) over the input sets,
        less the separator's own time."""
        from prepkit.tune.gpu_bench import graph_samples

        got = graph_samples(self.launcher(variant), len(self.input_sets()), self.device)
        own = self.separator_us()
        return Timing.from_samples([max(us - own, 0.0) for us in got["samples_us"]])


class LocalDecodeBackend:
    """Checks and times decode variants in this process, on ``device`` (the CPU under
    ``TRITON_INTERPRET=1`` in tests; a GPU run uses the worker processes instead). Errors of a
    variant become :class:`CandidateError`, as a worker reports them."""

    def __init__(self, device: Any = "cpu", kernels: dict[str, DecodeKernel] | None = None, seed: int = 0) -> None:
        import torch

        self.device = torch.device(device)
        self.kernels = kernels if kernels is not None else load_kernels()
        self.seed = seed
        self._bench: DecodeBench | None = None

    def bench(self, problem: DecodeProblem) -> DecodeBench:
        if self._bench is None or self._bench.problem != problem:  # one problem's inputs at a time
            kernel = self.kernels.get(problem.kernel)
            if kernel is None:
                raise CandidateError("launch_error", f"no decode kernel {problem.kernel!r} is registered")
            self._bench = DecodeBench(kernel, problem, self.device, self.seed)
        return self._bench

    def check_decode(self, problem: DecodeProblem, variant: str) -> CheckResult:
        try:
            return self.bench(problem).check(variant)
        except CandidateError:
            raise
        except Exception as err:  # a variant that does not run is data, not a crash of the sweep
            raise CandidateError("launch_error", f"{type(err).__name__}: {err}") from err

    def time_decode(self, problem: DecodeProblem, variant: str) -> Timing:
        try:
            return self.bench(problem).time(variant)
        except CandidateError:
            raise
        except Exception as err:
            raise CandidateError("launch_error", f"{type(err).__name__}: {err}") from err

    def close(self) -> None:
        self._bench = None
