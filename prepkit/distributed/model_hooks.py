"""A rank's transformers gpt-oss computing the whole model's output: the sum over the ranks
after each o-projection and each MoE block (their outputs are this rank's partial sums), and
the vocabulary gather after the head. Forward hooks keep the modules and their parameter names
as transformers made them, so ``model(input_ids)`` and transformers' ``generate`` run unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from prepkit.distributed.collectives import Collectives

COMM_ATTR = "prepkit_collectives"  # the model's Collectives, for a decode step that calls them itself
_HOOKS_ATTR = "_prepkit_comm_hooks"


def attach_collectives(model: Any, comm: Collectives) -> None:
    """Hook ``comm`` into ``model`` (a gpt-oss ``ForCausalLM`` with this rank's shares loaded)."""
    handles = []
    for decoder in model.model.layers:
        handles.append(decoder.self_attn.o_proj.register_forward_hook(_reduce_output(comm)))
        handles.append(decoder.mlp.register_forward_hook(_reduce_first(comm)))
    handles.append(model.lm_head.register_forward_hook(_gather_output(comm)))
    setattr(model, COMM_ATTR, comm)
    setattr(model, _HOOKS_ATTR, handles)


def detach_collectives(model: Any) -> None:
    """Remove the hooks: for a decode step that reads the weights and runs ``reduce``/``gather``
    itself (the model's :data:`COMM_ATTR`), so that nothing is summed twice."""
    for handle in getattr(model, _HOOKS_ATTR, []):
        handle.remove()
    setattr(model, _HOOKS_ATTR, [])


def collectives_of(model: Any) -> Collectives | None:
    """The model's collectives when it is one rank of several, else None."""
    comm = getattr(model, COMM_ATTR, None)
    return comm if isinstance(comm, Collectives) else None


def split_of(manifest: Any, model: Any) -> dict[str, Any]:
    """The split a run decodes on (for reports): tp x ep of the prepared set and how the ranks sum
    their outputs (``all_reduce``: None on one rank)."""
    comm = collectives_of(model)
    parallel = manifest.parallel
    return {"tp": parallel.tp_size, "ep": parallel.ep_size, "all_reduce": comm.transport if comm else None}


def split_label(split: dict[str, Any] | None) -> str:
    """``tp2 ep1 (lamport)`` for a split run, empty on one rank."""
    if not split or split.get("tp", 1) * split.get("ep", 1) == 1:
        return ""
    return f"tp{split['tp']} ep{split['ep']} ({split['all_reduce']})"


def _reduce_output(comm: Collectives) -> Any:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(output)

    return hook


def _reduce_first(comm: Collectives) -> Any:
    def hook(module: nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (comm.all_reduce(output[0]), *output[1:])

    return hook


def _gather_output(comm: Collectives) -> Any:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return comm.gather(output)

    return hook
