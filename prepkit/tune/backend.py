"""Where candidates are measured: the :class:`Backend` protocol, a stand-in for the CPU, and the
GPU backend that talks to a worker process (:mod:`prepkit.tune.worker`) per GPU.

A worker that crashes, hangs or hits a sticky CUDA error costs one candidate, not the sweep.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prepkit.errors import DeviceError
from prepkit.tactics.keys import Environment, ProblemKey
from prepkit.tune.records import CandidateError, CheckResult, Screen, Timing

if TYPE_CHECKING:
    from prepkit.kernels.decode.variants import DecodeProblem
    from prepkit.kernels.device import DeviceInfo


class Backend(Protocol):
    """Measures candidates of one problem on one device. Methods raise :class:`CandidateError`."""

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult: ...

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing: ...

    def close(self) -> None: ...


class FunctionBackend:
    """A backend from two callables: ``timer(tactic_json, m) -> Timing | samples`` and
    ``checker(tactic_json) -> CheckResult | bool``. Used with stand-ins on the CPU."""

    def __init__(
        self,
        timer: Callable[[str, int], Timing | Sequence[float]],
        checker: Callable[[str], CheckResult | bool] | None = None,
    ) -> None:
        self.timer = timer
        self.checker = checker
        self.calls: list[tuple[str, str, int | None]] = []

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult:
        self.calls.append(("check", tactic, None))
        if self.checker is None:
            return CheckResult(passed=True, reference="none")
        r = self.checker(tactic)
        return r if isinstance(r, CheckResult) else CheckResult(passed=bool(r), reference="stand-in")

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
        self.calls.append(("screen" if screen else "time", tactic, m))
        r = self.timer(tactic, m)
        return r if isinstance(r, Timing) else Timing.from_samples(r)

    def close(self) -> None:
        pass


class SubprocessBackend:
    """Runs candidates of the bundled kernel in a worker process pinned to one GPU.

    The worker compiles and launches; this side only sends JSON lines. A worker that dies, hangs
    past the timeout, or reports a sticky CUDA error is killed and started again on the next
    request, and the candidate in flight is reported as ``crash``/``timeout``/``sticky_cuda_error``.
    ``check_m``: the token counts a numerics check runs at (default: the worker's
    :data:`~prepkit.tune.gpu_bench.CHECK_M`).
    """

    def __init__(
        self,
        gpu: int | None = None,
        *,
        check_timeout_s: float = 600.0,
        time_timeout_s: float = 300.0,
        seed: int = 0,
        env: Mapping[str, str] | None = None,
        argv: Sequence[str] | None = None,
        check_m: Sequence[int] | None = None,
    ) -> None:
        self.gpu = gpu
        self.check_m = tuple(check_m) if check_m else None
        # The worker command; tests substitute a small script that crashes or hangs on demand.
        self.argv = list(argv) if argv else [sys.executable, "-m", "prepkit.tune.worker_cli", "--seed", str(seed)]
        self.check_timeout_s = check_timeout_s
        self.time_timeout_s = time_timeout_s
        self.seed = seed
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self.restarts = 0

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        if self.proc is not None:
            self.restarts += 1
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._buf = b""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the parent, which cleans up
        )
        return self.proc

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def _readline(self, proc: subprocess.Popen[bytes], timeout: float) -> bytes | None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def request(self, req: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        proc = self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(req) + "\n").encode())
            proc.stdin.flush()
            line = self._readline(proc, timeout)
        except (BrokenPipeError, EOFError):
            code = proc.wait()
            self._kill()
            raise CandidateError("crash", f"worker exited with code {code}") from None
        if line is None:
            self._kill()
            raise CandidateError("timeout", f"no answer within {timeout:.0f} s")
        reply = json.loads(line)
        if not reply.get("ok"):
            if reply.get("fatal"):
                self._kill()
            raise CandidateError(reply.get("status", "launch_error"), reply.get("error", ""))
        return dict(reply["result"])

    def describe(self) -> dict[str, Any]:
        """Device and software facts of the worker's GPU (the parent never initializes CUDA)."""
        try:
            return self.request({"op": "describe"}, 300.0)
        except CandidateError as err:
            raise DeviceError(f"the tuning worker could not start on GPU {self.gpu}: {err}") from err

    def check(self, problem: ProblemKey, tactic: str) -> CheckResult:
        req: dict[str, Any] = {"op": "check", "problem": _pk(problem), "tactic": tactic}
        if self.check_m:
            req["m_values"] = list(self.check_m)
        r = self.request(req, self.check_timeout_s)
        return CheckResult(**{**r, "m_values": tuple(r.get("m_values", ()))})

    def time(self, problem: ProblemKey, tactic: str, m: int, screen: Screen | None = None) -> Timing:
        req: dict[str, Any] = {"op": "time", "problem": _pk(problem), "tactic": tactic, "m": m}
        if screen is not None:
            req["screen"] = asdict(screen)
        r = self.request(req, self.time_timeout_s)
        return Timing.from_samples(r["samples_us"])

    def time_layer(self, problem: ProblemKey, pair: tuple[str, str], m: int) -> Timing:
        """Whole-layer latency with an explicit (GEMM1, GEMM2) pair, for the final report."""
        r = self.request({"op": "time", "problem": _pk(problem), "pair": list(pair), "m": m}, self.time_timeout_s)
        return Timing.from_samples(r["samples_us"])

    def check_decode(self, problem: DecodeProblem, variant: str) -> CheckResult:
        """Check a decode kernel's variant (:class:`~prepkit.tune.decode_bench.DecodeBench`)."""
        req = {"op": "decode_check", "problem": decode_problem_json(problem), "variant": variant}
        r = self.request(req, self.check_timeout_s)
        return CheckResult(**{**r, "m_values": tuple(r.get("m_values", ()))})

    def time_decode(self, problem: DecodeProblem, variant: str) -> Timing:
        req = {"op": "decode_time", "problem": decode_problem_json(problem), "variant": variant}
        return Timing.from_samples(self.request(req, self.time_timeout_s)["samples_us"])

    def bandwidth_gbps(self) -> float:
        return float(self.request({"op": "bandwidth"}, 120.0)["gbps"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                pass
        self._kill()
        self.proc = None


def _pk(problem: ProblemKey) -> dict[str, Any]:
    return dict(problem.__dict__)


def decode_problem_json(problem: DecodeProblem) -> dict[str, Any]:
    """A decode problem as the worker protocol sends it (:func:`decode_problem_from_json` reads it)."""
    return {**problem.__dict__, "extra": [list(kv) for kv in problem.extra]}


def decode_problem_from_json(d: Mapping[str, Any]) -> DecodeProblem:
    from prepkit.kernels.decode.variants import DecodeProblem

    return DecodeProblem(**{**d, "extra": tuple((str(k), int(v)) for k, v in d.get("extra", ()))})


@dataclass
class Worker:
    """One GPU the sweep can use: its backend, what it is (for the DB), and the kernels' facts."""

    backend: Backend
    env: Environment
    device: DeviceInfo


def open_gpu_workers(gpus: Sequence[int] | None, env: Mapping[str, str] | None = None) -> list[Worker]:
    """One worker process per GPU (GPU 0 when ``gpus`` is empty), with ``env`` added to its
    environment. The parent never initializes CUDA: each worker describes its own device.

    Raises:
        DeviceError: no CUDA device, or a listed GPU does not exist.
    """
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(
            "no CUDA GPU is visible: `prepkit tune` measures kernels on the GPU it runs on",
            hint="run it on the machine whose GPU you want tuned (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
        )
    count = torch.cuda.device_count()
    ids = list(gpus) if gpus else [0]
    missing = [g for g in ids if not 0 <= g < count]
    if missing:
        raise DeviceError(f"--gpus lists {missing}, but only GPUs 0..{count - 1} exist")
    from prepkit.kernels.device import DeviceInfo

    out = []
    for g in ids:
        b = SubprocessBackend(g, env=env)
        facts = b.describe()
        info = {**facts["device_info"], "capability": tuple(facts["device_info"]["capability"])}
        out.append(Worker(b, Environment(**facts["environment"]), DeviceInfo(**info)))
    return out
