"""The decode step of one rank of several: the step sums the ranks' shares itself (its
``reduce`` after each o-projection and MoE, its ``gather`` after the head), since it reads the
weights directly, past the model's hooked modules (:mod:`prepkit.distributed.model_hooks`, which
serve the prompt's forward)."""

from __future__ import annotations

from typing import Any

from prepkit.distributed.model_hooks import collectives_of
from prepkit.generation.steps import DecodeStep, build_decoder


def build_rank_decoder(model: Any, max_len: int, batch: int, step: DecodeStep) -> Any:
    """:func:`~prepkit.generation.steps.build_decoder`, with the model's collectives as the step's
    hooks when it is one rank of several."""
    comm = collectives_of(model)
    if comm is None:
        return build_decoder(model, max_len, batch, step)
    return build_decoder(
        model, max_len, batch, step, reduce=comm.all_reduce, gather=comm.gather, reduce_fp32=comm.sums_fp32
    )
