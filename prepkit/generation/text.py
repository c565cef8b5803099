"""From text to ids and back, as a run goes: the prompt (plain or through the chat template), and
each row's new ids decoded incrementally, with stop strings cut and the text streamed out.

Decoding a token at a time can split a character over tokens (byte-level vocabularies); the
stream holds back text that ends in a replacement character, and the last ``len(stop) - 1``
characters that could still begin a stop string, until the next token settles them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from prepkit.errors import RecipeError

REPLACEMENT = "\ufffd"


def chat_messages(prompt: str | None, stdin_text: str | None) -> list[dict[str, str]]:
    """The messages of a chat run: ``prompt`` as the user's message, else stdin as either a JSON
    list of ``{"role", "content"}`` objects or plain text (one user message).

    Raises:
        RecipeError: no prompt and empty stdin, or a JSON list whose items are not messages.
    """
    text = prompt if prompt is not None else (stdin_text or "")
    if not text.strip():
        raise RecipeError("no prompt: pass --prompt TEXT, or the messages on stdin")
    if prompt is None and text.lstrip().startswith("["):
        try:
            messages = json.loads(text)
        except json.JSONDecodeError as err:
            raise RecipeError(f"stdin looks like JSON messages but does not parse: {err}") from err
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise RecipeError('stdin: expected a JSON list of {"role": ..., "content": ...} messages')
        return messages
    return [{"role": "user", "content": text}]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str], *, chat: bool, stdin_text: str | None = None
) -> list[list[int]]:
    """Token ids of each prompt: the text as the tokenizer encodes it, or with ``chat`` the chat
    template applied to its messages (ending in the assistant's turn).

    Raises:
        RecipeError: a prompt that encodes to no token.
    """
    if chat:
        sources = [chat_messages(p, None) for p in prompts] if prompts else [chat_messages(None, stdin_text)]
        encoded = [_chat_ids(tokenizer, messages) for messages in sources]
    else:
        texts = list(prompts) or [stdin_text or ""]
        if not any(t.strip() for t in texts):
            raise RecipeError("no prompt: pass --prompt TEXT, or the text on stdin")
        encoded = [list(tokenizer(text)["input_ids"]) for text in texts]
    for index, ids in enumerate(encoded):
        if not ids:
            raise RecipeError(f"prompt {index + 1} encodes to no token")
    return encoded


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` for rows of different lengths, left-padded with ``pad_id``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[index, width - len(row) :] = 1
    return ids, mask


class TextStream:
    """A streamer for :class:`~prepkit.integrations.static_decode.PrepkitDecoder` that decodes
    each row's new ids, cuts them at the first stop string, and hands row 0's settled text to
    ``write`` as it comes (``write=None``: nothing streamed). ``texts`` holds every row's text.

    It is also the decoder's stop check: a row whose text reached a stop string stops there.
    """

    def __init__(
        self,
        tokenizer: Any,
        batch: int,
        *,
        stop_strings: Sequence[str] = (),
        end_ids: Sequence[int] = (),
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.end_ids = set(end_ids)
        self.write = write
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.texts = [""] * batch
        # Per row, the ids decoded so far are ids[:read]; ids[prefix:read] give the context the
        # next ids are decoded in (a token's text can depend on the one before it).
        self._prefix = [0] * batch
        self._read = [0] * batch
        self.stopped: list[str | None] = [None] * batch  # why each row ended: "eos", "stop"
        self._written = 0
        self._reported: set[int] = set()  # rows already handed to the decoder as stopped
        self._prompt_seen = False
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the prompt's ids come first
            self._prompt_seen = True
            return
        for row, token in enumerate(value.reshape(-1).tolist()):
            if self.stopped[row] is not None:
                continue
            if token in self.end_ids:
                self.stopped[row] = "eos"
                continue
            self.ids[row].append(int(token))
            self._settle(row)
        self._flush(final=False)

    def __call__(self, new: torch.Tensor) -> set[int]:
        """The rows that reached a stop string with this step (the decoder stops them)."""
        fresh = {row for row, why in enumerate(self.stopped) if why == "stop"} - self._reported
        self._reported |= fresh
        return fresh

    def end(self) -> None:
        self._flush(final=True)

    def _settle(self, row: int) -> None:
        ids, prefix, read = self.ids[row], self._prefix[row], self._read[row]
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=False)
        after = self.tokenizer.decode(ids[prefix:], skip_special_tokens=False)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return  # no whole character yet
        delta = after[len(before) :]
        self._prefix[row], self._read[row] = read, len(ids)
        start = max(0, len(self.texts[row]) - self._hold)
        text = self.texts[row] + delta
        for stop in self.stop_strings:
            at = text.find(stop, start)
            if at >= 0:
                text = text[:at]
                self.stopped[row] = "stop"
        self.texts[row] = text

    def _flush(self, final: bool) -> None:
        if self.write is None:
            return
        text = self.texts[0]
        settled = len(text)
        if not final and self.stopped[0] is None:
            settled -= self._hold  # may still begin a stop string
        if settled > self._written:
            self.write(text[self._written : settled])
            self._written = settled
