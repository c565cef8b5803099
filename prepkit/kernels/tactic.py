"""A tactic is a value: one kernel variant's knobs, for one GEMM of the MoE layer.

The knob table is the :class:`GemmTactic` dataclass itself: each field carries its :class:`Knob`
(the values it takes, its tag in the key, how its default is written), and :data:`KNOBS` lists them
in field order. The JSON form, the key, the variant space (:mod:`prepkit.kernels.variants`), the
compile check's families (:func:`prepkit.kernels.compile_check.family`) and the launchers' checks
all read the table, so a new knob is one field here, its validity rule in
:func:`~prepkit.kernels.variants.invalid_reason`, and the kernel code that reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Knob:
    """One launch knob of :class:`GemmTactic`."""

    name: str
    # The values the variant space holds, in enumeration order. For a path knob (``family``) these
    # are every value the kernel implements; tile knobs are sizes the tuner explores, and the
    # launchers accept any size the kernel's tile rule allows.
    domain: tuple[Any, ...]
    default: Any
    tag: str  # prefix of the value in the key: "m16", "uasm"
    # Knobs added after tactics were first stored omit their default, so stored keys and JSON rows
    # (and the hashes of those rows) stay what they were.
    key_omits_default: bool = False
    json_omits_default: bool = False
    # A code path of the kernel (how weights are decoded, loaded, multiplied, how the K loop ends):
    # its value names the compile check's variant family; the other knobs vary inside a family.
    family: bool = False
    # A path of swapped tiles only (the weights as the MMA's M side, the bf16 upcast): part of the
    # family of those tiles alone.
    swapped_only: bool = False

    def reject(self, value: Any) -> str | None:
        """Why ``value`` is outside the domain, or ``None``."""
        if value in self.domain:
            return None
        if self.family:
            return f"unknown {self.name} {value!r} (expected one of {self.domain})"
        return f"{self.name}={value} not in {self.domain}"

    def written(self, value: Any, omits_default: bool) -> bool:
        return not (omits_default and value == self.default)


def _knob(default: Any, domain: tuple[Any, ...], tag: str, **spec: bool) -> Any:
    """A :class:`GemmTactic` field with its knob (named after the field in :data:`KNOBS`)."""
    return field(default=default, metadata={"knob": {"domain": domain, "default": default, "tag": tag, **spec}})


_PATH = {"key_omits_default": True, "family": True}
# Path knobs added after the JSON form of the first stored tactics.
_LATE_PATH = {**_PATH, "json_omits_default": True}


@dataclass(frozen=True, order=True)
class GemmTactic:
    """Launch knobs of one GEMM (GEMM1 = gate/up + SwiGLU, GEMM2 = down + combine)."""

    block_m: int = _knob(16, (16, 32, 64, 128), "m")
    block_n: int = _knob(64, (32, 64, 128, 256), "n")
    # Divisors of the layout's 256-element K panel (a K step never crosses a panel).
    block_k: int = _knob(128, (64, 128, 256), "k")
    num_warps: int = _knob(4, (4, 8), "w")
    num_stages: int = _knob(3, (1, 2, 3, 4), "s")
    split_k: int = _knob(1, (1, 2, 4, 8), "sk")
    # How fp4 becomes a matrix-unit operand: "bits" (integer unpack + scale in registers, then a
    # bf16 dot; works on every arch), "asm" (the same in inline PTX, CUDA only) or "dot_scaled"
    # (tl.dot_scaled; native where the arch has block-scaled MMA, emulated by the compiler elsewhere).
    upcast: str = _knob("bits", ("bits", "asm", "dot_scaled"), "u", **_PATH)
    # How the weight tile reaches shared memory: "ptr" (per-thread async copies) or "tma" (one
    # tensor-memory-accelerator copy per tile, sm_90+; pointer loads where the weight tensor cannot
    # be described to the TMA unit, e.g. rows not a multiple of 16 bytes).
    weight_load: str = _knob("ptr", ("ptr", "tma"), "l", **_PATH)
    # How the K loop ends when K is not a multiple of block_k: "tail" (full steps without masks,
    # then one masked step after the loop, whose loads the compiler cannot prefetch) or "masked"
    # (every step masked, one loop the compiler pipelines to its last step).
    k_loop: str = _knob("tail", ("tail", "masked"), "k", **_LATE_PATH)
    # How a swapped tile (block_m <= 32, weights as the MMA's M side) multiplies one K step: "split"
    # (two dots of half depth, on the low and on the high halves of the scale groups, as the
    # layout's bytes hold them) or "joined" (the halves joined back into group order in registers,
    # one dot of full depth). Tiles of more rows always join.
    swapped_dot: str = _knob("split", ("split", "joined"), "d", **_LATE_PATH, swapped_only=True)

    def to_json(self) -> str:
        raw = {k.name: v for k, v in self.knob_values() if k.written(v, k.json_omits_default)}
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GemmTactic:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"a tactic is a JSON object, not {type(raw).__name__}")
        kinds = {k.name: type(k.default) for k in KNOBS}
        unknown = set(raw) - set(kinds)
        if unknown:
            raise ValueError(f"unknown tactic fields {sorted(unknown)}")
        for name, value in raw.items():
            # bool is an int to Python; no knob is a flag, so true/false is a wrong type here too
            if type(value) is not kinds[name] or (kinds[name] is int and value < 1):
                raise ValueError(
                    f"tactic field {name}={value!r}: expected a {kinds[name].__name__}"
                    + (" >= 1" if kinds[name] is int else "")
                )
        return cls(**raw)

    def key(self) -> str:
        return "".join(f"{k.tag}{v}" for k, v in self.knob_values() if k.written(v, k.key_omits_default))

    def knob_values(self) -> list[tuple[Knob, Any]]:
        """(knob, this tactic's value) in table order."""
        return [(k, getattr(self, k.name)) for k in KNOBS]


KNOBS: tuple[Knob, ...] = tuple(Knob(f.name, **f.metadata["knob"]) for f in fields(GemmTactic))
KNOB_NAMES: tuple[str, ...] = tuple(k.name for k in KNOBS)
# The code-path knobs: a kernel variant family is one value of each.
FAMILY_KNOBS: tuple[Knob, ...] = tuple(k for k in KNOBS if k.family)


def knob(name: str) -> Knob:
    """The knob called ``name``."""
    return KNOBS[KNOB_NAMES.index(name)]
