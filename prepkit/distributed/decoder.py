"""The decode step of one rank of several. A step that takes the collectives itself
(``PrepkitDecoder(..., reduce=, gather=)``) gets them; until it does, the modules step runs,
whose o-projections, MoE blocks and head are the model's hooked modules
(:mod:`prepkit.distributed.model_hooks`). The compiled step reads the weights directly, past
the hooks, so it runs over several ranks only where it takes the collectives."""

from __future__ import annotations

import inspect
from typing import Any

from prepkit.distributed.model_hooks import collectives_of
from prepkit.errors import RecipeError
from prepkit.generation.steps import DecodeStep, build_decoder


def decoder_takes_collectives() -> bool:
    """Whether this build's decode step accepts ``reduce=`` and ``gather=``."""
    from prepkit.integrations.static_decode import PrepkitDecoder

    params = inspect.signature(PrepkitDecoder).parameters
    return "reduce" in params and "gather" in params


def rank_step(requested: DecodeStep | None, default: DecodeStep, model: Any) -> DecodeStep:
    """The step a rank runs: as asked (or the device's default) for one process; of several,
    the modules step unless the decode step takes the collectives.

    Raises:
        RecipeError: the compiled step asked for over several ranks where it cannot sum them.
    """
    if collectives_of(model) is None or decoder_takes_collectives():
        return requested or default
    if requested == "compiled":
        raise RecipeError(
            "--step compiled: the compiled step runs in one process here; a split set runs --step modules",
            hint="pass --step modules, or leave --step out",
        )
    return "modules"


def build_rank_decoder(model: Any, max_len: int, batch: int, step: DecodeStep) -> Any:
    """:func:`~prepkit.generation.steps.build_decoder`, with the collectives passed to a step
    that takes them (only over several ranks)."""
    comm = collectives_of(model)
    if comm is None or not decoder_takes_collectives():
        return build_decoder(model, max_len, batch, step)
    from prepkit.integrations.static_decode import PrepkitDecoder

    collectives: dict[str, Any] = {"reduce": comm.all_reduce, "gather": comm.gather}
    return PrepkitDecoder(model, max_len, batch_size=batch, compile=step == "compiled", **collectives)
