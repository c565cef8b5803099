"""Launch plans on the CPU: when a call can be planned, and how a recorded launch is laid out for
replay (the kernel's parameter order, the per-call tensors' positions). The replay itself runs on
a GPU (tests/gpu/test_launch_plan_gpu.py)."""

from __future__ import annotations

import torch

from prepkit.kernels.mx import _record, plan
from prepkit.kernels.mx._routing import _scatter_kernel


class _Compiled:
    function = object()
    packed_metadata = object()

    def run(self, *args):  # pragma: no cover - never launched here
        raise AssertionError


def test_cpu_and_interpreter_calls_are_never_planned():
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert not plan.plannable(x, torch.randn(2, 8))


def test_a_recorded_launch_is_laid_out_in_parameter_order():
    names = list(_scatter_kernel.arg_names)
    tensors = [torch.randn(4) for _ in range(3)]
    hidden, logits, out = tensors
    constants = {name: i for i, name in enumerate(names)}
    # Positional for the first three parameters, the rest by keyword, as the launchers do.
    args = (hidden, logits, out)
    kwargs = {name: constants[name] for name in names[3:]}
    launch = _record.Launch(_scatter_kernel, (5,), args, kwargs, _Compiled())
    step = plan._replayable(launch, {id(hidden): plan._HIDDEN, id(logits): plan._LOGITS, id(out): plan._OUT})
    assert step is not None
    assert step.grid == (5, 1, 1)
    assert len(step.args) == len(names)
    assert step.slots == ((0, plan._HIDDEN), (1, plan._LOGITS), (2, plan._OUT))
    assert list(step.args[3:]) == list(range(3, len(names)))


def test_a_launch_missing_a_parameter_is_not_replayable():
    launch = _record.Launch(_scatter_kernel, (1,), (torch.randn(2),), {}, _Compiled())
    assert plan._replayable(launch, {}) is None


def test_recording_collects_launches_and_zeroings_in_order():
    counts = torch.ones(4, dtype=torch.int32)
    with _record.recording() as steps:
        _record.zero(counts)
    assert len(steps) == 1 and isinstance(steps[0], _record.Zeroing) and steps[0].tensor is counts
    assert counts.eq(0).all()
    _record.zero(torch.ones(2))  # outside a recording nothing is kept
    assert len(steps) == 1


def test_a_profilers_launch_hook_stops_planning(monkeypatch):
    import triton

    runtime = triton.knobs.runtime
    assert not plan._hooked(runtime.launch_enter_hook)  # nobody listens by default
    chain = type(runtime.launch_enter_hook)()
    chain.add(lambda *_: None)
    assert plan._hooked(chain)
    assert plan._hooked(lambda *_: None) and not plan._hooked(None)
