"""A tactic is a value: one kernel variant's knobs, for one GEMM of the MoE layer."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, order=True)
class GemmTactic:
    """Launch knobs of one GEMM (GEMM1 = gate/up + SwiGLU, GEMM2 = down + combine)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    # How fp4 becomes a matrix-unit operand: "bits" (integer unpack + scale in registers, then a
    # bf16 dot; works on every arch) or "dot_scaled" (tl.dot_scaled; native where the arch has
    # block-scaled MMA, emulated by the compiler elsewhere).
    upcast: str = "bits"
    # How the weight tile reaches shared memory: "ptr" (per-thread async copies) or "tma" (one
    # tensor-memory-accelerator copy per tile, sm_90+; pointer loads where the weight tensor cannot
    # be described to the TMA unit, e.g. rows not a multiple of 16 bytes).
    weight_load: str = "ptr"
    # How the K loop ends when K is not a multiple of block_k: "tail" (full steps without masks,
    # then one masked step after the loop, whose loads the compiler cannot prefetch) or "masked"
    # (every step masked, one loop the compiler pipelines to its last step).
    k_loop: str = "tail"
    # How a swapped tile (block_m <= 32, weights as the MMA's M side) multiplies one K step: "split"
    # (two dots of half depth, on the low and on the high halves of the scale groups, as the
    # layout's bytes hold them) or "joined" (the halves joined back into group order in registers,
    # one dot of full depth). Tiles of more rows always join.
    swapped_dot: str = "split"

    def to_json(self) -> str:
        raw = asdict(self)
        if raw["k_loop"] == "tail":
            # Tactics stored before the field existed keep their JSON, so tactic DB rows still match.
            del raw["k_loop"]
        if raw["swapped_dot"] == "split":
            del raw["swapped_dot"]
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GemmTactic:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"a tactic is a JSON object, not {type(raw).__name__}")
        kinds = {f.name: type(f.default) for f in fields(cls)}
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
        base = f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}sk{self.split_k}"
        # The default upcast keeps the key of tactics stored before the field existed.
        key = base if self.upcast == "bits" else f"{base}u{self.upcast}"
        key = key if self.weight_load == "ptr" else f"{key}l{self.weight_load}"
        key = key if self.k_loop == "tail" else f"{key}k{self.k_loop}"
        return key if self.swapped_dot == "split" else f"{key}d{self.swapped_dot}"
