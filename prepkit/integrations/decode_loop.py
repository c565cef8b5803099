"""The host's side of a decode loop: reading each step's ids back one step behind the device,
keeping each row's tokens and where it ended, streamers and stop checks, left padding and the
EOS rule of transformers' ``generate``. Pure host code on small tensors: nothing here touches
the device except the one asynchronous copy a step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TokenStreamer(Protocol):
    """transformers' streamer interface (``TextStreamer`` fits): ``put`` gets the prompt's ids
    first, then each step's new ids ``[batch]``; ``end`` once, after the last."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


# Called with each step's new ids ``[batch]`` (host): returns the rows to stop now (stop strings).
StopCheck = Callable[[torch.Tensor], "set[int] | None"]


@dataclass
class DecodeStats:
    """Where the last ``generate`` call's time went. ``decode_s`` covers the steps after the first
    (the first one warms up and captures the graph: ``first_step_s``)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    first_step_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """New tokens per second per row over the timed steps."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def left_padding(attention_mask: torch.Tensor | None, batch: int, prompt: int) -> torch.Tensor:
    """Each row's count of left-padding slots ``[batch]`` from transformers' ``attention_mask``.

    Raises:
        ValueError: a mask of another shape, or one with padding anywhere but on the left, or a
            row with no token.
    """
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long)
    mask = attention_mask.cpu().long()
    if tuple(mask.shape) != (batch, prompt):
        raise ValueError(f"attention_mask is {list(mask.shape)}, input_ids {[batch, prompt]}")
    pad = (mask == 0).long().cumprod(1).sum(1)  # leading zeros per row
    if not torch.equal(mask.sum(1), prompt - pad):
        raise ValueError("attention_mask pads a row elsewhere than on the left; left-pad the prompts")
    if bool((pad == prompt).any()):
        raise ValueError("attention_mask leaves a row without any token")
    return pad


class Readback:
    """Each step's ids copied to pinned host memory behind an event and read a step later, so
    the host does not wait for the step it just launched. At most two steps are in flight."""

    def __init__(self, next_ids: torch.Tensor, batch: int) -> None:
        self.source = next_ids[:batch, 0]
        on_cuda = next_ids.device.type == "cuda"
        self.buffers = [torch.empty(batch, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self.queue: deque[int] = deque()
        self.count = 0

    def in_flight(self) -> int:
        return len(self.queue)

    def launch(self) -> None:
        assert len(self.queue) < 2, "collect a step before launching a third"
        slot = self.count % 2
        self.buffers[slot].copy_(self.source, non_blocking=True)
        event = self.events[slot]
        if event is not None:
            event.record()
        self.queue.append(slot)
        self.count += 1

    def collect(self) -> torch.Tensor:
        """The oldest launched step's ids, waiting for them."""
        slot = self.queue.popleft()
        event = self.events[slot]
        if event is not None:
            event.synchronize()
        return self.buffers[slot].clone()


class Rows:
    """The host's record of each row's new tokens and where each row ended."""

    def __init__(self, batch: int, eos_ids: list[int]) -> None:
        self.eos = set(eos_ids)
        self.new: list[torch.Tensor] = []
        self.end: list[int | None] = [None] * batch  # new tokens kept per finished row

    def add(self, tokens: torch.Tensor, fill: int) -> torch.Tensor:
        """Record a step's tokens; rows that ended before it get ``fill`` (returned as kept)."""
        ended = torch.tensor([end is not None for end in self.end])
        tokens = tokens.masked_fill(ended, fill)
        self.new.append(tokens)
        count = len(self.new)
        for row, token in enumerate(tokens.tolist()):
            if self.end[row] is None and token in self.eos:
                self.end[row] = count
        return tokens

    def stop(self, row: int) -> None:
        if self.end[row] is None:
            self.end[row] = len(self.new)

    def all_done(self) -> bool:
        return all(end is not None for end in self.end)

    def kept_tokens(self) -> int:
        return sum(len(self.new) if end is None else end for end in self.end)

    def result(self, prompt_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
        if not self.new:
            return prompt_ids
        new = torch.stack(self.new, dim=1)
        if pad_id is not None:
            for row, end in enumerate(self.end):
                if end is not None:
                    new[row, end:] = pad_id
        ends = [len(self.new) if end is None else end for end in self.end]
        return torch.cat([prompt_ids, new[:, : max(ends)]], dim=1)


def ids_of(value: Any) -> list[int]:
    """A generation config's id field (None, one id, or several) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, Sequence | torch.Tensor) else [int(value)]


def stop_at_eos(tokens: torch.Tensor, prompt: int, eos_ids: list[int], pad_id: int | None) -> torch.Tensor:
    """What greedy ``generate`` keeps of ``tokens`` ``[batch, prompt + new]``: a row's tokens after
    its first EOS become ``pad_id``, and the columns after the step where every row has finished go."""
    if not eos_ids:
        return tokens
    new = tokens[:, prompt:]
    is_eos = torch.isin(new, torch.tensor(eos_ids, dtype=new.dtype))
    finished_after = is_eos.long().cumsum(1) > 0  # at or after the first EOS
    past_eos = torch.cat([torch.zeros_like(finished_after[:, :1]), finished_after[:, :-1]], dim=1)
    if pad_id is not None:
        new = new.masked_fill(past_eos, pad_id)
    all_done = finished_after.all(0).nonzero()
    keep = int(all_done[0]) + 1 if len(all_done) else new.shape[1]
    return torch.cat([tokens[:, :prompt], new[:, :keep]], dim=1)
