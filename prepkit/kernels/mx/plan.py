"""Launch plans: one layer's launches at one token count, recorded from a real call and replayed.

At decode sizes the GPU finishes a layer in tens of microseconds, and an eager call used to spend
several times that in Python: argument checks, tactic choice, buffer allocation, TMA descriptors,
and Triton's own per-launch argument binding and cache lookup. A plan pays all of that once. The
first call at a token count runs the ordinary launchers (:func:`~.launch.fused_moe`) while
:mod:`._record` notes each launch; later calls allocate the output, put the call's three tensors
(hidden states, router logits, output) into the recorded argument lists and call the compiled
kernels directly.

Everything else a launch reads is fixed per plan: the layer's weights and descriptors, the grid
(static per token count), the constexprs, and a :class:`~.launch.Workspace` shared by every layer
of that shape on that stream (one stream runs its calls in order, so they never overlap). Plans
are made for CUDA tensors only (the interpreter has no compiled kernels) and for token counts up
to :data:`MAX_PLANNED_TOKENS`, where host time matters; bigger calls stay on the ordinary path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prepkit.kernels.activations import ActivationPolicy
from prepkit.kernels.mx._record import Launch, Zeroing, recording
from prepkit.kernels.mx._target import current_stream, interpreting
from prepkit.kernels.mx.launch import Workspace

# Above this many tokens a call's GPU time dwarfs its host time (measured on an H100: 64 tokens
# take ~630 us on the GPU), and each planned token count keeps a workspace.
MAX_PLANNED_TOKENS = 64

_HIDDEN, _LOGITS, _OUT = 0, 1, 2  # the per-call tensors, in the order a replay passes them

_WorkspaceKey = tuple[int, int, int, int, int, int, int, str]
_WORKSPACES: dict[_WorkspaceKey, Workspace] = {}


def shared_workspace(
    *,
    device: torch.device,
    stream: int,
    tokens: int,
    top_k: int,
    num_local_experts: int,
    hidden: int,
    valid_intermediate: int,
    activations: ActivationPolicy,
) -> Workspace:
    """The workspace every plan of this shape on ``stream`` uses (made on first use)."""
    key = (device.index or 0, stream, tokens, top_k, num_local_experts, hidden, valid_intermediate, activations)
    found = _WORKSPACES.get(key)
    if found is None:
        found = _WORKSPACES[key] = Workspace.empty(
            tokens=tokens, top_k=top_k, num_local_experts=num_local_experts, hidden=hidden,
            activations=activations, device=device, valid_intermediate=valid_intermediate,
        )  # fmt: skip
    return found


class CompiledKernel(Protocol):
    """What a replay needs of the kernel Triton compiled for a launch (its ``CompiledKernel``)."""

    # The launcher: grid, stream, function, packed metadata, three hooks, then the kernel's arguments.
    run: Callable[..., object]
    function: object  # the loaded kernel's driver handle
    packed_metadata: object


@dataclass(frozen=True)
class _Step:
    """One recorded launch, ready to replay: the compiled kernel's parts, its grid, and its
    arguments in the kernel's parameter order with the per-call tensors' positions (``slots``)."""

    run: Callable[..., object]
    function: object
    packed_metadata: object
    grid: tuple[int, int, int]
    args: tuple[Any, ...]
    slots: tuple[tuple[int, int], ...]  # (argument index, _HIDDEN/_LOGITS/_OUT)


class LaunchPlan:
    """The recorded launches of one call; ``plan(hidden_states, router_logits)`` launches them
    again for new tensors of the same shapes, dtypes and device, on the stream it was made on, and
    returns the fp32 ``[T, H]`` output (a new tensor each call)."""

    def __init__(
        self, steps: list[_Step | torch.Tensor], out_shape: tuple[int, int], router_logits: torch.Tensor
    ) -> None:
        self._steps = steps
        self._out_shape = out_shape
        self._logits_shape = tuple(router_logits.shape)
        self._logits_dtype = router_logits.dtype
        device = self._device = router_logits.device
        self._stream = current_stream(device)

    def accepts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> bool:
        """Whether a replay on these tensors launches what the recorded call did: the same
        device, shapes and dtypes, contiguous, and 16-byte aligned (Triton specializes on that)."""
        return (
            hidden_states.device == self._device
            and hidden_states.dtype == torch.bfloat16
            and tuple(hidden_states.shape) == self._out_shape
            and tuple(router_logits.shape) == self._logits_shape
            and router_logits.dtype == self._logits_dtype
            and router_logits.device == self._device
            and hidden_states.is_contiguous()
            and router_logits.is_contiguous()
            and _aligned(hidden_states, router_logits)
        )

    def __call__(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self._out_shape, dtype=torch.float32, device=self._device)
        call = (hidden_states, router_logits, out)
        stream = self._stream
        for step in self._steps:
            if isinstance(step, torch.Tensor):
                step.zero_()
                continue
            args = list(step.args)
            for index, slot in step.slots:
                args[index] = call[slot]
            step.run(*step.grid, stream, step.function, step.packed_metadata, None, None, None, *args)
        return out

    @classmethod
    def record(
        cls,
        call: Callable[[Workspace], torch.Tensor],
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        workspace: Workspace,
    ) -> tuple[LaunchPlan | None, torch.Tensor]:
        """Run ``call`` (the ordinary launchers on ``hidden_states`` and ``router_logits`` with
        ``workspace``) and return its output with the plan that replays it, or ``None`` where a
        launch cannot be replayed (an argument the kernel's parameters do not place)."""
        with recording() as recorded:
            out = call(workspace)
        per_call = {id(hidden_states): _HIDDEN, id(router_logits): _LOGITS, id(out): _OUT}
        steps: list[_Step | torch.Tensor] = []
        for item in recorded:
            step = item.tensor if isinstance(item, Zeroing) else _replayable(item, per_call)
            if step is None:
                return None, out
            steps.append(step)
        return cls(steps, (hidden_states.shape[0], out.shape[1]), router_logits), out


def plan_fused_moe(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_bias: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor | None,
    *,
    top_k: int,
    valid_intermediate: int,
    activations: ActivationPolicy = "bf16",
    **kwargs: Any,
) -> tuple[LaunchPlan | None, torch.Tensor]:
    """:func:`~.launch.fused_moe` with the same arguments, and the plan that replays it for new
    activations and logits of the same shapes (``None`` where calls cannot be planned: see
    :func:`plannable`)."""
    from prepkit.kernels.mx.launch import fused_moe

    def call(workspace: Workspace | None) -> torch.Tensor:
        return fused_moe(
            hidden_states, router_logits, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias,
            top_k=top_k, valid_intermediate=valid_intermediate, activations=activations, workspace=workspace,
            **kwargs,
        )  # fmt: skip

    if not plannable(hidden_states, router_logits) or kwargs.get("out") is not None:
        return None, call(None)
    device = hidden_states.device
    workspace = shared_workspace(
        device=device, stream=current_stream(device), tokens=hidden_states.shape[0], top_k=top_k,
        num_local_experts=w13_blocks.shape[0], hidden=hidden_states.shape[1],
        valid_intermediate=valid_intermediate, activations=activations,
    )  # fmt: skip
    return LaunchPlan.record(call, hidden_states, router_logits, workspace)


def plannable(hidden_states: torch.Tensor, router_logits: torch.Tensor) -> bool:
    """Whether calls on these tensors can be planned: CUDA, compiled kernels, 1 to
    :data:`MAX_PLANNED_TOKENS` tokens, 16-byte aligned (what a replay accepts), and no launch hooks
    (a profiler's hooks must see every launch)."""
    if hidden_states.device.type != "cuda" or interpreting() or not 0 < hidden_states.shape[0] <= MAX_PLANNED_TOKENS:
        return False
    if not _aligned(hidden_states, router_logits):
        return False
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is None or not (_hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook))


