"""A small word-level tokenizer for a synthetic checkpoint (``prepkit synth --tokenizer``), so that
``AutoTokenizer.from_pretrained`` and chat formatting can be tried without the real model.

Its ids fill exactly the config's vocabulary: the four special ids the synthetic config names
(bos, pad, eos, <|call|>: :func:`prepkit.synth.special_token_ids`) hold gpt-oss's tokens of those
roles, the chat markers and an unknown token come first, then plain words. Built with the
``tokenizers`` library (transformers brings it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from prepkit.distribution import install_hint
from prepkit.errors import DependencyError, RecipeError
from prepkit.fsutil import write_json_atomic

# gpt-oss's tokens for the roles of the config's special ids
SPECIAL_TOKENS = {"bos": "<|startoftext|>", "pad": "<|endoftext|>", "eos": "<|return|>", "call": "<|call|>"}
# the markers of the harmony chat format that the template below writes, and the unknown word
CHAT_TOKENS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>")
UNKNOWN = "<|unk|>"
# A gpt-oss-shaped chat template: a turn is <|start|>role<|message|>text<|end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# Words first in the vocabulary, so short English prompts (and the roles) tokenize to themselves.
COMMON_WORDS = (
    *("user", "assistant", "system", "developer", "hello", "world", "hi", "please", "thanks", "yes", "no"),
    *("the", "a", "an", "is", "are", "was", "and", "or", "of", "to", "in", "on", "for", "with", "it", "this"),
    *("that", "you", "i", "we", "what", "how", "why", "who", "where", "when", ".", ",", "?", "!", ":", "'"),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MIN_VOCAB = len(SPECIAL_TOKENS) + len(CHAT_TOKENS) + 1 + len(COMMON_WORDS)


def vocabulary(special_ids: dict[str, int], vocab_size: int) -> dict[str, int]:
    """Token -> id for every id below ``vocab_size``: the special tokens at ``special_ids``, the
    rest filled in order with the chat markers, the unknown token, common words, then ``w<N>``."""
    _check_vocab(vocab_size)
    placed = {special_ids[role]: token for role, token in SPECIAL_TOKENS.items()}
    fill = [*CHAT_TOKENS, UNKNOWN, *COMMON_WORDS]
    vocab: dict[str, int] = {}
    words = iter(fill)
    n = 0
    for token_id in range(vocab_size):
        if token_id in placed:
            vocab[placed[token_id]] = token_id
            continue
        token = next(words, None)
        if token is None:
            token, n = f"w{n}", n + 1
        vocab[token] = token_id
    return vocab


def check_can_write(vocab_size: int) -> None:
    """What :func:`write_tokenizer` needs, checked before a checkpoint's first byte is written.

    Raises:
        DependencyError: the ``tokenizers`` library is not installed.
        RecipeError: ``vocab_size`` cannot hold the tokenizer's fixed tokens.
    """
    if importlib.util.find_spec("tokenizers") is None:
        raise DependencyError(
            "synth --tokenizer needs the tokenizers library, which is not installed",
            hint=install_hint("transformers"),
        )
    _check_vocab(vocab_size)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise RecipeError(
            f"--vocab {vocab_size} is too small for a tokenizer (it needs at least {MIN_VOCAB} ids)",
            hint=f"use --vocab {MIN_VOCAB} or more, or leave out --tokenizer",
        )


def write_tokenizer(folder: Path, special_ids: dict[str, int], vocab_size: int) -> list[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) into
    ``folder``; returns their names.

    Raises:
        DependencyError: the ``tokenizers`` library is not installed.
        RecipeError: ``vocab_size`` cannot hold the tokenizer's fixed tokens.
    """
    try:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    except ImportError as err:
        raise DependencyError(
            "synth --tokenizer needs the tokenizers library, which is not installed",
            hint=install_hint("transformers"),
        ) from err
    vocab = vocabulary(special_ids, vocab_size)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN))
    tokenizer.normalizer = normalizers.Lowercase()  # "Hello" is the word hello, not unknown
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([*SPECIAL_TOKENS.values(), *CHAT_TOKENS, UNKNOWN])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "unk_token": UNKNOWN,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    write_json_atomic(folder / "tokenizer_config.json", config, sort_keys=False)
    return list(TOKENIZER_FILES)
