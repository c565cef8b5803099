"""The inline-PTX e2m1 -> e4m3 widening of the mxfp8 path, run on the CPU by a small interpreter of
the six PTX instructions it uses (semantics from the PTX ISA: ``prmt`` default and sign modes,
``lop3`` by its truth table). Every byte value at every position of the word is checked against
the e4m3 encoding of the e2m1 value (via torch's float8_e4m3fn), so a wrong table, selector or
truth table fails here before any GPU sees it; the GPU tests then run the same string."""

from __future__ import annotations

import random
import re

import pytest
import torch

from prepkit.kernels.activations import E2M1_VALUES
from prepkit.kernels.mx._mx import _ASM_E2M1_TO_E4M3

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:  # sign mode: the selected byte's top bit, replicated
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run the straight-line PTX block ``asm``; ``inputs``/result keyed by operand ("$2", ...)."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & M32 if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", tok) else regs[tok]

    for line in asm.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [s.strip() for s in args.split(",")]
        x = [val(s) for s in src]
        if op == "mov.b32":
            regs[d] = x[0]
        elif op == "and.b32":
            regs[d] = x[0] & x[1]
        elif op == "shr.b32":
            regs[d] = x[0] >> x[1]
        elif op == "shl.b32":
            regs[d] = (x[0] << x[1]) & M32
        elif op == "prmt.b32":
            regs[d] = _prmt(*x)
        elif op == "lop3.b32":
            regs[d] = _lop3(*x)
        else:
            raise AssertionError(f"the interpreter lacks {op}")
    return regs


def _e4m3_byte(code: int) -> int:
    value = torch.tensor([E2M1_VALUES[code]], dtype=torch.float32)
    return int(value.to(torch.float8_e4m3fn).view(torch.uint8))


def _widened(word: int) -> tuple[int, int]:
    """The two output words the MMA must read: byte p's low code, then its high code."""
    out = [_e4m3_byte((word >> (8 * p + 4 * t)) & 0xF) for p in range(4) for t in range(2)]
    return (
        sum(b << (8 * i) for i, b in enumerate(out[:4])),
        sum(b << (8 * i) for i, b in enumerate(out[4:])),
    )


@pytest.mark.parametrize("position", range(4))
def test_every_byte_at_every_position(position):
    rng = random.Random(position)
    for byte in range(256):
        word = rng.getrandbits(32) & ~(0xFF << (8 * position)) | (byte << (8 * position))
        regs = run_ptx(_ASM_E2M1_TO_E4M3.value, {"$2": word})
        assert (regs["$0"], regs["$1"]) == _widened(word), f"byte {byte:#04x} at position {position}"


def test_random_words():
    rng = random.Random(7)
    for _ in range(2000):
        word = rng.getrandbits(32)
        regs = run_ptx(_ASM_E2M1_TO_E4M3.value, {"$2": word})
        assert (regs["$0"], regs["$1"]) == _widened(word)


def test_the_interpreter_catches_a_wrong_table():
    broken = _ASM_E2M1_TO_E4M3.value.replace("0x4C484440", "0x4C484840")
    regs = run_ptx(broken, {"$2": 0x55555555})  # every code is 5 (3.0)
    assert (regs["$0"], regs["$1"]) != _widened(0x55555555)
