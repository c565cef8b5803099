"""A small real tokenizer (word level, built with the ``tokenizers`` library) written into a model
folder as the hub's gpt-oss repo ships one: ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json`` and ``chat_template.jinja``."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>")
TOKENIZER_FILES = ("chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")


def write_tokenizer_files(folder: Path, vocab_size: int) -> list[str]:
    """Write the tokenizer files into ``folder``; ids stay below ``vocab_size``. Returns their names."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL) - 1)]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(SPECIAL)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL))
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "[UNK]"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return list(TOKENIZER_FILES)
