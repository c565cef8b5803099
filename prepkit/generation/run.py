"""``prepkit generate``'s work as a library call: check, load, encode, decode, report.

Everything that can be checked without the weights is checked first (folder, tokenizer, chat
template, sampling values, context, device memory), so bad input fails before loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prepkit.distributed.decoder import build_rank_decoder
from prepkit.distributed.group import from_rank0
from prepkit.distributed.model_hooks import split_label, split_of
from prepkit.distributed.session import start_ranks
from prepkit.generation import loading
from prepkit.generation.sampling import SamplingParams, new_seed
from prepkit.generation.steps import DecodeStep, default_step
from prepkit.generation.text import TextStream, encode_prompts, left_pad
from prepkit.integrations.decode_loop import ids_of
from prepkit.integrations.gpt_oss_loader import read_generation_config


@dataclass(frozen=True)
class GenerateRequest:
    folder: Path
    prompts: tuple[str, ...] = ()
    stdin_text: str | None = None
    chat: bool = False
    max_new_tokens: int = 256
    max_len: int | None = None
    greedy: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    activations: str = "bf16"
    device: str = "cuda"
    step: DecodeStep | None = None


@dataclass
class GenerateResult:
    texts: list[str]
    prompt_tokens: int
    new_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    first_step_s: float
    load_s: float
    seed: int
    sampling: str
    step: str
    device: str
    finish: list[str] = field(default_factory=list)  # per row: "eos", "stop" or "length"
    ranks: dict[str, Any] | None = None  # the split and its sum (model_hooks.split_of)

    def summary(self) -> str:
        split = split_label(self.ranks)
        return (
            f"prompt {self.prompt_tokens} tokens, {self.new_tokens} new; prefill {self.prefill_tok_s:.1f} tok/s, "
            f"decode {self.decode_tok_s:.1f} tok/s ({self.sampling}, seed {self.seed}, {self.step} step, "
            f"{f'{split}, ' if split else ''}load {self.load_s:.1f} s, first step {self.first_step_s:.2f} s)"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def generate_text(request: GenerateRequest, write: Callable[[str], None] | None = None) -> GenerateResult:
    """Run ``request``; row 0's text goes to ``write`` as it is decoded (batch 1), every row's
    text is in the result.

    Raises:
        PrepkitError: bad input of any kind, before the weights load (see :mod:`loading`).
    """
    loading.check_dependencies()
    group = start_ranks(request.device, request.folder)
    manifest = loading.open_prepared(request.folder, group.world_size if group else 1)
    stdin_text, seed = request.stdin_text, request.seed
    if group is not None:  # every rank decodes rank 0's prompt with rank 0's seed
        seed = new_seed() if seed is None else seed
        stdin_text, seed = from_rank0(group, (stdin_text, seed))
    tokenizer = loading.load_tokenizer(request.folder, chat=request.chat)
    generation_config = read_generation_config(request.folder)
    sampling = SamplingParams.create(
        greedy=request.greedy,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        defaults=generation_config,
    )
    rows = encode_prompts(tokenizer, request.prompts, chat=request.chat, stdin_text=stdin_text)
    width = max(len(r) for r in rows)
    max_len = loading.check_context(manifest, width, request.max_new_tokens, request.max_len)
    device = group.device if group is not None else loading.resolve_device(request.device)
    loading.check_fits(manifest, device, len(rows), max_len, rank=group.rank if group else 0)
    seed = new_seed() if seed is None else seed

    loaded = loading.load_model(request.folder, manifest, device, request.activations)
    model = loaded.model
    step = request.step or default_step(device, len(rows))
    pad_id = _pad_id(model, tokenizer)
    input_ids, mask = left_pad(rows, pad_id)
    decoder = build_rank_decoder(model, max_len, len(rows), step)
    end_ids = _end_ids(model)
    stream = TextStream(
        tokenizer,
        len(rows),
        stop_strings=request.stop,
        end_ids=end_ids,
        write=write if len(rows) == 1 else None,
    )
    decoder.generate(
        input_ids,
        request.max_new_tokens,
        attention_mask=mask,
        sampling=sampling,
        seed=seed,
        streamer=stream,
        stop=stream,
    )
    stats = decoder.stats
    return GenerateResult(
        texts=stream.texts,
        prompt_tokens=stats.prompt_tokens,
        new_tokens=stats.new_tokens,
        prefill_tok_s=stats.prefill_tps,
        decode_tok_s=stats.decode_tps * len(rows),
        first_step_s=stats.first_step_s,
        load_s=loaded.load_s,
        seed=seed,
        sampling=sampling.describe(),
        step=step,
        device=loading.device_name(device),
        finish=[why or "length" for why in stream.stopped],
        ranks=split_of(manifest, model),
    )


def _pad_id(model: Any, tokenizer: Any) -> int:
    for value in (model.generation_config.pad_token_id, tokenizer.pad_token_id, model.config.pad_token_id):
        if value is not None:
            return int(value)
    ends = _end_ids(model)
    return ends[0] if ends else 0


def _end_ids(model: Any) -> list[int]:
    return ids_of(model.generation_config.eos_token_id)
