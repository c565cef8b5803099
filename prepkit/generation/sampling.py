"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p, as
pure tensor functions that a CUDA graph can capture.

The random numbers are a counter-based hash of (seed, position, row, vocabulary index), computed
with integer tensor ops: no generator state lives on the host or advances between calls, so a
captured step replays the same draw for the same seed and position, a run with one seed repeats
exactly, and the CPU and the GPU draw the same numbers. Sampling adds Gumbel noise to the
filtered logits and takes the argmax, which draws each token with its softmax probability
without ``torch.multinomial`` (whose CUDA kernel may sync with the host).

The filters follow transformers' order and rules: temperature divides the logits, top-k keeps the
k largest, top-p keeps the smallest set of the largest whose probabilities reach p (at least one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from prepkit.errors import RecipeError

# transformers' own defaults for a generation config that leaves a value unset.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 1.0

_MASK32 = 0xFFFFFFFF
TOP_K_CHUNKS = 64  # slices of the vocabulary a large top-k is first taken over


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``greedy`` ignores the rest; ``top_k`` 0 and ``top_p`` 1.0
    switch those filters off. Frozen and hashable: a decoder keeps one captured step per value."""

    greedy: bool = True
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0
    top_p: float = DEFAULT_TOP_P

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @classmethod
    def create(
        cls,
        *,
        greedy: bool = False,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        defaults: Any = None,
    ) -> SamplingParams:
        """Params from explicit values, each unset one taken from ``defaults`` (a transformers
        ``GenerationConfig`` or anything with its attribute names), then transformers' defaults.
        Unless ``do_sample`` says, a run samples when a sampling value is given here or when
        ``defaults.do_sample`` is true. Temperature 0 means greedy (as llama.cpp's ``--temp 0``).

        Raises:
            RecipeError: a negative temperature, ``top_p`` outside (0, 1], a negative ``top_k``.
        """
        if do_sample is None:
            given = any(v is not None for v in (temperature, top_k, top_p))
            do_sample = given or bool(getattr(defaults, "do_sample", False))

        def pick(value: Any, name: str, fallback: Any) -> Any:
            if value is not None:
                return value
            configured = getattr(defaults, name, None)
            return fallback if configured is None else configured

        chosen_temperature = float(pick(temperature, "temperature", DEFAULT_TEMPERATURE))
        chosen_top_k = int(pick(top_k, "top_k", DEFAULT_TOP_K))
        chosen_top_p = float(pick(top_p, "top_p", DEFAULT_TOP_P))
        check_sampling(chosen_temperature, chosen_top_k, chosen_top_p)
        if greedy or not do_sample or chosen_temperature == 0.0:
            return cls(greedy=True)
        return cls(greedy=False, temperature=chosen_temperature, top_k=chosen_top_k, top_p=chosen_top_p)

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts.append(f"top-k {self.top_k}" if self.top_k else "no top-k")
        parts.append(f"top-p {self.top_p:g}" if self.top_p < 1.0 else "no top-p")
        return ", ".join(parts)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise RecipeError naming the first value no sampler can use."""
    if not temperature >= 0.0 or temperature == float("inf"):
        raise RecipeError(f"temperature: {temperature} is not a number >= 0", hint="use 0 for greedy decoding")
    if not 0.0 < top_p <= 1.0:
        raise RecipeError(f"top-p: {top_p} is not in (0, 1]", hint="1.0 keeps every token; --greedy decodes greedily")
    if top_k < 0:
        raise RecipeError(f"top-k: {top_k} is negative", hint="0 keeps every token")


def new_seed() -> int:
    """A fresh random seed (reported with the run, so it can be repeated)."""
    return int.from_bytes(os.urandom(4), "little")


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    # x * constant mod 2**32 in int64 without overflow: the constant's two 16-bit halves apart.
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (xor-shift and multiply rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` floats in (0, 1), a pure function of the scalar tensors ``seed`` and
    ``position`` and of each element's row and column."""
    device = seed.device
    key = _mix32((_mix32(seed.long() & _MASK32) ^ (position.long() & _MASK32)) & _MASK32)
    row = torch.arange(rows, device=device, dtype=torch.long)[:, None]
    col = torch.arange(cols, device=device, dtype=torch.long)[None, :]
    bits = _mix32(col ^ _mix32(row ^ key))
    # 24 bits, centred in their interval: never 0 or 1, exact in fp32.
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _slices(scores: torch.Tensor, chunks: int) -> tuple[torch.Tensor, int]:
    """``[B, V]`` -> ``[B, chunks, width]`` slices of the vocabulary (the last padded with -inf,
    which no top-k or argmax picks over a real value) and ``width``."""
    batch, vocab = scores.shape
    width = -(-vocab // chunks)
    padded = torch.nn.functional.pad(scores, (0, chunks * width - vocab), value=float("-inf"))
    return padded.view(batch, chunks, width), width


def top_k(scores: torch.Tensor, k: int, chunks: int = TOP_K_CHUNKS) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k)`` over the last dim of ``[B, V]``, in two stages for a large ``V``: the
    top ``k`` of each of ``chunks`` slices, then the top ``k`` of those. One row's top-k over a
    201,088-token vocabulary runs on one block of the GPU; sliced, on ``chunks`` blocks at once,
    and the global top ``k`` is always among the slices' own."""
    batch, vocab = scores.shape
    if vocab < chunks * k * 8:
        return scores.topk(k, dim=-1)
    sliced, width = _slices(scores, chunks)
    values, index = sliced.topk(k, dim=-1)
    index = index + torch.arange(0, chunks * width, width, device=scores.device)[None, :, None]
    values, pick = values.view(batch, -1).topk(k, dim=-1)
    return values, index.view(batch, -1).gather(-1, pick)


def argmax(scores: torch.Tensor, chunks: int = TOP_K_CHUNKS) -> torch.Tensor:
    """``scores.argmax(-1)`` of ``[B, V]`` (the first largest; a NaN counts as largest), in two
    stages for a large ``V`` as :func:`top_k` does: one row's argmax over the whole vocabulary
    is one block's work on the GPU, ``chunks`` slices spread it (docs/decode.md)."""
    if scores.shape[-1] < chunks * 64:
        return scores.argmax(-1)
    sliced, width = _slices(scores, chunks)
    index = sliced.argmax(-1, keepdim=True)
    pick = sliced.gather(-1, index)[..., 0].argmax(-1, keepdim=True)
    return (index[..., 0].gather(-1, pick)[:, 0] + pick[:, 0] * width).long()


def sample(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[B, V]`` -> ``[B]`` (long). ``seed`` and
    ``position`` (scalar tensors, on the logits' device) key the random draw."""
    if params.greedy:
        return argmax(logits)
    scores = logits.float() / params.temperature
    index: torch.Tensor | None = None
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        scores, index = top_k(scores, params.top_k)  # sorted, largest first
    elif params.top_p < 1.0:
        scores, index = scores.sort(dim=-1, descending=True)
    if params.top_p < 1.0:
        probs = scores.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # the first candidate always has 0 before it
        scores = scores.masked_fill(mass_before >= params.top_p, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seed, position, *scores.shape)))
    choice = argmax(scores + gumbel)
    if index is None:
        return choice
    return index.gather(-1, choice[:, None])[:, 0]