def _aligned(*tensors: torch.Tensor) -> bool:
    # Triton specializes a pointer argument on 16-byte alignment: a plan recorded on aligned
    # tensors must never replay on others.
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _hooked(hook: Any) -> bool:
    # Newer Triton keeps a chain of hooks that is empty when nobody listens; older, a callable or None.
    return hook is not None and bool(getattr(hook, "calls", True))


def _replayable(launch: Launch, per_call: dict[int, int]) -> _Step | None:
    """The launch as a replayable step, or ``None`` when its arguments cannot be laid out."""
    compiled: CompiledKernel | None = launch.compiled
    if compiled is None or not hasattr(compiled, "run"):
        return None
    params = inspect.signature(launch.kernel.fn).parameters  # the jit function's own signature
    names = list(params)
    if len(launch.args) > len(names):
        return None
    values: dict[str, Any] = dict(zip(names, launch.args, strict=False))
    values.update((name, value) for name, value in launch.kwargs.items() if name in params)
    args: list[Any] = []
    for name, param in params.items():
        if name in values:
            args.append(values[name])
        elif param.default is not inspect.Parameter.empty:
            args.append(param.default)
        else:
            return None
    slots = tuple((i, per_call[id(a)]) for i, a in enumerate(args) if id(a) in per_call)
    x, y, z = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    return _Step(compiled.run, compiled.function, compiled.packed_metadata, (x, y, z), tuple(args), slots)
