"""Each rank's share of the dense (non-expert) weights: attention by heads, the head by
vocabulary rows, the rest whole. The rule is one for every launch: the world's ranks split the
attention heads and the vocabulary among themselves, whatever the set's tp x ep, so that one
all-reduce over all ranks serves both the o-projection's partial sums and the MoE's (each rank's
experts as prepared), and one all-gather the logits.

Slicing happens at load, from the shared files: ``prepare`` writes the dense weights once for
every split (see docs/distributed.md, why not split files)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prepkit.errors import LayoutError

Placement = Literal["whole", "rows", "cols", "rank0", "none"]


@dataclass(frozen=True)
class DenseSplit:
    """Rank ``index`` of ``parts``: which heads and vocabulary rows it holds."""

    parts: int
    index: int
    heads: int  # query heads of the model
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any, parts: int, index: int) -> DenseSplit:
        """The share of rank ``index`` of ``parts`` for a transformers gpt-oss ``config``.

        Raises:
            LayoutError: the kv heads or the vocabulary do not divide evenly among the ranks (named).
        """
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        vocab = int(config.vocab_size)
        for what, count in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads), ("vocab_size", vocab)):
            if count % parts:
                raise LayoutError(
                    f"{what}: {count} does not divide among {parts} ranks; the attention heads and the vocabulary "
                    "are split evenly over every rank",
                    hint=f"run with a number of ranks that divides {kv_heads} (prepare with such a tp x ep)",
                )
        return cls(parts, index, heads, kv_heads, head_dim, vocab)

    @property
    def local_heads(self) -> int:
        return self.heads // self.parts

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.parts

    @property
    def local_vocab(self) -> int:
        return self.vocab // self.parts

    def placement(self, name: str) -> tuple[Placement, int, int]:
        """How tensor ``name`` loads on this rank: ``("rows"|"cols", lo, hi)`` a slice of dim 0 or
        1, ``("whole", 0, 0)``, ``("rank0", 0, 0)`` whole on rank 0 and absent elsewhere (a bias
        added after the sum must be added once), or ``("none", 0, 0)`` absent here."""
        owner, _, leaf = name.rpartition(".")
        module = owner.rpartition(".")[2]
        q = self.local_heads * self.head_dim
        kv = self.local_kv_heads * self.head_dim
        if module == "q_proj" or (module == "self_attn" and leaf == "sinks"):
            width = q if module == "q_proj" else self.local_heads
            return "rows", self.index * width, (self.index + 1) * width
        if module in ("k_proj", "v_proj"):
            return "rows", self.index * kv, (self.index + 1) * kv
        if module == "o_proj":
            if leaf == "bias":
                return ("rank0" if self.index == 0 else "none"), 0, 0
            return "cols", self.index * q, (self.index + 1) * q
        if name == "lm_head.weight":
            return "rows", self.index * self.local_vocab, (self.index + 1) * self.local_vocab
        return "whole", 0, 0

    def local_config(self, config: Any) -> Any:
        """A copy of ``config`` with this rank's head counts (the head dim kept explicit)."""
        local = type(config).from_dict(config.to_dict())
        local.head_dim = self.head_dim
        local.num_attention_heads = self.local_heads
        local.num_key_value_heads = self.local_kv_heads
        return local
