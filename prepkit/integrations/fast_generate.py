"""``model.generate(...)`` on prepkit's graph-captured decode step.

A model from :func:`~prepkit.integrations.transformers.from_prepared` (or
:func:`~prepkit.integrations.transformers.use_prepkit_moe`) gets a ``generate`` that takes the
fast path, :class:`~prepkit.integrations.static_decode.PrepkitDecoder`, for the calls it
supports: ``input_ids`` with an optional left-padding ``attention_mask``, ``max_new_tokens`` or
``max_length``, greedy or sampled with ``temperature``, ``top_k``, ``top_p``, a ``streamer``,
EOS and pad ids. Any other call (beams, penalties, logits processors, returned scores, a cache
of the caller's...) runs transformers' own loop, with one warning that names what sent it there.

The override is an instance attribute, the way transformers itself installs a repository's
``custom_generate``: the model stays a ``GptOssForCausalLM`` (``isinstance``, ``save_pretrained``
and hooks unchanged), and ``type(model).generate(model, ...)`` still reaches transformers' loop.
Sampled calls draw their seed from torch's global generator, so ``torch.manual_seed(s)`` before
a call repeats it, as it does for transformers' own sampling.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from prepkit.generation.sampling import SamplingParams
from prepkit.generation.steps import DecodeStep, build_decoder, default_step
from prepkit.integrations.decode_loop import ids_of
from prepkit.warn_once import warn_once

# Generation-config fields the fast path reads, or that change nothing it computes.
_HANDLED = {
    "max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "pad_token_id",
    "bos_token_id", "eos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
    "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "early_stopping", "length_penalty", "low_memory", "prefill_chunk_size",
}  # fmt: skip
# Fields whose value here is what the fast path does anyway.
_NEUTRAL: dict[str, Any] = {
    "num_beams": 1, "num_return_sequences": 1, "use_cache": True, "repetition_penalty": 1.0,
    "min_length": 0, "min_new_tokens": 0, "typical_p": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "renormalize_logits": False, "remove_invalid_values": False,
    "output_attentions": False, "output_hidden_states": False, "output_scores": False, "output_logits": False,
    "return_dict_in_generate": False, "num_beam_groups": 1, "diversity_penalty": 0.0, "guidance_scale": 1.0,
}  # fmt: skip
_MODEL_KWARGS = {"attention_mask"}
MAX_LEN_STEP = 256  # caches grow in these steps, so nearby lengths share one decoder and graph


class FallbackWarning(UserWarning):
    """A ``generate`` call that prepkit's fast step cannot serve ran transformers' own loop."""


def enable_fast_generate(model: Any, step: DecodeStep | None = None) -> Any:
    """Give ``model`` the fast ``generate`` (see the module); returns the model."""
    model._prepkit_decoders = {}
    model._prepkit_step = step
    model.generate = functools.partial(fast_generate, model)
    return model


def unsupported(config: Any, model_kwargs: dict[str, Any]) -> str | None:
    """Why the fast path cannot serve a call with this merged generation config and these model
    keyword arguments, or None when it can."""
    for key, value in config.to_dict().items():
        if value is None or key in _HANDLED:
            continue
        if key in _NEUTRAL and value == _NEUTRAL[key]:
            continue
        return f"{key}={value!r}"
    for key, value in model_kwargs.items():
        if key not in _MODEL_KWARGS and value is not None:
            return f"the argument {key}"
    return None


@torch.no_grad()
def fast_generate(
    model: Any,
    inputs: torch.Tensor | None = None,
    generation_config: Any = None,
    streamer: Any = None,
    **kwargs: Any,
) -> Any:
    """transformers' ``generate`` signature; see the module for which calls run the fast step."""
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    model_kwargs = config.update(**kwargs)
    reason = None if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else "input_ids not a 2-D tensor"
    reason = reason or unsupported(config, model_kwargs)
    if reason is None:
        new_tokens = _new_tokens(config, input_ids.shape[1])
        reason = "no new tokens asked for" if new_tokens < 1 else None
    if reason is not None:
        warn_once(
            ("fast-generate", reason),
            f"prepkit's fast decode step does not support {reason}; this call runs transformers' own "
            "generate loop (much slower)",
            FallbackWarning,
            stacklevel=3,
        )
        return type(model).generate(model, inputs, generation_config=generation_config, streamer=streamer, **kwargs)
    sampling = SamplingParams.create(do_sample=bool(config.do_sample), defaults=config)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if not sampling.greedy else 0
    eos = ids_of(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    decoder = _decoder(model, input_ids.shape[0], input_ids.shape[1] + new_tokens, eos, pad)
    out = decoder.generate(
        input_ids,
        new_tokens,
        attention_mask=model_kwargs.get("attention_mask"),
        sampling=sampling,
        seed=seed,
        streamer=streamer,
    )
    return out.to(input_ids.device)


def _new_tokens(config: Any, prompt: int) -> int:
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    return int(config.max_length if config.max_length is not None else 20) - prompt


def _decoder(model: Any, batch: int, length: int, eos: list[int], pad: int | None) -> Any:
    """A decoder for this batch whose cache holds ``length`` tokens, kept on the model for the
    next call (its graphs with it)."""
    max_len = -(-length // MAX_LEN_STEP) * MAX_LEN_STEP
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        max_len = max(length, min(max_len, int(limit)))
    key = (batch, tuple(eos), pad)
    decoder = model._prepkit_decoders.get(key)
    if decoder is None or decoder.max_len < length:
        model._prepkit_decoders.pop(key, None)  # frees the old cache before the new one is made
        step = model._prepkit_step or default_step(model.model.embed_tokens.weight.device, batch)
        decoder = build_decoder(model, max_len, batch, step, eos_ids=eos, pad_id=pad)
        model._prepkit_decoders[key] = decoder
    return decoder
